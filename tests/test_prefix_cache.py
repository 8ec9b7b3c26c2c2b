"""BlockManager's prefix cache: hash chains, publishing computed full blocks, matching a
prompt's cached chain, reviving and sharing cached blocks.

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


from ksana_llm.engine.kv_cache import BlockManager, PrefixMatch, hash_block
from tests.kv_cache_harness import H0, H1, PROMPT10, admit, compute, free_queue, make_seq


# ---- prefix cache --------------------------------------------------------------------------
def test_hash_chain_depends_on_every_earlier_token():
    assert hash_block(None, (1, 2)) == hash_block(None, (1, 2))
    assert hash_block(None, (1, 2)) != hash_block(None, (2, 1))
    parent_a, parent_b = hash_block(None, (1, 2)), hash_block(None, (3, 4))
    assert hash_block(parent_a, (5, 6)) != hash_block(parent_b, (5, 6))


def test_block_hashes_cover_full_blocks_including_output_tokens():
    bm = BlockManager(8, 4)
    a = make_seq("a", [1, 2, 3, 4, 5, 6])
    bm.update_block_hashes(a)
    assert a.block_hashes == [H0]
    a.output_token_ids += [7, 8]
    bm.update_block_hashes(a)
    assert a.block_hashes == [H0, H1]


def test_cache_full_blocks_publishes_only_computed_full_blocks():
    bm = BlockManager(8, 4)
    a = make_seq("a", PROMPT10)
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]

    compute(bm, a, 3)  # block 0 not full yet
    assert bm.cached_blocks == {}
    assert a.num_registered_blocks == 0

    compute(bm, a, 3)  # 6 computed: block 0 full, block 1 half
    assert bm.cached_blocks == {H0: 0}
    assert bm.block_key[:3] == [H0, None, None]
    assert a.num_registered_blocks == 1

    compute(bm, a, 4)  # 10 computed: blocks 0 and 1 full, block 2 holds 2 tokens
    assert bm.cached_blocks == {H0: 0, H1: 1}
    assert bm.block_key[:3] == [H0, H1, None]
    assert a.num_registered_blocks == 2
    assert a.block_hashes == [H0, H1]

    # Calling it again changes nothing.
    bm.cache_full_blocks(a)
    assert bm.cached_blocks == {H0: 0, H1: 1}


def test_match_prefix_returns_the_cached_chain():
    bm = BlockManager(8, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)

    # Shares both full blocks.
    b = make_seq("b", list(range(1, 9)) + [99, 100, 101])
    assert bm.match_prefix(b) == PrefixMatch([0, 1], 8)
    # Shares the first block only.
    c = make_seq("c", [1, 2, 3, 4, 50, 6, 7, 8, 9])
    assert bm.match_prefix(c) == PrefixMatch([0], 4)
    # Same second-block tokens, different first block: the chain breaks at block 0.
    d = make_seq("d", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(d) == PrefixMatch([], 0)
    # Shorter than one full block + 1: nothing can match.
    e = make_seq("e", [1, 2, 3, 4])
    assert bm.match_prefix(e) == PrefixMatch([], 0)
    # Lookups alone are not counted: the scheduler records one per admitted request.
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    # Matching reserves nothing.
    assert bm.ref_counts[:3] == [1, 1, 1]


def test_full_prefix_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(8, 4)
    a = make_seq("a", range(1, 9))  # exactly 2 full blocks
    admit(bm, a)
    assert bm.cached_blocks == {H0: 0, H1: 1}

    # Identical 8-token prompt: only (8 - 1) // 4 = 1 block may be reused.
    b = make_seq("b", range(1, 9))
    prefix = bm.match_prefix(b)
    assert prefix == PrefixMatch([0], 4)
    assert bm.allocate(b, 4, prefix)
    assert b.block_table == [0, 2]
    assert bm.ref_counts[:3] == [2, 1, 1]
    assert b.num_registered_blocks == 1
    b.num_computed_tokens = prefix.num_tokens
    compute(bm, b)
    # b's block 2 holds the same tokens as a's block 1, whose key is already published: block 2
    # stays unkeyed and the cache still points at block 1.
    assert bm.cached_blocks == {H0: 0, H1: 1}
    assert bm.block_key[:3] == [H0, H1, None]
    assert b.num_registered_blocks == 2

    # One more token after the shared 8: both blocks are reused, 1 token is computed.
    c = make_seq("c", list(range(1, 9)) + [42])
    assert bm.match_prefix(c) == PrefixMatch([0, 1], 8)


def test_partial_last_block_is_never_shared():
    bm = BlockManager(8, 4)
    a = make_seq("a", [1, 2, 3, 4, 5, 6])  # block 1 holds 2 tokens
    admit(bm, a)
    assert a.block_table == [0, 1]
    assert bm.cached_blocks == {H0: 0}

    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(b) == PrefixMatch([0], 4)

    # Once a's decodes fill block 1 (tokens 7 and 8 are outputs), it is published.
    for token in (7, 8):
        a.output_token_ids.append(token)
        assert bm.allocate(a, 1)
        compute(bm, a)
    assert a.block_table == [0, 1]
    assert bm.cached_blocks == {H0: 0, H1: 1}
    assert bm.match_prefix(b) == PrefixMatch([0, 1], 8)


def test_adopting_cached_free_blocks_revives_them():
    bm = BlockManager(6, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    bm.free(a)
    assert free_queue(bm) == [2, 3, 4, 5, 1, 0]

    b = make_seq("b", PROMPT10)
    prefix = bm.match_prefix(b)
    assert prefix == PrefixMatch([0, 1], 8)
    assert bm.allocate(b, 2, prefix)
    # Blocks 0 and 1 leave the free queue; the third block is the front one (2).
    assert b.block_table == [0, 1, 2]
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0]
    assert free_queue(bm) == [3, 4, 5]
    assert b.num_registered_blocks == 2
    assert bm.cached_blocks == {H0: 0, H1: 1}


def test_adopting_blocks_in_use_shares_them():
    bm = BlockManager(6, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    b = make_seq("b", list(range(1, 9)) + [70, 71, 72, 73, 74])
    prefix = bm.match_prefix(b)
    assert prefix == PrefixMatch([0, 1], 8)
    assert bm.allocate(b, 5, prefix)
    assert b.block_table == [0, 1, 3, 4]
    assert bm.ref_counts == [2, 2, 1, 1, 1, 0]
    assert free_queue(bm) == [5]

    bm.free(a)
    # Shared blocks stay out of the free queue; a's partial block goes to the front.
    assert bm.ref_counts == [1, 1, 0, 1, 1, 0]
    assert free_queue(bm) == [2, 5]
    bm.free(b)
    # b computed nothing into blocks 3 and 4, so they are unkeyed and go to the front (released
    # tail first: 4, then 3); the cached blocks 1 and 0 go to the back.
    assert free_queue(bm) == [3, 4, 2, 5, 1, 0]


def test_allocate_counts_revived_blocks_against_free_space():
    bm = BlockManager(3, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    bm.free(a)
    assert free_queue(bm) == [2, 1, 0]

    # 14 tokens: blocks 0 and 1 revived + 2 new = 4 > 3 free.
    b = make_seq("b", PROMPT10 + [11, 12, 13, 14])
    prefix = bm.match_prefix(b)
    assert prefix == PrefixMatch([0, 1], 8)
    assert not bm.allocate(b, 6, prefix)
    assert b.block_table == []
    assert b.num_registered_blocks == 0
    assert bm.ref_counts == [0, 0, 0]
    assert free_queue(bm) == [2, 1, 0]
    assert bm.cached_blocks == {H0: 0, H1: 1}

    # 12 tokens fit exactly: 2 revived + 1 new (block 2).
    c = make_seq("c", PROMPT10 + [11, 12])
    prefix = bm.match_prefix(c)
    assert prefix == PrefixMatch([0, 1], 8)
    assert bm.allocate(c, 4, prefix)
    assert c.block_table == [0, 1, 2]
    assert free_queue(bm) == []


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    assert bm.cached_blocks == {}
    assert bm.block_key == [None] * 8
    assert a.num_registered_blocks == 0
    b = make_seq("b", PROMPT10)
    assert bm.match_prefix(b) == PrefixMatch([], 0)
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


def test_reset_forgets_every_cached_block_but_keeps_what_sequences_hold():
    bm = BlockManager(8, 4)
    a = make_seq("a", PROMPT10)
    admit(bm, a)
    done = make_seq("done", [9] * 10)
    admit(bm, done)
    bm.free(done)  # its two full blocks stay cached in the free queue
    assert len(bm.cached_blocks) == 4
    assert bm.reset_prefix_cache() == 4
    assert bm.cached_blocks == {} and bm.block_key == [None] * 8
    assert bm.match_prefix(make_seq("b", PROMPT10)) == PrefixMatch([], 0)
    assert a.block_table == [0, 1, 2] and bm.ref_counts[:3] == [1, 1, 1]
    # a's blocks are not published again, but a new computation of the prefix is.
    compute(bm, a, 0)
    assert bm.cached_blocks == {}
    c = make_seq("c", PROMPT10)
    admit(bm, c)
    assert bm.cached_blocks == {H0: c.block_table[0], H1: c.block_table[1]}
    assert bm.match_prefix(make_seq("d", PROMPT10)).num_tokens == 8
    assert bm.reset_prefix_cache() == 2 and bm.reset_prefix_cache() == 0
