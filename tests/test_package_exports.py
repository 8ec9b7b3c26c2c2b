"""The package's public names: resolved lazily on first use (so light entry points such as the
bench client and the CLI's argument parsing never import torch), and `__all__` kept whole."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_light_entry_points_do_not_import_torch():
    # The package resolves its public names lazily; the bench client and the CLI's argument
    # parsing must stay usable (and fast) on a machine that only sends requests.
    code = ("import sys, ksana_llm, ksana_llm.cli, ksana_llm.bench.client\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print(','.join(heavy) or 'none')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "none"


def test_package_exports_resolve_on_first_use():
    import ksana_llm
    from ksana_llm.api.engine import Engine
    from ksana_llm.generation_config import GenerationConfig

    assert ksana_llm.Engine is Engine
    namespace: dict = {}
    exec("from ksana_llm import *", namespace)
    assert namespace["GenerationConfig"] is GenerationConfig
    assert set(ksana_llm.__all__) <= set(namespace) and set(ksana_llm.__all__) <= set(dir(ksana_llm))
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(ksana_llm, "no_such_name")


def test_package_all_lists_every_lazy_export():
    import ksana_llm

    assert set(ksana_llm.__all__) == {*ksana_llm._EXPORTS, "__version__"}
