"""The torch backend's KV cache layout: a [blocks, block_size, heads, dim] view of head-major
storage. Stores land where the view says; gathers return whole blocks in [.., heads, tokens, dim]
order; swap copies move whole blocks in runs; and a token-major cache is refused rather than read
wrongly."""

from __future__ import annotations

import pytest
import torch

from ksana_llm.layers.kv_cache_layout import (allocate_kv_cache, block_runs, copy_cache_blocks,
                                              gather_kv, gather_rows, store_kv)


def test_cache_is_a_head_major_view():
    cache = allocate_kv_cache(5, 4, 3, 8, dtype=torch.float32)
    assert cache.shape == (5, 4, 3, 8)
    assert cache.transpose(1, 2).is_contiguous()  # storage: [blocks, heads, block_size, dim]
    assert cache.stride(-1) == 1  # what the Triton kernels require


def test_swap_copies_move_whole_blocks_in_runs():
    assert block_runs([(4, 0), (5, 1), (6, 2), (9, 3), (2, 4), (3, 5), (7, 7)]) == [
        (4, 0, 3), (9, 3, 1), (2, 4, 2), (7, 7, 1)]
    assert block_runs([]) == []
    torch.manual_seed(0)
    device = allocate_kv_cache(10, 4, 3, 8, dtype=torch.float32)
    device.copy_(torch.randn(device.shape))
    host = allocate_kv_cache(8, 4, 3, 8, dtype=torch.float32, zero=False)
    mapping = [(4, 0), (5, 1), (6, 2), (9, 3), (2, 4), (3, 5), (7, 7)]
    copy_cache_blocks(device, host, block_runs(mapping))  # swap out
    for src, dst in mapping:
        assert torch.equal(host[dst], device[src])
    back = allocate_kv_cache(10, 4, 3, 8, dtype=torch.float32)
    returning = [(7, 0), (0, 1), (1, 2), (4, 8)]  # swap in, other blocks
    copy_cache_blocks(host, back, block_runs(returning))
    for src, dst in returning:
        assert torch.equal(back[dst], host[src])
    untouched = [b for b in range(10) if b not in {dst for _, dst in returning}]
    assert not back[untouched].any()


def test_store_then_gather_matches_plain_indexing():
    torch.manual_seed(0)
    blocks, block_size, heads, dim = 9, 4, 3, 8
    cache = allocate_kv_cache(blocks, block_size, heads, dim, dtype=torch.float32)
    reference = torch.zeros(blocks, block_size, heads, dim)
    slots = torch.randperm(blocks * block_size)[:20]
    values = torch.randn(20, heads, dim)
    store_kv(cache, (slots // block_size, slots % block_size), values)
    reference.view(-1, heads, dim)[slots] = values
    assert torch.equal(cache, reference)

    tables = torch.tensor([[3, 0, 7], [8, 2, 5]])  # two sequences, three blocks each
    got = gather_kv(cache, gather_rows(tables, heads), (2,))
    want = reference[tables].reshape(2, 3 * block_size, heads, dim).transpose(1, 2)
    assert got.shape == (2, heads, 3 * block_size, dim)
    assert torch.equal(got, want)
    one = gather_kv(cache, gather_rows(tables[1], heads), ())
    assert torch.equal(one, want[1])


def test_token_major_cache_is_refused():
    cache = torch.zeros(4, 4, 2, 8)  # contiguous [blocks, block_size, heads, dim]
    with pytest.raises(ValueError, match="head-major"):
        gather_kv(cache, gather_rows(torch.tensor([0, 1]), 2), ())
