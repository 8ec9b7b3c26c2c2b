"""BlockManager bookkeeping: block ids, refcounts, free-queue order, forks, host swap pool.
(The prefix cache: test_prefix_cache.py.)

No model and no tensors: a "computed" token is simulated the way the engine core does it
(`seq.num_computed_tokens += n; block_manager.cache_full_blocks(seq)`), and every expected value
below follows from the algorithm described in `ksana_llm/engine/kv_cache.py`:

* new blocks are taken from the front of the free queue;
* a block whose refcount drops to zero goes to the back of the free queue if it holds a cached
  (hashed) full block, to the very front otherwise;
* `free` releases a sequence's blocks tail first;
* a full block's key is hash(parent key, its tokens); a partial block is never published;
* `match_prefix` always leaves at least one token to compute.
"""

from __future__ import annotations

import pytest

from ksana_llm.engine.kv_cache import BlockManager, PrefixMatch
from ksana_llm.engine.request import Sequence
from tests.kv_cache_harness import H0, H1, PROMPT10, admit, compute, free_queue, make_seq


# ---- construction and queries --------------------------------------------------------------
def test_initial_state():
    bm = BlockManager(8, 4)
    assert free_queue(bm) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 8
    assert bm.ref_counts == [0] * 8
    assert bm.block_key == [None] * 8
    assert bm.cached_blocks == {}
    assert bm.usage == 0.0
    assert bm.free_host_blocks == []
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_host_pool_hands_out_lowest_ids_first():
    bm = BlockManager(4, 4, num_host_blocks=3)
    # free_host_blocks is a stack: pop() gives 0, then 1, then 2.
    assert bm.free_host_blocks == [2, 1, 0]


# ---- allocation ----------------------------------------------------------------------------
def test_allocate_takes_blocks_from_front_of_free_queue():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq("a", PROMPT10)
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0, 0, 0]
    assert free_queue(bm) == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)

    b = make_seq("b", [50, 51, 52, 53, 54])
    assert bm.allocate(b, 5)
    assert b.block_table == [3, 4]
    assert free_queue(bm) == [5, 6, 7]


def test_allocate_grows_only_when_a_block_boundary_is_crossed():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq("a", PROMPT10)
    assert bm.allocate(a, 10)
    compute(bm, a)
    # Decodes of tokens 11 and 12 fit in block 2 (which holds tokens 9..12).
    for token in (100, 101):
        a.output_token_ids.append(token)
        assert bm.allocate(a, 1)
        assert a.block_table == [0, 1, 2]
        compute(bm, a)
    # Token 13 needs a fourth block.
    a.output_token_ids.append(102)
    assert bm.allocate(a, 1)
    assert a.block_table == [0, 1, 2, 3]
    assert free_queue(bm) == [4, 5, 6, 7]


def test_allocate_failure_changes_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a = make_seq("a", range(12))
    assert bm.allocate(a, 12)  # blocks 0, 1, 2
    b = make_seq("b", range(100, 108))
    assert not bm.allocate(b, 8)  # needs 2 blocks, 1 free
    assert b.block_table == []
    assert bm.ref_counts == [1, 1, 1, 0]
    assert free_queue(bm) == [3]
    # A sequence that already holds blocks and cannot grow is left as it was, too.
    compute(bm, a)
    a.output_token_ids.append(7)
    assert bm.allocate(a, 1)
    assert a.block_table == [0, 1, 2, 3]
    compute(bm, a)
    for t in range(4):
        a.output_token_ids.append(t)
    assert not bm.allocate(a, 4)
    assert a.block_table == [0, 1, 2, 3]
    assert bm.ref_counts == [1, 1, 1, 1]
    assert free_queue(bm) == []


# ---- free and free-queue order -------------------------------------------------------------
def test_free_without_prefix_caching_puts_blocks_at_front():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = make_seq("a", PROMPT10), make_seq("b", range(5))
    assert bm.allocate(a, 10) and bm.allocate(b, 5)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    assert free_queue(bm) == [5, 6, 7]

    bm.free(a)
    # Released tail first (2, 1, 0), each moved to the front: nothing in them is reusable.
    assert free_queue(bm) == [0, 1, 2, 5, 6, 7]
    assert a.block_table == []
    assert a.num_registered_blocks == 0
    assert bm.ref_counts == [0, 0, 0, 1, 1, 0, 0, 0]

    bm.free(b)
    assert free_queue(bm) == [3, 4, 0, 1, 2, 5, 6, 7]
    assert bm.ref_counts == [0] * 8
    assert bm.usage == 0.0
    assert bm.cached_blocks == {}


def test_free_puts_cached_blocks_at_back_tail_first():
    bm = BlockManager(6, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.cached_blocks == {H0: 0, H1: 1}
    assert free_queue(bm) == [3, 4, 5]

    bm.free(a)
    # Block 2 (partial, uncached) goes to the front; the cached blocks go to the back, tail (1)
    # before head (0), so the head of the prefix is evicted last.
    assert free_queue(bm) == [2, 3, 4, 5, 1, 0]
    # Freed cached blocks keep their keys until they are evicted.
    assert bm.cached_blocks == {H0: 0, H1: 1}
    assert bm.block_key[:3] == [H0, H1, None]
    assert bm.num_free_blocks == 6
    assert bm.usage == 0.0


def test_eviction_order_least_recently_freed_cached_block_first():
    bm = BlockManager(8, 2)
    a = make_seq("a", [1, 2, 3, 4])
    b = make_seq("b", [5, 6, 7, 8])
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    ka = a.block_hashes
    kb = b.block_hashes
    assert bm.cached_blocks == {ka[0]: 0, ka[1]: 1, kb[0]: 2, kb[1]: 3}

    bm.free(a)
    bm.free(b)
    assert free_queue(bm) == [4, 5, 6, 7, 1, 0, 3, 2]

    # 5 blocks: the 4 never-used ones, then the least recently freed cached block (a's tail).
    c = make_seq("c", range(100, 110))
    assert bm.allocate(c, 10)
    assert c.block_table == [4, 5, 6, 7, 1]
    assert free_queue(bm) == [0, 3, 2]
    # The evicted block's key is forgotten; the others survive.
    assert bm.block_key[1] is None
    assert bm.cached_blocks == {ka[0]: 0, kb[0]: 2, kb[1]: 3}
    assert bm.match_prefix(make_seq("a2", [1, 2, 3, 4, 9])) == PrefixMatch([0], 2)
    assert bm.match_prefix(make_seq("b2", [5, 6, 7, 8, 9])) == PrefixMatch([2, 3], 4)

    # One more: a's head (block 0) goes next, then b's tail (3).
    d = make_seq("d", range(200, 204))
    assert bm.allocate(d, 4)
    assert d.block_table == [0, 3]
    assert free_queue(bm) == [2]
    assert bm.cached_blocks == {kb[0]: 2}
    assert bm.block_key == [None, None, kb[0], None, None, None, None, None]
    assert bm.match_prefix(make_seq("a3", [1, 2, 3, 4, 9])) == PrefixMatch([], 0)
    assert bm.match_prefix(make_seq("b3", [5, 6, 7, 8, 9])) == PrefixMatch([2], 2)


# ---- fork ----------------------------------------------------------------------------------
def test_fork_shares_blocks_by_refcount():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    parent = make_seq("p", range(8))
    assert bm.allocate(parent, 8)
    child = make_seq("c", range(8))
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert child.block_table is not parent.block_table
    assert bm.ref_counts[:2] == [2, 2]
    assert free_queue(bm) == [2, 3, 4, 5]

    bm.free(parent)
    assert bm.ref_counts[:2] == [1, 1]
    assert free_queue(bm) == [2, 3, 4, 5]
    bm.free(child)
    assert bm.ref_counts[:2] == [0, 0]
    assert free_queue(bm) == [0, 1, 2, 3, 4, 5]


def test_fork_copies_the_prefix_chain():
    bm = BlockManager(8, 4)
    parent = make_seq("p", PROMPT10)
    admit(bm, parent)
    child = make_seq("c", PROMPT10)
    bm.fork(parent, child)
    assert child.block_hashes == parent.block_hashes == [H0, H1]
    assert child.block_hashes is not parent.block_hashes
    assert child.num_registered_blocks == 2


def _forked_pair(num_blocks: int = 6) -> tuple[BlockManager, Sequence, Sequence]:
    """A 10-token prompt computed once (blocks 0, 1 and 2 tokens of block 2), then forked: both
    sequences sampled a different 11th token, whose KV is not computed yet."""
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    parent = make_seq("p", PROMPT10)
    admit(bm, parent)
    child = make_seq("c", PROMPT10)
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    parent.output_token_ids.append(100)
    child.output_token_ids.append(200)
    return bm, parent, child


def test_writing_a_shared_partial_block_copies_it_first():
    bm, parent, child = _forked_pair()
    assert bm.ref_counts[:3] == [2, 2, 2] and free_queue(bm) == [3, 4, 5]
    # The child writes position 10, inside shared block 2: it gets block 3, a copy of block 2.
    assert bm.allocate(child, 1)
    assert child.block_table == [0, 1, 3] and parent.block_table == [0, 1, 2]
    assert bm.take_copies() == [(2, 3)] and bm.take_copies() == []
    assert bm.ref_counts[:4] == [2, 2, 1, 1] and free_queue(bm) == [4, 5]
    # The parent is now the only owner of block 2: it writes in place, no copy.
    assert bm.allocate(parent, 1)
    assert parent.block_table == [0, 1, 2] and bm.take_copies() == []
    # Full shared blocks are never copied: crossing into a new block just allocates one.
    compute(bm, child, 1)
    child.output_token_ids.append(201)
    assert bm.allocate(child, 2)
    assert child.block_table == [0, 1, 3, 4] and bm.take_copies() == []


def test_copy_on_write_needs_a_free_block_and_fails_cleanly():
    bm, parent, child = _forked_pair(num_blocks=3)
    assert free_queue(bm) == []
    assert not bm.allocate(child, 1)
    assert child.block_table == [0, 1, 2] and bm.ref_counts == [2, 2, 2]
    assert bm.take_copies() == []
    bm.free(parent)  # the other owner goes away: the child may now write in place
    assert bm.allocate(child, 1) and bm.take_copies() == []


def test_block_boundary_fork_needs_no_copy():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    parent = make_seq("p", range(8))
    admit(bm, parent)
    child = make_seq("c", range(8))
    bm.fork(parent, child)
    child.num_computed_tokens = 8
    child.output_token_ids.append(1)
    assert bm.allocate(child, 1)
    assert child.block_table == [0, 1, 2] and bm.take_copies() == []


def test_peak_used_blocks_tracks_the_high_water_mark():
    bm, parent, child = _forked_pair()
    assert bm.peak_used_blocks == 3  # forking shares: no new block
    bm.allocate(child, 1)
    assert bm.peak_used_blocks == 4
    bm.free(child)
    bm.free(parent)
    assert bm.num_used_blocks == 0 and bm.peak_used_blocks == 4


def test_sequences_with_input_embeddings_never_touch_the_prefix_cache():
    bm = BlockManager(8, 4)
    a = make_seq("a", PROMPT10)
    a.embeddings = ((0,), None)
    admit(bm, a)
    assert bm.cached_blocks == {}  # not published: same ids, different KV
    b = make_seq("b", PROMPT10)
    admit(bm, b)
    c = make_seq("c", PROMPT10)
    c.embeddings = ((1,), None)
    assert bm.match_prefix(c) == PrefixMatch([], 0)  # b's blocks are cached, but not for c
    d = make_seq("d", PROMPT10)
    d.prompt_logprobs = {}
    assert bm.match_prefix(d) == PrefixMatch([], 0)  # every prompt row must be computed
    assert bm.match_prefix(make_seq("e", PROMPT10)).num_tokens == 8


# ---- host swap pool ------------------------------------------------------------------------
def test_swap_out_and_in_mappings():
    bm = BlockManager(4, 4, num_host_blocks=3)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert free_queue(bm) == [3]

    mapping = bm.swap_out(a)
    assert mapping == [(0, 0), (1, 1), (2, 2)]
    assert a.host_block_table == [0, 1, 2]
    assert a.block_table == []
    assert a.num_computed_tokens == 10  # the KV lives on the host now
    assert bm.free_host_blocks == []
    assert bm.ref_counts == [0, 0, 0, 0]
    assert free_queue(bm) == [2, 3, 1, 0]
    assert bm.cached_blocks == {H0: 0, H1: 1}

    # Swap back in with room for one decode token (11 tokens -> 3 blocks), front of the queue first.
    a.output_token_ids.append(500)
    mapping = bm.swap_in(a, 1)
    assert mapping == [(0, 2), (1, 3), (2, 1)]
    assert a.block_table == [2, 3, 1]
    assert a.host_block_table == []
    assert bm.free_host_blocks == [2, 1, 0]
    assert free_queue(bm) == [0]
    # Block 1 was a's old cached block: reusing it evicted its key.
    assert bm.cached_blocks == {H0: 0}
    assert bm.block_key == [H0, None, None, None]

    # The swapped-in blocks are published again as tokens are computed on them.
    compute(bm, a, 1)
    assert a.num_computed_tokens == 11
    assert bm.cached_blocks == {H0: 0, H1: 3}
    assert bm.block_key == [H0, None, None, H1]


def test_swap_out_needs_room_for_every_block():
    bm = BlockManager(4, 4, num_host_blocks=2)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    assert bm.swap_out(a) is None
    assert a.block_table == [0, 1, 2]
    assert a.host_block_table == []
    assert bm.free_host_blocks == [1, 0]
    assert bm.ref_counts == [1, 1, 1, 0]
    assert free_queue(bm) == [3]


def test_swap_in_needs_free_device_blocks():
    bm = BlockManager(4, 4, num_host_blocks=4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    assert bm.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    b = make_seq("b", range(100, 108))
    assert bm.allocate(b, 8)
    assert b.block_table == [2, 3]
    assert free_queue(bm) == [1, 0]

    a.output_token_ids.append(500)
    assert bm.swap_in(a, 1) is None
    assert a.block_table == []
    assert a.host_block_table == [0, 1, 2]
    assert bm.free_host_blocks == [3]
    assert free_queue(bm) == [1, 0]

    bm.free(b)
    assert free_queue(bm) == [2, 3, 1, 0]
    assert bm.swap_in(a, 1) == [(0, 2), (1, 3), (2, 1)]
    assert bm.free_host_blocks == [3, 2, 1, 0]


def test_swap_out_of_shared_blocks_keeps_other_owner():
    bm = BlockManager(6, 4, num_host_blocks=4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    b = make_seq("b", PROMPT10)
    prefix = admit(bm, b)
    assert prefix == PrefixMatch([0, 1], 8)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts == [2, 2, 1, 1, 0, 0]

    assert bm.swap_out(b) == [(0, 0), (1, 1), (3, 2)]
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0]
    assert free_queue(bm) == [3, 4, 5]
    assert bm.free_host_blocks == [3]

    bm.free_host(b)
    assert b.host_block_table == []
    assert bm.free_host_blocks == [3, 2, 1, 0]


# ---- fresh blocks (cleared by the runner before their new owner writes) -----------------------
def test_fresh_blocks_are_the_newly_handed_out_ones_once():
    bm = BlockManager(8, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    assert bm.take_fresh_blocks() == [0, 1, 2] and bm.take_fresh_blocks() == []
    # Decode tokens inside the last block take nothing new; crossing a boundary takes one.
    a.output_token_ids.extend([500, 501])
    assert bm.allocate(a, 2) and bm.take_fresh_blocks() == []
    compute(bm, a, 2)
    a.output_token_ids.append(502)
    assert bm.allocate(a, 1) and a.block_table == [0, 1, 2, 3]
    assert bm.take_fresh_blocks() == [3]


def test_adopted_prefix_blocks_and_copy_destinations_are_not_fresh():
    """Both hold KV already: a cached prefix the new owner reads, a fork's copy of a partial
    block. Only the blocks after a prefix hit are fresh."""
    bm = BlockManager(8, 4)
    admit(bm, make_seq("a", PROMPT10))
    bm.take_fresh_blocks()
    b = make_seq("b", PROMPT10)
    match = admit(bm, b)
    assert match.block_ids == [0, 1] and b.block_table == [0, 1, 3]
    assert bm.take_fresh_blocks() == [3]
    bm, parent, child = _forked_pair()
    bm.take_fresh_blocks()
    assert bm.allocate(child, 1) and bm.take_copies() == [(2, 3)]
    assert bm.take_fresh_blocks() == []


def test_swapped_in_blocks_are_fresh():
    """A swap-in's blocks are cleared first (the swap's copy then fills them); the block it
    adds for the new token is only cleared."""
    bm = BlockManager(4, 4, num_host_blocks=3)
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    bm.swap_out(a)
    bm.take_fresh_blocks()
    a.output_token_ids.append(500)
    mapping = bm.swap_in(a, 1)
    assert [device for _, device in mapping] == a.block_table[:2]
    assert bm.take_fresh_blocks() == a.block_table and len(a.block_table) == 3
