"""The runner's side of an FP8 KV cache (`EngineConfig.kv_cache_dtype`): a check that the
attention backend can read it on this GPU. The storage type and the rounding are
`kernels.kv_quant`; each layer's scale reaches it through `AttentionMetadata.kv_scales`."""

from __future__ import annotations

import torch


def check_fp8_support(cache_dtype: torch.dtype, attention_backend: str,
                      device: torch.device) -> None:
    """Triton has E4M3 (`fp8e4nv`) on compute capability 8.9+ only; say so before any kernel
    fails to compile mid-step."""
    if cache_dtype != torch.float8_e4m3fn or attention_backend != "triton" \
            or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8_e4m3: the Triton kernels read E4M3 on compute "
                         f"capability 8.9+ (Ada, Hopper), this GPU is sm_{capability[0]}"
                         f"{capability[1]}; use fp8_e5m2 or attention_backend='torch'")
