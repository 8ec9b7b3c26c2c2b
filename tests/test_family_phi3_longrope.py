"""Phi-3 LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini: `rope_scaling` type "longrope") against
transformers (fp32).

transformers switches a sequence to the long factors once it is longer than the original context
(`original_max_position_embeddings`), and its Phi-3 recomputes the whole cache at the step a
sequence grows past it, so every step's logits are those of a plain forward over the whole
sequence: the reference here (`hf_reference`), checked against transformers' own cached
`generate` once. Tiny random models saved by transformers, one rotating whole heads and one
Phi-4-mini-like (partial_rotary_factor 0.75); short factors near 1, long ones far from it, so
taking the wrong set changes every logit.

Covered through the real Engine: prompts longer than the original context (prefilled in chunks,
rows before the switch included), prompts that grow past it while decoding (recomputed once), both
kinds in one batch, async scheduling, preemption, the prefix cache (short- and long-factor KV of
the same tokens never shared), KV transferred between engines (tagged with its factor set) and
n-gram drafts (stopped at the switch).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.request import Sequence
from ksana_llm.engine.scheduler import Scheduler
from ksana_llm.engine.scheduler_records import SchedulerConfig
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.models.phi3 import Phi3ForCausalLM as OurPhi3
from ksana_llm.runner.kv_transfer import TransferredKv
from ksana_llm.runner.slices import SeqSlice
from tests.family_harness import (check_family, greedy_trace, hf_reference, load_ours, memoized,
                                  one_thread)
from tests.test_cuda_graphs import GraphDriver

VOCAB = 256
SWITCH = 24  # original_max_position_embeddings of the engine tests' models


def longrope_config(original: int, partial: float = 1.0) -> Phi3Config:
    half = int(16 * partial) // 2  # head_dim 16
    return Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        original_max_position_embeddings=original, partial_rotary_factor=partial,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
                      "long_factor": [3.0 + 2.0 * i for i in range(half)]},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (transformers model, folder, memoized reference)."""
    out = {}
    for name, original, partial in (("whole", SWITCH, 1.0), ("partial", SWITCH, 0.75),
                                    ("family", 64, 1.0)):
        torch.manual_seed(0)
        hf = Phi3ForCausalLM(longrope_config(original, partial)).eval()
        folder = tmp_path_factory.mktemp(f"phi3_longrope_{name}")
        hf.save_pretrained(folder)
        out[name] = (hf, folder, memoized(hf_reference(hf)))
    return out


def test_tables_match_transformers_short_and_long():
    config = longrope_config(SWITCH, 0.75)
    hf_rope = Phi3RotaryEmbedding(config)
    ours = build_rotary(12, 256, 10000.0, {**config.rope_parameters})
    x = torch.zeros(1, 1, 16)
    for length in (SWITCH, SWITCH + 1, 100):
        positions = torch.arange(length)
        cos, sin = hf_rope(x, positions[None])  # [1, T, rotary_dim]
        # transformers picks by the forward's length; here a row is marked long instead.
        long_rows = torch.full((length,), length > SWITCH)
        our_cos, our_sin = ours.cos_sin(positions, torch.float32, long_rows)
        torch.testing.assert_close(our_cos[:, 0], cos[0, :, :6], atol=1e-6, rtol=0)
        torch.testing.assert_close(our_sin[:, 0], sin[0, :, :6], atol=1e-6, rtol=0)
    assert ours.switch_length == SWITCH


def test_family_checks_cross_the_switch_while_decoding(saved):
    """The shared family checks (paged prefill and decode, prefix hits, engine greedy): their
    engine prompts (40 and 43 tokens, 32 new) grow past the original 64."""
    _, folder, reference = saved["family"]
    ours = load_ours(folder)
    assert isinstance(ours, OurPhi3) and ours.long_rope_switch == 64
    check_family(ours, folder, reference, vocab=VOCAB)


def test_reference_is_transformers_generate(saved):
    hf, _, reference = saved["whole"]
    torch.manual_seed(1)
    prompt = torch.randint(3, VOCAB, (14,)).tolist()
    with one_thread(), torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0].tolist()
    assert generated == greedy_trace(reference, prompt, 20)[0]


def _engine(folder, **overrides) -> kt.Engine:
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    settings = dict(block_token_num=4, num_device_blocks=128, split_fuse_token_num=8,
                    logprobs_mode="raw_logits")
    return kt.Engine(model, **{**settings, **overrides})


def _check_outputs(outputs, prompts, reference, num_tokens: int) -> None:
    """Greedy tokens and every step's raw logit of the chosen token equal the reference's: the
    last row of a forward over the sequence as long as it was at that step (the rows before a
    sequence grows past the switch are short-factor rows, not those of the final sequence)."""
    for out, prompt in zip(outputs, prompts):
        ids, _ = greedy_trace(reference, prompt, num_tokens)
        assert out.token_ids == ids[len(prompt):], f"prompt of {len(prompt)}: tokens differ"
        assert len(out.logprobs) == num_tokens
        for k, entry in enumerate(out.logprobs):
            row = reference(ids[:len(prompt) + k])[-1]
            assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=2e-4)


def _prompts(lengths: list[int], seed: int = 2) -> list[list[int]]:
    torch.manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,)).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["whole", "partial"])
def test_long_and_short_prompts_in_one_batch(saved, name):
    """Prompts shorter than, equal to and longer than the original 24 tokens, batched, prefilled
    in chunks of 8; the two short ones grow past it and are recomputed once each."""
    _, folder, reference = saved[name]
    prompts = _prompts([10, 24, 25, 40])
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True, logprobs=1)
    with _engine(folder) as engine:
        outputs = engine.generate_outputs(prompts, config, use_tqdm=False)
        recomputed = engine._core.scheduler.num_long_rope_recomputes
    _check_outputs(outputs, prompts, reference, 20)
    assert recomputed == 2


def test_async_scheduling_recomputes_once_its_token_is_known(saved):
    _, folder, reference = saved["whole"]
    prompts = _prompts([12, 30], seed=3)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True, logprobs=1)
    with _engine(folder, async_scheduling=True) as engine:
        outputs = engine.generate_outputs(prompts, config, use_tqdm=False)
        assert engine._core.scheduler.num_long_rope_recomputes == 1
    _check_outputs(outputs, prompts, reference, 20)


@pytest.mark.parametrize("preempt_mode", [0, 1])
def test_preemption_while_growing_past_the_switch(saved, preempt_mode):
    """Too few blocks for six prompts that all grow past 24: sequences are preempted (swapped
    out, or freed) around their crossing; one preempted just as it crossed is recomputed, not
    swapped back in on its short-factor KV."""
    _, folder, reference = saved["whole"]
    prompts = _prompts(list(range(17, 23)), seed=0)
    config = GenerationConfig(max_new_tokens=14, ignore_eos=True, logprobs=1)
    with _engine(folder, num_device_blocks=12, preempt_mode=preempt_mode,
                 enable_prefix_caching=False) as engine:
        outputs = engine.generate_outputs(prompts, config, use_tqdm=False)
        assert engine.stats().num_preemptions > 0
    _check_outputs(outputs, prompts, reference, 14)


def test_prefix_cache_keeps_short_and_long_kv_apart(saved):
    """A long prompt that extends a cached short one recomputes the shared tokens with the long
    factors; a short one reuses them."""
    _, folder, reference = saved["whole"]
    (base,) = _prompts([16], seed=4)
    longer, shorter = base + _prompts([12], seed=5)[0], base + [7, 8]
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True, logprobs=1)
    with _engine(folder) as engine:
        outputs = [engine.generate_outputs([p], config, use_tqdm=False)[0]
                   for p in (base, longer)]
        assert engine.stats().prefix_cache_hit_rate == 0  # the long prompt found nothing
        outputs.append(engine.generate_outputs([shorter], config, use_tqdm=False)[0])
        assert engine.stats().prefix_cache_hit_rate > 0
    _check_outputs(outputs, [base, longer, shorter], reference, 4)


def test_transferred_kv_carries_its_factor_set(saved):
    """Prefill/decode disaggregation: KV exported by a sequence that grew past the switch (so
    recomputed with the long factors) is not taken by a decode whose prompt is short, which
    computes its prompt itself; a long prompt's KV is taken (and survives the wire)."""
    _, folder, reference = saved["whole"]
    short, long = _prompts([20, 30], seed=8)
    greedy = GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=1)
    with _engine(folder) as prefill:
        grown = prefill.submit(kt.Request(short, generation_config=greedy,
                                          export_kv=True)).result().exported_kv
        long_kv = prefill.submit(kt.Request(long, generation_config=greedy.replace(
            max_new_tokens=1), export_kv=True)).result().exported_kv
    assert grown.long_rope and long_kv.long_rope
    with _engine(folder, enable_prefix_caching=False) as decode:
        outputs = [decode.submit(kt.Request(short, generation_config=greedy,
                                            imported_kv=grown)).result()]
        assert decode.stats().num_imported_kv_tokens == 0
        outputs.append(decode.submit(kt.Request(
            long, generation_config=greedy,
            imported_kv=TransferredKv.from_bytes(long_kv.to_bytes()))).result())
        assert decode.stats().num_imported_kv_tokens == len(long) - 1
    _check_outputs(outputs, [short, long], reference, 8)


def test_ngram_drafts_match_greedy(saved):
    _, folder, reference = saved["whole"]
    cycle = _prompts([5], seed=6)[0]
    prompts = [cycle * 4, (cycle * 6)[:26]]  # 20 tokens (grows past 24), 26 (long)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, logprobs=1)
    with _engine(folder, num_speculative_tokens=3, speculative_method="ngram",
                 prompt_lookup_min=2, prompt_lookup_max=3) as engine:
        outputs = engine.generate_outputs(prompts, config, use_tqdm=False)
    _check_outputs(outputs, prompts, reference, 16)


def test_drafts_of_a_short_sequence_stop_at_the_switch():
    manager = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(long_rope_switch=SWITCH), manager)
    seq = Sequence("s", list(range(3, 3 + SWITCH - 2)), GenerationConfig(max_new_tokens=8))
    scheduler.add(seq)
    first = scheduler.schedule().scheduled[0]
    seq.num_computed_tokens += first.num_new_tokens
    seq.output_token_ids.append(5)  # 23 tokens: one draft row fits below 24
    seq.draft_token_ids = [6, 7, 8]
    item = scheduler.schedule().scheduled[0]
    assert (item.num_new_tokens, item.num_draft_tokens) == (2, 1)
    assert not seq.long_rope


def test_wrong_number_of_factors_is_refused_by_name(saved, tmp_path):
    """In a checkpoint (transformers' own check, as a ValueError) and in a table built from a
    config transformers does not check."""
    _, folder, _ = saved["whole"]
    changed = shutil.copytree(folder, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    scaling = config.get("rope_parameters") or config["rope_scaling"]
    scaling["short_factor"] = scaling["short_factor"][:-1]
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="short_factor"):
        load_ours(changed)
    with pytest.raises(ValueError, match="long_factor must list 8 factors"):
        build_rotary(16, 256, 10000.0, {**scaling, "short_factor": [1.0] * 8, "long_factor": [],
                                        "original_max_position_embeddings": SWITCH})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        build_rotary(16, 256, 10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                        "long_factor": [1.0] * 8})


class LongRopeGraphDriver(GraphDriver):
    """tests/test_cuda_graphs' driver, its slices marked as the engine marks them."""

    def _slices(self, work):
        return [replace(s, long_rope=seq.long_rope)
                for s, (seq, _, _) in zip(super()._slices(work), work)]


def test_graph_decode_of_long_and_short_sequences_equals_eager(saved):
    """Graph rows carry no marks: a decode row's position picks its factors. (On CPU the graph
    path runs uncaptured: tests/test_cuda_graphs.)"""
    _, folder, _ = saved["whole"]
    driver = LongRopeGraphDriver(load_ours(folder), torch.device("cpu"), max_graph_batch=4)
    seqs = [Sequence(f"s{i}", p, GenerationConfig())
            for i, p in enumerate(_prompts([8, 12, 30, 40], seed=7))]
    for seq in seqs:
        seq.long_rope = seq.num_tokens > SWITCH
    for seq, row in zip(seqs, driver.prefill(seqs)):
        seq.output_token_ids.append(int(row.argmax()))
    for _ in range(3):
        runs = driver.graphs.steps_run
        graph, eager, _, _ = driver.decode([(s, 1, True) for s in seqs])
        assert driver.graphs.steps_run == runs + 1
        torch.testing.assert_close(graph, eager, atol=2e-5, rtol=1e-5)
        for seq, row in zip(seqs, eager):
            seq.output_token_ids.append(int(row.argmax()))
    # A one-token prompt chunk of a long sequence (below the switch, nothing sampled) needs its
    # mark: no graph for it.
    chunk = SeqSlice([5], 3, seqs[3].block_table, sample=False, long_rope=True)
    assert not driver.runner._graph_eligible([chunk])
    assert driver.runner._graph_eligible([replace(chunk, sample=True)])
