"""vLLM's `load_format`: where a model's weights come from.

- "auto": the folder's safetensors, else its PyTorch `.bin` files (a `.gguf` path is converted);
- "safetensors" / "pt": only those files (a folder holding both reads the one named);
- "gguf": the path must be a `.gguf` file;
- "dummy": no weight files at all: every tensor the model's transformers architecture has is
  made up, deterministically, the way transformers initialises a fresh model (matrices from
  N(0, initializer_range), norm weights 1, biases 0). For profiling and benchmarks of a
  configuration whose weights are not at hand; the answers are noise.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["LOAD_FORMATS", "check_load_format", "dummy_weights"]

# config.LoadFormat spells the same (the config sits above the loader; a test holds them equal).
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
# vLLM's other formats: named in the refusal so a user knows it is not a typo.
_VLLM_ONLY = ("npcache", "tensorizer", "sharded_state", "bitsandbytes", "mistral",
              "runai_streamer", "runai_streamer_sharded", "fastsafetensors")


def check_load_format(load_format: str, path: str | Path | None = None) -> str:
    """`load_format`, or a ValueError naming what is wrong (`path`: the model as given)."""
    if load_format in _VLLM_ONLY:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of "
                         f"{', '.join(LOAD_FORMATS)}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                         f"{load_format!r}")
    # No path: the embedded default model, which is a GGUF file.
    if load_format == "gguf" and path is not None and not str(path).lower().endswith(".gguf"):
        raise ValueError(f"load_format 'gguf' needs the path of a .gguf file, got {path}")
    if load_format in ("safetensors", "pt") and path is not None \
            and str(path).lower().endswith(".gguf"):
        raise ValueError(f"load_format {load_format!r} reads a model folder's "
                         f"{'.safetensors' if load_format == 'safetensors' else '.bin'} files; "
                         f"{path} is a GGUF file (load_format 'auto' or 'gguf' reads it)")
    return load_format


def dummy_weights(hf_config: Any, seed: int = 0, *, sequence_classification: bool = False,
                  norm_offsets: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for every tensor of the checkpoint transformers would save for
    `hf_config`, made up (see the module docstring). Each tensor's values depend only on
    `seed` and its name, so every rank of a parallel run makes the same ones.
    `sequence_classification`: a `*ForSequenceClassification` checkpoint's (a `score` head).
    `norm_offsets`: the family stores norm weights as offsets from 1 (Gemma): they are 0."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if getattr(hf_config, "quantization_config", None):
        raise ValueError("load_format 'dummy' makes unquantized weights; this model's "
                         "config.json has a quantization_config")
    try:
        with torch.device("meta"):  # names and shapes only: no memory for the values
            skeleton = (AutoModelForSequenceClassification if sequence_classification
                        else AutoModelForCausalLM).from_config(hf_config)
    except Exception as exc:  # noqa: BLE001 - say why no dummy weights can be made
        raise ValueError(f"load_format 'dummy': transformers cannot build this model's "
                         f"architecture to learn its tensors ({type(exc).__name__}: {exc})"
                         ) from exc
    std = float(getattr(hf_config, "initializer_range", 0.02) or 0.02)
    seen: set[int] = set()
    for name, meta in skeleton.state_dict(keep_vars=True).items():
        if id(meta) in seen:
            continue  # a tied copy (lm_head of tied embeddings): a checkpoint stores it once
        seen.add(id(meta))
        yield name, _made_up(name, tuple(meta.shape), std, seed, norm_offsets)


def _made_up(name: str, shape: tuple[int, ...], std: float, seed: int,
             norm_offsets: bool) -> torch.Tensor:
    if len(shape) < 2:
        # Norm scales start at 1 (their absence would zero every activation); biases and
        # other vectors at 0, as transformers' _init_weights does.
        is_norm_scale = name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]
        fill = 1.0 if is_norm_scale and not norm_offsets else 0.0
        return torch.full(shape, fill, dtype=torch.float32)
    generator = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
