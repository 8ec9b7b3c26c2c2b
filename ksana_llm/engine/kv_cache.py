"""Paged KV-cache bookkeeping: block ids, refcounts, the prefix-cache hash chain and the host pool.

This module moves no tensors. It decides which physical block holds which tokens; the model
runner owns the KV tensors and performs the copies (swap in/out) the scheduler hands it.

Prefix caching (the vLLM v1 recipe): a full block is keyed by hash(parent block's hash, its token
ids), so a key names the whole prefix up to that block. Blocks are refcounted; a block whose
refcount drops to zero goes to the free queue but keeps its key, and is reused for free if a later
request asks for the same prefix before it is evicted. Eviction takes the front of the free queue:
blocks that hold nothing reusable are put there first, cached blocks at the back (least recently
freed evicted first), and a finished sequence frees its tail first so its prefix survives longest.

Forked sequences (parallel samples, beams) share every block of their parent by refcount. Before a
sequence writes into a block someone else still holds (the parent's last, partial block), `allocate`
gives it a private copy: the (source, destination) pair is queued in `pending_copies` for the
runner, which copies the KV before the step's forward (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from ksana_llm.engine.request import Sequence


class PrefixMatch(NamedTuple):
    """Blocks that already hold a prefix of a sequence, and how many tokens they cover."""

    block_ids: list[int]
    num_tokens: int


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: depends on every token before it through the parent's key."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Allocates fixed-size KV blocks on the device and in a host swap pool."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_key: list[int | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # block key -> block id
        # Free blocks in eviction order (front first); O(1) removal when a cached block is reused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        # Copy-on-write copies decided by `allocate`, drained by the scheduler with take_copies().
        self.pending_copies: list[tuple[int, int]] = []
        # Blocks handed to a sequence to write into, drained with take_fresh_blocks(): they
        # still hold whatever their last owner left, which the runner clears (see there).
        self.fresh_blocks: list[int] = []
        # Counters for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.peak_used_blocks = 0  # most device blocks referenced at once

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of device blocks referenced by live sequences (cached-but-free counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (source, destination) block copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_fresh_blocks(self) -> list[int]:
        """The blocks newly given to sequences since the last call, to write their KV into
        (not adopted prefix-cache blocks, not copy-on-write destinations: those hold KV)."""
        fresh, self.fresh_blocks = self.fresh_blocks, []
        return fresh

    # ---- prefix cache --------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` to cover every full block of its known tokens."""
        bs = self.block_size
        full = seq.num_known_tokens // bs
        hashes = seq.block_hashes
        # KV computed with LongRoPE's long factors is another KV than the short factors' of the
        # same tokens: its own chain.
        root = hash((seq.cache_salt, "long_rope")) if seq.long_rope else seq.cache_salt
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, tuple(seq.tokens_slice(i * bs, (i + 1) * bs))))

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached blocks holding a prefix of `seq` (which must own no blocks yet).

        At least one token is always left uncached so the step computes logits for it.
        """
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return PrefixMatch([], 0)
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for key in seq.block_hashes[:max_blocks]:
            block = self.cached_blocks.get(key)
            if block is None:
                break
            blocks.append(block)
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup for the hit-rate metric."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly computed full blocks in the prefix cache. A block that
        holds a pending token (async scheduling) waits until the token is known."""
        computed = seq.num_computed_tokens
        if seq.num_pending_tokens:
            computed = min(computed, seq.num_known_tokens)
        num_full = min(computed // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks or not self.enable_prefix_caching \
                or not seq.fills_prefix_cache:
            return  # (most decode steps fill no block: nothing new to hash)
        self.update_block_hashes(seq)
        for i in range(seq.num_registered_blocks, num_full):
            block, key = seq.block_table[i], seq.block_hashes[i]
            if self.block_key[block] is None and key not in self.cached_blocks:
                self.block_key[block] = key
                self.cached_blocks[key] = block
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's key, so no later request reuses a computed prefix;
        returns how many blocks were cached. Sequences keep the blocks they hold (only the
        sharing ends), so this is safe while requests run."""
        num_cached = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            self.block_key[block] = None
        self.cached_blocks.clear()
        return num_cached

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Give `seq` blocks for its computed tokens plus `num_new_tokens` more.

        `prefix` (only for a sequence holding no blocks) adopts cached blocks first. A block the
        new tokens write into that is shared with another sequence (a fork's partial block) is
        replaced by a private copy (see `pending_copies`). Returns False and changes nothing when
        there are not enough free blocks.
        """
        if prefix is None and num_new_tokens == 1:
            # Decode steps, the common case: the token goes into the sequence's own last block.
            index = seq.num_computed_tokens // self.block_size
            if index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] == 1:
                return True
        prefix_blocks = prefix.block_ids if prefix else []
        computed = prefix.num_tokens if prefix else seq.num_computed_tokens
        total = self.blocks_needed(computed + num_new_tokens)
        num_new_blocks = max(0, total - len(seq.block_table) - len(prefix_blocks))
        # Only blocks from the first written one on can need a copy; earlier ones are full.
        shared = [i for i in range(computed // self.block_size, len(seq.block_table))
                  if self.ref_counts[seq.block_table[i]] > 1] if num_new_tokens else []
        # Cached blocks sitting in the free queue leave it when adopted.
        revived = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)
        if num_new_blocks + revived + len(shared) > self.num_free_blocks:
            return False
        for block in prefix_blocks:
            self._take(block)
        seq.block_table.extend(prefix_blocks)
        for i in shared:
            source, copy = seq.block_table[i], self._pop_free()
            seq.block_table[i] = copy
            self._release(source)  # still held by the other owner(s): refcount stays >= 1
            self.pending_copies.append((source, copy))
        for _ in range(num_new_blocks):
            block = self._pop_free()
            seq.block_table.append(block)
            self.fresh_blocks.append(block)
        if prefix_blocks:
            seq.num_registered_blocks = len(prefix_blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's device blocks, tail first: among cached blocks the tail is evicted
        first; blocks holding nothing reusable go to the front of the queue."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def retain(self, blocks: list[int]) -> None:
        """Hold held blocks once more (a finished sequence's, until its KV is copied out)."""
        for block in blocks:
            self._take(block)

    def release_blocks(self, blocks: list[int]) -> None:
        """Undo `retain`."""
        for block in reversed(blocks):
            self._release(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of `parent`'s blocks with `child` (refcounted, no copy). The child (holding no
        blocks) also takes the parent's prefix-cache chain, which names the same tokens."""
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    # ---- host swap pool ------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq` to host blocks; returns (device, host) copies to perform, or None if the
        host pool is too small (then nothing changed)."""
        if len(seq.block_table) > len(self.free_host_blocks):
            return None
        mapping = [(block, self.free_host_blocks.pop()) for block in seq.block_table]
        seq.host_block_table = [host for _, host in mapping]
        self.free(seq)
        return mapping

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped `seq` back with room for `num_new_tokens`; returns (host, device)
        copies, or None when the device lacks free blocks (then nothing changed)."""
        if not self.allocate(seq, num_new_tokens):
            return None
        mapping = list(zip(seq.host_block_table, seq.block_table))
        self.free_host(seq)
        return mapping

    def free_host(self, seq: Sequence) -> None:
        self.free_host_blocks.extend(reversed(seq.host_block_table))
        seq.host_block_table = []

    # ---- internals -----------------------------------------------------------------------
    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if self.block_key[block] is None:
                # Holds nothing reusable: hand it out before any cached block.
                self.free_queue.move_to_end(block, last=False)

    def _forget(self, block: int) -> None:
        key = self.block_key[block]
        if key is not None:
            self.block_key[block] = None
            if self.cached_blocks.get(key) == block:
                del self.cached_blocks[key]
