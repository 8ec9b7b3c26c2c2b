"""Reading a checkpoint's `config.json` into a transformers config object."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ksana_llm.loader.json_files import read_json_object

logger = logging.getLogger("ksana_llm.loader")


def load_hf_config(model_dir: str | Path) -> Any:
    """The folder's config. Families whose configs live in remote code (Qwen v1, Baichuan) are
    unknown to transformers, and we never run remote code: for those, the plain keys of
    config.json in a `PretrainedConfig`, which our model classes read by name."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (ValueError, KeyError) as exc:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise
        logger.info("config.json of %s is not a transformers config (%s); reading its keys as they are",
                    model_dir, exc)
        data = read_json_object(path)
        # model_type is a read-only class attribute of PretrainedConfig: keep it on the instance.
        model_type = data.pop("model_type", None)
        config = PretrainedConfig(**data)
        config.__dict__["model_type"] = model_type
        return config
