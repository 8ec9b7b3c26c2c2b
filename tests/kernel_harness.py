"""Shared setup and helpers of the Triton kernel tests (tests/test_kernels.py,
tests/test_kernels_layers.py, tests/test_kernels_prefill.py).

Triton reads TRITON_INTERPRET once, when it is first imported, so without CUDA the switch to its
interpreter has to happen before anything imports triton or ksana_llm.kernels. This module does
that first thing on import, which is why every kernel test module imports it before anything
else. The rest is what those modules share: the device and dtypes under test with their
tolerances, the `device` fixture, paged K/V batches at random blocks, and dense attention built
from first principles.
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# (atol, rtol) of a kernel against the fp32-math reference on the same inputs.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 2e-2), torch.bfloat16: (3e-2, 5e-2)}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(params=[DEVICE], name="device")
def device_fixture(request) -> str:
    """The device the kernels run on: cuda natively when present, else cpu (interpreter).

    Test modules import it as `device_fixture` and ask for it as `device`: a plain `device`
    import would be shadowed by every test's `device` parameter (ruff F811)."""
    return request.param


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------
# A batch of sequences whose K/V live in a paged cache at random, non-contiguous blocks.
# --------------------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32
    lens: list[int]
    dense_k: list[torch.Tensor]  # per sequence [L, Hkv, D]: what was scattered into the cache
    dense_v: list[torch.Tensor]


def make_paged_batch(lens: list[int], *, block_size: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: str, seed: int = 0,
                     v_head_dim: int | None = None) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    v_head_dim = v_head_dim or head_dim
    per_seq = [-(-n // block_size) for n in lens]
    width = max(per_seq + [1]) + 1  # a spare column: its (junk) block must never be read
    num_blocks = sum(per_seq) + 3  # spare blocks full of noise
    # Noise everywhere, so a kernel reading a slot it should not changes its result.
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, v_head_dim, generator=gen)
    block_tables = torch.randint(0, num_blocks, (len(lens), width), generator=gen,
                                 dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen)
    dense_k, dense_v = [], []
    used = 0
    for b, n in enumerate(lens):
        block_tables[b, :per_seq[b]] = order[used:used + per_seq[b]].int()
        used += per_seq[b]
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, v_head_dim, generator=gen)
        pos = torch.arange(n)
        blocks = block_tables[b].long()[pos // block_size]
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        dense_k.append(k.to(device, dtype))
        dense_v.append(v.to(device, dtype))
    return PagedBatch(k_cache.to(device, dtype), v_cache.to(device, dtype),
                      block_tables.to(device), list(lens), dense_k, dense_v)


def random_q(num: int, heads: int, head_dim: int, dtype: torch.dtype, device: str,
             seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num, heads, head_dim, generator=gen).to(device, dtype)


def slopes_for(heads: int, device: str) -> torch.Tensor:
    # Gentle slopes, so that keys hundreds of tokens back still carry weight.
    return torch.linspace(0.004, 0.06, heads, device=device)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    scale: float, window: int | None, slopes: torch.Tensor | None
                    ) -> torch.Tensor:
    """SDPA over unpaged K/V with the mask built from first principles: q [n, Hq, D] at
    absolute positions q_pos, k / v [L, Hkv, *] at positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k_pos = torch.arange(k.shape[0], device=q.device)
    dist = q_pos[:, None] - k_pos[None, :]  # how far back each key is
    visible = (dist >= 0) & ((dist < window) if window else True)
    bias = torch.zeros(q.shape[1], *dist.shape, device=q.device)
    if slopes is not None:
        bias = -slopes.float()[:, None, None] * dist[None].float()
    bias = bias.masked_fill(~visible[None], float("-inf"))
    # The math backend: exact fp32 on CUDA too (no fused kernel with its own precision).
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None],
            k.float().repeat_interleave(group, 1).transpose(0, 1)[None],
            v.float().repeat_interleave(group, 1).transpose(0, 1)[None],
            attn_mask=bias[None], scale=scale)
    return out[0].transpose(0, 1)


WINDOW_ALIBI = [pytest.param(None, False, id="plain"), pytest.param(24, False, id="window"),
                pytest.param(None, True, id="alibi"), pytest.param(40, True, id="window+alibi")]


# (query tokens, context tokens) per sequence: a one-token extend, a fresh prefill longer than a
# query block, a chunk after a cached prefix, an empty slot, a chunk after a long prefix.
PREFILL_SEQS = [(1, 1), (70, 70), (5, 37), (0, 12), (20, 130)]


def prefill_inputs(seqs, *, block_size, kv_heads, heads, head_dim, dtype, device, seed=0,
                   v_head_dim=None):
    batch = make_paged_batch([n for _, n in seqs], block_size=block_size, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=dtype, device=device, seed=seed,
                             v_head_dim=v_head_dim)
    q_lens = torch.tensor([m for m, _ in seqs])
    starts = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(device, torch.int32)
    q = random_q(int(q_lens.sum()), heads, head_dim, dtype, device, seed=seed + 1)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    return batch, q, starts, lens
