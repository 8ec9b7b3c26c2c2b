"""Whether the forward running now takes the fused Triton kernels (RMSNorm + residual, in-place
RoPE, MoE experts grouped into one launch per weight stack) or the torch ops.

The choice belongs to the engine that runs the forward, not to the modules: one loaded `Model`
may serve several engines at once, some on the Triton backend and some on torch, so a flag set on
the shared modules by one engine would switch every other engine's numbers too. The runner sets
this for the duration of each step (`use_fused_kernels`); modules read it (`fused_kernels_on`).
A context variable rather than a global: each engine loop thread sees only its own setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_FUSED_KERNELS: ContextVar[bool] = ContextVar("ksana_llm_fused_kernels", default=False)


def fused_kernels_on() -> bool:
    """True inside `use_fused_kernels(True)`; False elsewhere (the torch ops)."""
    return _FUSED_KERNELS.get()


@contextmanager
def use_fused_kernels(enabled: bool) -> Iterator[None]:
    """Run the enclosed forwards with (or without) the fused Triton kernels."""
    token = _FUSED_KERNELS.set(enabled)
    try:
        yield
    finally:
        _FUSED_KERNELS.reset(token)
