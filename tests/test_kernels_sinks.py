"""Attention sinks (GPT-OSS) in the Triton attention kernels against their torch references, and
the reference against sinks written out by hand (transformers' eager GPT-OSS attention: the sink
is one more column of the softmax, dropped before the values).

Without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set by
tests/kernel_harness.py before anything imports triton's kernels)."""

from __future__ import annotations

# First: without CUDA the harness switches triton to its interpreter before triton loads.
from tests.kernel_harness import (PREFILL_SEQS, assert_close, make_paged_batch, prefill_inputs,
                                  random_q)
from tests.kernel_harness import device_fixture  # noqa: F401  (the `device` fixture)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from ksana_llm import kernels  # noqa: E402
from ksana_llm.kernels import reference as ref  # noqa: E402

# Per-head sink logits: large ones take most of the weight, small ones almost none.
SINKS = [2.5, -1.0, 0.0, 6.0]


@pytest.mark.parametrize("window, num_splits", [(None, None), (None, 3), (20, 1), (None, 1)])
def test_decode_sinks(device, window, num_splits):
    """Sinks with the context in one split (folded into the kernel's own softmax) or several
    (folded in by the reduce step): equal to the reference, which differs from plain
    attention here."""
    heads, kv_heads, head_dim = 4, 2, 32
    batch = make_paged_batch([3, 24, 70], block_size=16, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=torch.float32, device=device)
    q = random_q(3, heads, head_dim, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    sinks = torch.tensor(SINKS, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.5)
    out = kernels.paged_decode_attention(*args, sliding_window=window, sinks=sinks,
                                         num_splits=num_splits)
    expected = ref.paged_decode_attention_ref(*args, sliding_window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
    plain = ref.paged_decode_attention_ref(*args, sliding_window=window)
    assert (expected - plain).abs().max() > 0.05


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_sinks(device, window):
    """Sinks over fresh prompts, chunks after a prefix and an empty slot: equal to the
    reference, which differs from plain attention here."""
    batch, q, starts, lens = prefill_inputs(PREFILL_SEQS, block_size=16, kv_heads=2, heads=4,
                                            head_dim=32, dtype=torch.float32, device=device)
    sinks = torch.tensor(SINKS, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, starts, lens, 0.5)
    out = kernels.paged_prefill_attention(*args, sliding_window=window, sinks=sinks)
    expected = ref.paged_prefill_attention_ref(*args, sliding_window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
    plain = ref.paged_prefill_attention_ref(*args, sliding_window=window)
    assert (expected - plain).abs().max() > 0.05


def test_sinks_reference_is_an_extra_softmax_column():
    """The reference's sinks by hand: softmax over [scores, sink], the sink's column dropped."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    sinks = torch.tensor([1.5, -0.5])
    out = ref.attend_ref(q, k, v, torch.tensor([2, 3, 4]), 0.7, sinks=sinks)
    scores = torch.einsum("nhd,ld->hnl", q, k[:, 0]) * 0.7
    scores = scores.masked_fill(torch.arange(5)[None, :] > torch.tensor([2, 3, 4])[:, None],
                                float("-inf"))
    with_sink = torch.cat([scores, sinks[:, None, None].expand(2, 3, 1)], dim=-1)
    probs = torch.softmax(with_sink, -1)[..., :-1]
    expected = torch.einsum("hnl,ld->nhd", probs, v[:, 0])
    torch.testing.assert_close(out, expected)


def test_sinks_shape_is_checked(device):
    batch = make_paged_batch([5], block_size=16, kv_heads=2, head_dim=32,
                             dtype=torch.float32, device=device)
    q = random_q(1, 4, 32, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                       lens, 0.5, sinks=torch.zeros(3, device=device))
