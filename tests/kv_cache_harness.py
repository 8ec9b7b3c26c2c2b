"""BlockManager driven without a model, for the KV-cache tests: a "computed" token is
simulated the way the engine core does it (`seq.num_computed_tokens += n;
block_manager.cache_full_blocks(seq)`).
"""

from __future__ import annotations

from ksana_llm.engine.kv_cache import BlockManager, PrefixMatch, hash_block
from ksana_llm.engine.request import Sequence
from ksana_llm.generation_config import GenerationConfig


def make_seq(request_id: str, tokens, **kwargs) -> Sequence:
    return Sequence(request_id, list(tokens), GenerationConfig(), **kwargs)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What the engine core does after a step that computed `num_tokens` tokens of `seq`."""
    if num_tokens is None:
        num_tokens = seq.num_tokens - seq.num_computed_tokens
    seq.num_computed_tokens += num_tokens
    assert seq.num_computed_tokens <= seq.num_tokens
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> PrefixMatch:
    """Admit a new sequence the way the scheduler does: prefix match, allocate, compute all."""
    prefix = bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
    seq.num_computed_tokens = prefix.num_tokens
    compute(bm, seq)
    return prefix


def free_queue(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


# A 10-token prompt: with block_size 4 it fills blocks 0 and 1 and 2 tokens of a third block.
PROMPT10 = list(range(1, 11))
H0 = hash_block(None, (1, 2, 3, 4))
H1 = hash_block(H0, (5, 6, 7, 8))
