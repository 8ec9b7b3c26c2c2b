"""Attention logit soft-capping (Gemma 2) in the Triton attention kernels against their torch
references, and the reference against soft-capping written out by hand.

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


@pytest.mark.parametrize("window, num_splits", [(None, None), (None, 3), (20, 1)])
def test_decode_softcap(device, window, num_splits):
    """Gemma 2's attention logit soft-capping, with the context in one split or several: equal
    to the reference, and (the scores being large for the cap) not to uncapped attention."""
    heads, kv_heads, head_dim = 4, 2, 32
    batch = make_paged_batch([3, 24, 70], block_size=16, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=torch.float32, device=device)
    q = random_q(3, heads, head_dim, torch.float32, device) * 4
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.5)
    out = kernels.paged_decode_attention(*args, sliding_window=window, softcap=1.0,
                                         num_splits=num_splits)
    expected = ref.paged_decode_attention_ref(*args, sliding_window=window, softcap=1.0)
    assert_close(out, expected, torch.float32)
    uncapped = ref.paged_decode_attention_ref(*args, sliding_window=window)
    assert (expected - uncapped).abs().max() > 0.05


def test_softcap_reference_is_tanh_capped_scores():
    """The reference's soft-capping by hand: softmax(cap * tanh(q.k * scale / cap)) v."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    out = ref.attend_ref(q, k, v, torch.tensor([2, 3, 4]), 0.7, softcap=2.0)
    scores = torch.einsum("nhd,ld->hnl", q, k[:, 0]) * 0.7
    scores = 2.0 * torch.tanh(scores / 2.0)
    scores = scores.masked_fill(torch.arange(5)[None, :] > torch.tensor([2, 3, 4])[:, None],
                                float("-inf"))
    expected = torch.einsum("hnl,ld->nhd", torch.softmax(scores, -1), v[:, 0])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_softcap(device, window):
    """Gemma 2's attention logit soft-capping over fresh prompts, chunks after a prefix and an
    empty slot: equal to the reference, which differs from uncapped attention here."""
    batch, q, starts, lens = prefill_inputs(PREFILL_SEQS, block_size=16, kv_heads=2, heads=4,
                                            head_dim=32, dtype=torch.float32, device=device)
    args = (q * 4, batch.k_cache, batch.v_cache, batch.block_tables, starts, lens, 0.5)
    out = kernels.paged_prefill_attention(*args, sliding_window=window, softcap=1.0)
    expected = ref.paged_prefill_attention_ref(*args, sliding_window=window, softcap=1.0)
    assert_close(out, expected, torch.float32)
    uncapped = ref.paged_prefill_attention_ref(*args, sliding_window=window)
    assert (expected - uncapped).abs().max() > 0.05
