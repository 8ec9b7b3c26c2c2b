"""`Model.from_pretrained`: a checkpoint folder (or GGUF file, or nothing) to weights on a device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ksana_llm.loader import iterate_weights, load_hf_config, resolve_model_dir
from ksana_llm.models.registry import model_class_for

logger = logging.getLogger("ksana_llm.model")

_DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32})


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        # CPUs are fastest and exact in float32; GPUs want half precision.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {dtype!r}")
    return _DTYPES[dtype]


def _eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that order."""
    found: list[int] = []
    sources: list[Any] = []
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        import json

        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for value in sources:
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def _load_tokenizer(model_dir: Path) -> Any:
    """The folder's tokenizer, or None (weights-only folders still run on token ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        logger.warning("no usable tokenizer in %s (%s); pass one to Engine(tokenizer=...)",
                       model_dir, exc)
        return None


@dataclass
class Model:
    """Weights on a device plus what the engine needs to drive them."""

    module: nn.Module
    hf_config: Any
    tokenizer: Any
    path: Path
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @property
    def max_context(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None, *, device: str | None = "auto",
                        dtype: str | torch.dtype | None = "auto", tensor_parallel_size: int = 1,
                        progress: bool = True) -> Model:
        """Load an HF folder, a .gguf file, or (path None) the embedded SmolLM2-135M-Instruct."""
        if tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size must be 1 (tensor parallelism is not built yet)")
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        model_dir = resolve_model_dir(path)
        hf_config = load_hf_config(model_dir)
        model_cls = model_class_for(hf_config)
        # Build on the meta device so no memory is touched before the real weights arrive.
        with torch.device("meta"):
            module = model_cls(hf_config)
        module = module.to(torch_dtype).to_empty(device=torch_device)
        module.load_weights(iterate_weights(model_dir, progress=progress))
        module.eval()
        tokenizer = _load_tokenizer(model_dir)
        logger.info("loaded %s (%s) on %s as %s", model_dir, model_cls.__name__, torch_device,
                    torch_dtype)
        return cls(module, hf_config, tokenizer, Path(model_dir), torch_device, torch_dtype,
                   _eos_token_ids(Path(model_dir), hf_config, tokenizer))
