"""kernels layer of ksana_llm (see DESIGN.md §1): Triton kernels, each with a torch reference.

    store_kv(k, v, k_cache, v_cache, slot_mapping)                         kv_store.py
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *,
                           sliding_window=None, alibi_slopes=None, softcap=None,
                           num_splits=None, out=None)
    choose_num_splits(batch_size, num_kv_heads, max_context, num_sms)      decode_attention.py
    paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                            *, sliding_window=None, alibi_slopes=None, softcap=None, out=None)
                                                                           prefill_attention.py
    rms_norm(x, weight, eps, residual=None)                                rmsnorm.py
    fp8_linear(x, weight, scale, group_size, bias=None, zero_point=None)   fp8_matmul.py
    apply_rotary_(q, k, cos, sin, *, norm_weights=None, eps=1e-6, write_kv=None)
                                                                           rotary.py
    silu_and_mul(x)                                                        gated_activation.py
    align_to_experts(experts, num_experts, block_m), expert_block_size(assignments, experts),
    expert_matmul(a, weight, blocks, rows_per_input)                       fused_moe.py
    reference.*: the torch definitions of all of the above

Importing this package never imports triton: the engine core imports layers that import this
package on machines without triton. Kernel names resolve on first attribute access (PEP 562), and
that is when triton is imported — which must come after TRITON_INTERPRET is set, since triton reads
it when the kernels are decorated. Check `triton_available()` before picking the Triton backend.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the names __getattr__ serves, for type checkers and IDEs
    from ksana_llm.kernels.decode_attention import (  # noqa: F401
        choose_num_splits, paged_decode_attention)
    from ksana_llm.kernels.fp8_matmul import fp8_linear  # noqa: F401
    from ksana_llm.kernels.fused_moe import (  # noqa: F401
        align_to_experts, expert_block_size, expert_matmul)
    from ksana_llm.kernels.gated_activation import silu_and_mul  # noqa: F401
    from ksana_llm.kernels.kv_store import store_kv  # noqa: F401
    from ksana_llm.kernels.prefill_attention import paged_prefill_attention  # noqa: F401
    from ksana_llm.kernels.rmsnorm import rms_norm  # noqa: F401
    from ksana_llm.kernels.rotary import apply_rotary_  # noqa: F401

# name -> submodule that defines it (a constant table, not state).
_LAZY = {
    "store_kv": "kv_store",
    "paged_decode_attention": "decode_attention",
    "choose_num_splits": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "rms_norm": "rmsnorm",
    "fp8_linear": "fp8_matmul",
    "apply_rotary_": "rotary",
    "silu_and_mul": "gated_activation",
    "align_to_experts": "fused_moe",
    "expert_block_size": "fused_moe",
    "expert_matmul": "fused_moe",
}

__all__ = ["triton_available", "interpreter_mode", *_LAZY]


def interpreter_mode() -> bool:
    """True when triton will run kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True when triton imports and can run here: on a CUDA device, or in interpreter mode."""
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or an install that cannot load (missing libraries)
        return False
    return torch.cuda.is_available() or interpreter_mode()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as exc:
        raise ImportError(f"ksana_llm.kernels.{name} needs triton (pip install triton): {exc}"
                          ) from exc


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
