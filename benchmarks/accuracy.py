"""What the accuracy benchmarks share: a fixed English text and its perplexity through our engine
(the `/forward` path: one prefill, every position's log-prob) and through transformers on the
same weights; random-id prompts; a device sync for wall-clock timing."""

from __future__ import annotations

import math

import numpy as np
import torch

import ksana_llm as kt

TEXT = (
    "The river rises in the hills to the north and flows south through farmland for nearly two "
    "hundred miles before it reaches the sea. For centuries it carried grain, timber and wool to "
    "the coast, and the towns along its banks grew rich on the trade. When the railway arrived, "
    "the barges slowly disappeared, and many of the old warehouses were turned into homes, "
    "shops and small museums. Today the river is known mostly for its quiet towpaths, its "
    "birds, and the long summer evenings when families walk beside the water and children feed "
    "the ducks. Local historians still argue about where the first bridge stood, but everyone "
    "agrees that without the river the region would look very different."
)


def random_prompts(tokenizer, vocab: int, num: int, min_len: int, max_len: int, seed: int
                   ) -> list[list[int]]:
    """`num` prompts of random non-special ids, lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([t for t in range(vocab) if t not in special])
    lengths = rng.integers(min_len, max_len + 1, num)
    return [rng.choice(allowed, int(n)).tolist() for n in lengths]


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def perplexity_ours(engine: kt.Engine, ids: list[int]) -> float:
    out = engine.forward(ids, [kt.ForwardTarget("logits", [[0, len(ids) - 2]],
                                                token_logprobs=True)])
    logprobs = out.targets[0].token_logprobs  # log p(ids[i + 1] | ids[:i + 1])
    return math.exp(-float(logprobs.mean()))


def perplexity_hf(model: kt.Model, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).to(model.device).eval()
    try:
        return perplexity_of(hf, ids, model.device)
    finally:
        del hf


def perplexity_of(hf: torch.nn.Module, ids: list[int], device: torch.device) -> float:
    """A transformers model's perplexity on `ids` (one forward over the whole text)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device=device)).logits[0, :-1].float()
    logprobs = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
    return math.exp(-float(logprobs.mean()))
