"""A scheduler driven without a model, for the scheduler tests: `step()` does what the engine
core does after the runner returns -- advance `num_computed_tokens` by each scheduled chunk,
publish full blocks in the prefix cache, and "sample" one token for every sequence whose
computed tokens caught up with its tokens.
"""

from __future__ import annotations

import itertools


from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.request import Sequence
from ksana_llm.engine.scheduler import Scheduler
from ksana_llm.engine.scheduler_records import SchedulerConfig, SchedulerOutput
from ksana_llm.generation_config import GenerationConfig

_arrivals = itertools.count(1)
_prompt_bases = itertools.count(1)
_sampled = itertools.count(10_000_000)  # sampled token ids never collide with prompt tokens


def sampled_token() -> int:
    """A token id no prompt holds, as if sampled."""
    return next(_sampled)


def make_seq(request_id: str, tokens, *, priority: int = 0, arrival_time: float | None = None):
    if isinstance(tokens, int):  # n tokens no other request shares (no accidental prefix hits)
        base = 1000 * next(_prompt_bases)
        tokens = range(base, base + tokens)
    return Sequence(request_id, list(tokens), GenerationConfig(), priority=priority,
                    arrival_time=float(next(_arrivals)) if arrival_time is None else arrival_time)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, *, num_host_blocks: int = 0,
                   enable_prefix_caching: bool = True, **config) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                      num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**config), bm)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_step_tokens
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(item.seq)
    for item in out.scheduled:
        seq = item.seq
        assert seq.num_computed_tokens <= seq.num_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(sampled_token())
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]
