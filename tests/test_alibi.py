"""ALiBi (Baichuan-13B): our slopes, an explicit torch reference, and paged attention with slopes.

The chain of evidence:
1. `alibi_slopes` equals the slopes of transformers' Bloom (`build_alibi_tensor`), an
   independent implementation, for power-of-two head counts and others;
2. `alibi_attention_reference` (written as Baichuan's remote code does it: scores plus
   slope * key position, causal) equals `scaled_dot_product_attention` with an explicit
   relative-distance bias matrix;
3. `paged_attention(..., alibi_slopes=)` equals the reference through the paged KV cache, for
   metadata built by the real `ModelRunner`: whole prefills, prefill chunks on a cached prefix,
   and decode groups padded to one length.
tests/test_family_baichuan.py builds the whole Baichuan-13B reference on (2).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from ksana_llm.layers.attention import paged_attention
from ksana_llm.models.baichuan import BaichuanForCausalLM, alibi_slopes
from ksana_llm.runner.model_runner import ModelRunner, SeqSlice


def alibi_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              slopes: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention of one sequence with ALiBi, as Baichuan-13B computes it: scores
    scaled, plus slope[h] * key position (the per-row constant -slope * query position drops out
    of the softmax), future keys masked. q, k, v: [L, H, D] (k/v heads repeated for GQA)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    length = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores + slopes[:, None, None] * torch.arange(length, dtype=q.dtype)[None, None, :]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_heads", [1, 4, 8, 12, 40])
def test_slopes_match_bloom(num_heads):
    # Bloom's tensor is slope * (token index) over the mask; index 1 is the slope itself.
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(num_heads), bloom, rtol=1e-6, atol=0)


def test_slopes_are_baichuans_geometric_sequence():
    assert alibi_slopes(8).tolist() == pytest.approx([2 ** (-(i + 1)) for i in range(8)])
    # Baichuan-13B: 40 heads = the 32-head sequence, then every other slope of the 64-head one.
    s40, s32, s64 = alibi_slopes(40), alibi_slopes(32), alibi_slopes(64)
    torch.testing.assert_close(s40, torch.cat([s32, s64[0::2][:8]]))
    with pytest.raises(ValueError, match="num_attention_heads"):
        alibi_slopes(0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_matches_sdpa_with_explicit_bias(num_heads, num_kv_heads):
    torch.manual_seed(0)
    length, dim = 23, 16
    q = torch.randn(length, num_heads, dim)
    k, v = torch.randn(length, num_kv_heads, dim), torch.randn(length, num_kv_heads, dim)
    slopes = alibi_slopes(num_heads)
    scale = dim ** -0.5
    pos = torch.arange(length)
    relative = (pos[None, :] - pos[:, None]).float()  # key - query
    bias = slopes[:, None, None] * relative
    bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=bias, scale=scale).transpose(0, 1)
    actual = alibi_attention_reference(q, k, v, slopes, scale)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # ALiBi matters here: without it the same attention differs.
    assert not torch.allclose(actual, alibi_attention_reference(q, k, v, slopes * 0, scale),
                              atol=1e-3)


def _runner(num_heads: int, num_kv_heads: int, dim: int) -> ModelRunner:
    """The real ModelRunner (it builds the metadata), on a tiny ALiBi Baichuan's KV spec."""
    config = SimpleNamespace(vocab_size=16, hidden_size=num_kv_heads * dim, num_hidden_layers=1,
                             num_attention_heads=num_kv_heads, intermediate_size=8,
                             model_max_length=128, position_embedding="alibi",
                             normalize_lm_head=False)
    with torch.device("meta"):
        model = BaichuanForCausalLM(config)
    return ModelRunner(model, device=torch.device("cpu"), dtype=torch.float32, num_blocks=64,
                       block_size=4)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_paged_attention_with_slopes_matches_reference(num_heads, num_kv_heads):
    """Sequences of q/k/v are fed through the paged cache in two steps of mixed work; every
    output row equals the dense reference's row at that position."""
    torch.manual_seed(1)
    dim, block = 16, 4
    runner = _runner(num_heads, num_kv_heads, dim)
    kv_cache = runner.kv_caches[0]
    slopes, scale = alibi_slopes(num_heads), dim ** -0.5
    lengths = [11, 9, 14, 6, 20]
    seqs = [(torch.randn(n, num_heads, dim), torch.randn(n, num_kv_heads, dim),
             torch.randn(n, num_kv_heads, dim)) for n in lengths]
    expected = [alibi_attention_reference(q, k, v, slopes, scale) for q, k, v in seqs]
    tables = [list(range(10 * i, 10 * i + math.ceil(n / block))) for i, n in enumerate(lengths)]
    # (sequence, first position, token count) per step. Step 1: plain prefills. Step 2: three
    # decodes of different context lengths (one padded group), a chunk on a cached prefix, and
    # a whole prefill.
    steps = [[(0, 0, 10), (1, 0, 8), (2, 0, 6)],
             [(0, 10, 1), (1, 8, 1), (3, 0, 5), (2, 6, 8), (4, 0, 20)],
             [(3, 5, 1)]]
    for work in steps:
        # Token id = 1000 * sequence + position: lets us find each row after the runner's reorder.
        slices = [SeqSlice([1000 * s + p for p in range(start, start + n)], start, tables[s], True)
                  for s, start, n in work]
        ids, _, meta, _, _ = runner.build(slices)
        rows = [(int(t) // 1000, int(t) % 1000) for t in ids]
        q = torch.stack([seqs[s][0][p] for s, p in rows])
        k = torch.stack([seqs[s][1][p] for s, p in rows])
        v = torch.stack([seqs[s][2][p] for s, p in rows])
        out = paged_attention(q, k, v, kv_cache, meta, scale, alibi_slopes=slopes)
        assert meta.decode_groups or not any(n == 1 for _, _, n in work)
        for row, (s, p) in enumerate(rows):
            torch.testing.assert_close(out[row], expected[s][p], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, s=s, p=p: f"sequence {s}, position {p}: {m}")
