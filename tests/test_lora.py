"""LoRA adapters: the engine against PEFT applying the same adapter files to transformers' model.

The adapters are PEFT's own (`get_peft_model(...).save_pretrained`, see tests.lora_adapters),
with random non-zero B matrices, so every adapted projection changes the output. Each reference is the PEFT model's full-sequence logits, and its
greedy tokens from them.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import hf_reference
from tests.lora_adapters import make_adapter
from tests.lora_harness import (NUM_TOKENS, PROMPTS, expected_tokens, lora_setup, make_engine,
                                submit_all)

tiny = lora_setup  # the module's adapters, built once


@pytest.mark.parametrize("step_loop", ["sync", "async"])
def test_mixed_batch_matches_peft(tiny, step_loop):
    """Base and three adapters in the same steps: every request gets its own model's tokens,
    and the logits of a forward pass equal PEFT's; also with the GPU's step loop (async
    scheduling: a step launched before the previous one's tokens are read back; outputs
    processed during the next step)."""
    folder, base, adapters = tiny
    modules = {name: str(folder / name) for name in adapters}
    jobs = [(prompt, lora) for lora in (None, *adapters) for prompt in PROMPTS]
    references = {None: base, **adapters}
    loop = dict(async_scheduling=True, overlap_output_processing=True) \
        if step_loop == "async" else {}
    with make_engine(folder / "base", lora_modules=modules, **loop) as engine:
        assert engine.lora_adapters == modules
        got = submit_all(engine, jobs)
        logits = {lora: engine.forward(PROMPTS[0], [{"target_name": "logits"}], lora=lora)
                  .targets[0].tensor for lora in references}
        # The same mix as one batch call, an adapter per prompt (vLLM's lora_request list).
        listed = engine.generate_outputs([p for p, _ in jobs], use_tqdm=False,
                                         lora=[lora for _, lora in jobs])
        texts = engine.generate([p for p, _ in jobs], use_tqdm=False,
                                lora=[lora for _, lora in jobs])
        with pytest.raises(ValueError, match="lora: give one adapter name, or one per prompt"):
            engine.generate_outputs(PROMPTS, use_tqdm=False, lora=[None])
        with pytest.raises(ValueError, match="lora: stream=True takes one adapter name"):
            engine.generate(PROMPTS[0], stream=True, lora=[None])
    expected = [expected_tokens(references[lora], prompt) for prompt, lora in jobs]
    assert got == expected
    assert [o.token_ids for o in listed] == expected
    assert texts == [o.text for o in listed]
    for lora, model in references.items():
        torch.testing.assert_close(logits[lora], hf_reference(model)(PROMPTS[0]),
                                   atol=1e-4, rtol=1e-4)
    # The adapters really change the model: each differs from the base somewhere.
    by_lora = {lora: [tokens for (_, l), tokens in zip(jobs, got) if l == lora]
               for lora in references}
    assert all(by_lora[name] != by_lora[None] for name in adapters)


def test_prefix_cache_never_crosses_adapters(tiny):
    """The same prompt under the base model, then an adapter, then the adapter again: the second
    request must not reuse the base's KV (its tokens equal PEFT's), the third reuses the
    second's."""
    folder, base, adapters = tiny
    prompt = PROMPTS[2]
    with make_engine(folder / "base", lora_modules={"all": str(folder / "all")}) as engine:
        first = engine.generate_outputs([prompt], use_tqdm=False)[0]
        second = engine.generate_outputs([prompt], use_tqdm=False, lora="all")[0]
        hit_rate_before = engine.stats().prefix_cache_hit_rate
        third = engine.generate_outputs([prompt], use_tqdm=False, lora="all")[0]
        hit_rate_after = engine.stats().prefix_cache_hit_rate
    assert first.token_ids == expected_tokens(base, prompt)
    assert second.token_ids == third.token_ids == expected_tokens(adapters["all"], prompt)
    assert hit_rate_before == 0
    assert hit_rate_after == pytest.approx(20 / (3 * len(prompt)))  # 5 of its 4-token blocks


def test_beam_search_and_samples_keep_the_adapter(tiny):
    """Forked sequences (beams, n samples) run with their request's adapter: beam search equals
    PEFT's, and seeded samples equal those of a request alone."""
    folder, _, adapters = tiny
    peft_model = adapters["qv-rslora"]
    prompt = PROMPTS[1]
    beams = GenerationConfig(max_new_tokens=6, num_beams=3, num_return_sequences=3,
                             ignore_eos=True, length_penalty=1.0)
    with torch.no_grad():
        reference = peft_model.generate(torch.tensor([prompt]), max_new_tokens=6, num_beams=3,
                                        num_return_sequences=3, do_sample=False,
                                        length_penalty=1.0, eos_token_id=None, pad_token_id=0)
    with make_engine(folder / "base", lora_modules={"qv": str(folder / "qv-rslora")}) as engine:
        out = engine.submit(kt.Request(prompt, beams, lora="qv")).result()
        base_out = engine.submit(kt.Request(prompt, beams)).result()
    assert [s.token_ids for s in out.sequences] == [r[len(prompt):].tolist() for r in reference]
    assert [s.token_ids for s in out.sequences] != [s.token_ids for s in base_out.sequences]


@pytest.mark.parametrize("case", ["one-slot", "two-slots-async", "preempt-swap",
                                  "preempt-recompute"])
def test_more_adapters_than_slots_take_turns_and_match_peft(tiny, case):
    """Three adapters and base requests, all submitted at once, on fewer slots than adapters:
    an adapter waits for a slot its requests' predecessors free, and every request still gets
    PEFT's tokens, also with the GPU's step loop and when sequences are preempted (swapped out
    with their adapter's slot kept, or freed and readmitted into whichever slot is free). A
    second wave needs an adapter that was moved out of its slot back in."""
    folder, base, adapters = tiny
    settings = {"one-slot": dict(max_loras=1),
                "two-slots-async": dict(max_loras=2, async_scheduling=True,
                                        overlap_output_processing=True),
                "preempt-swap": dict(max_loras=2, num_device_blocks=24, preempt_mode=0),
                "preempt-recompute": dict(max_loras=2, num_device_blocks=24, preempt_mode=1),
                }[case]
    modules = {name: str(folder / name) for name in adapters}
    jobs = [(prompt, lora) for prompt in PROMPTS for lora in (*adapters, None)]
    references = {None: base, **adapters}
    with make_engine(folder / "base", lora_modules=modules, **settings) as engine:
        got = [submit_all(engine, jobs) for _ in range(2)]
        stats = engine.stats()
    expected = [expected_tokens(references[lora], prompt) for prompt, lora in jobs]
    assert got == [expected, expected]
    assert stats.max_loras == settings["max_loras"]
    assert stats.num_lora_slot_loads > len(adapters)  # an adapter came back for the second wave
    assert (stats.num_preemptions > 0) == case.startswith("preempt")


def test_host_copies_capped_by_max_cpu_loras(tiny):
    """max_cpu_loras=1 with three adapters on one slot: at most one host copy is kept, an
    adapter whose copy was dropped is read again from its folder when it next takes the slot,
    and every request still gets PEFT's tokens."""
    folder, base, adapters = tiny
    modules = {name: str(folder / name) for name in adapters}
    jobs = [(prompt, lora) for prompt in PROMPTS[:2] for lora in (*adapters, None)]
    references = {None: base, **adapters}
    with make_engine(folder / "base", lora_modules=modules, max_loras=1,
                     max_cpu_loras=1) as engine:
        got = submit_all(engine, jobs)
        slots = engine._core.runner.lora
        assert len(slots.registered) == 1 and len(slots.paths) == len(adapters)
        assert slots.num_host_reloads >= len(adapters) - 1
    assert got == [expected_tokens(references[lora], prompt) for prompt, lora in jobs]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        kt.EngineConfig(max_cpu_loras=0)


def test_load_and_unload_while_serving(tiny):
    """Adapters loaded and unloaded at run time, more of them than the engine's one slot; a
    name reloaded with another adapter serves the new one (no stale prefix-cache blocks)."""
    folder, base, adapters = tiny
    prompt = PROMPTS[0]
    with make_engine(folder / "base", max_loras=1) as engine:
        assert engine.lora_adapters == {}
        with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
            engine.submit(kt.Request(prompt, lora="x"))
        engine.load_lora_adapter("x", str(folder / "all"))
        assert engine.generate_outputs([prompt], use_tqdm=False, lora="x")[0].token_ids \
            == expected_tokens(adapters["all"], prompt)
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_lora_adapter("x", str(folder / "patterns"))
        engine.load_lora_adapter("y", str(folder / "qv-rslora"))  # a second adapter, one slot
        assert engine.lora_adapters == {"x": str(folder / "all"), "y": str(folder / "qv-rslora")}
        assert engine.generate_outputs([prompt], use_tqdm=False, lora="y")[0].token_ids \
            == expected_tokens(adapters["qv-rslora"], prompt)
        engine.unload_lora_adapter("y")
        # In use: a long request holds "x". Unloading unlists it (new requests are refused, the
        # name is free) and the request finishes with it, as in vLLM; then its weights go.
        long_request = engine.submit(kt.Request(prompt, {"max_new_tokens": 300}, lora="x"))
        engine.unload_lora_adapter("x")
        unlisted = engine._lora.unlisted_ids()
        assert len(unlisted) == 1 and engine.lora_adapters == {}
        with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
            engine.submit(kt.Request(prompt, lora="x"))
        with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
            engine.unload_lora_adapter("x")
        engine.load_lora_adapter("x", str(folder / "patterns"))  # while the old one drains
        hit_rate = engine.stats().prefix_cache_hit_rate
        again = engine.generate_outputs([prompt], use_tqdm=False, lora="x")[0]
        assert engine.stats().prefix_cache_hit_rate < hit_rate  # nothing reused
        held = long_request.result()
        base_out = engine.generate_outputs([prompt], use_tqdm=False)[0]  # a step after it ended
        assert engine._lora.unlisted_ids() == []
        assert unlisted[0] not in engine._core.runner.lora.paths  # freed
        assert list(engine._core.runner.lora.paths) == [engine._lora.resolve("x").lora_id]
    assert held.token_ids[:NUM_TOKENS] == expected_tokens(adapters["all"], prompt)
    assert again.token_ids == expected_tokens(adapters["patterns"], prompt)
    assert base_out.token_ids == expected_tokens(base, prompt)


def test_load_inplace_replaces_an_adapter_and_a_failed_one_keeps_it(tiny, tmp_path):
    """vLLM's load_inplace: the name serves the new adapter from the next request on; a request
    holding the old one finishes with it, whose weights go when it ends; a replacement that
    cannot load leaves the old one serving. On a name not loaded it is a plain load."""
    folder, _, adapters = tiny
    prompt = PROMPTS[0]
    with make_engine(folder / "base", max_loras=1) as engine:
        engine.load_lora_adapter("x", str(folder / "all"), load_inplace=True)
        long_request = engine.submit(kt.Request(prompt, {"max_new_tokens": 300}, lora="x"))
        old_id = engine._lora.resolve("x").lora_id
        engine.load_lora_adapter("x", str(folder / "patterns"), load_inplace=True)
        assert engine.lora_adapters == {"x": str(folder / "patterns")}
        assert engine._lora.unlisted_ids() == [old_id]
        with pytest.raises(ValueError, match="not a folder"):
            engine.load_lora_adapter("x", str(tmp_path / "missing"), load_inplace=True)
        with pytest.raises(ValueError, match="load_inplace must be a bool"):
            engine.load_lora_adapter("x", str(folder / "all"), load_inplace="yes")
        assert engine.lora_adapters == {"x": str(folder / "patterns")}
        new = engine.generate_outputs([prompt], use_tqdm=False, lora="x")[0]
        held = long_request.result()
        engine.generate_outputs([prompt], use_tqdm=False)  # a step after it ended
        assert engine._lora.unlisted_ids() == [] and old_id not in engine._core.runner.lora.paths
    assert held.token_ids[:NUM_TOKENS] == expected_tokens(adapters["all"], prompt)
    assert new.token_ids == expected_tokens(adapters["patterns"], prompt)


def test_an_unloaded_adapter_drains_when_its_last_request_is_aborted(tiny):
    """The adapter's weights are freed when the requests holding it end by abort too (no step
    follows an abort in an idle engine); a request resolved to it before the unload but
    picked up after the free is refused, not run on a missing adapter."""
    folder, _, _ = tiny
    prompt = PROMPTS[0]
    with make_engine(folder / "base", max_loras=1) as engine:
        engine.load_lora_adapter("x", str(folder / "all"))
        long_request = engine.submit(kt.Request(prompt, {"max_new_tokens": 300}, lora="x"))
        engine.unload_lora_adapter("x")
        (lora_id,) = engine._lora.unlisted_ids()
        engine.abort(long_request.id)
        assert long_request.result().finish_reason == "abort"
        deadline = time.monotonic() + 10
        while engine._lora.unlisted_ids() and time.monotonic() < deadline:
            time.sleep(0.01)  # the abort is taken on the engine thread, a moment later
        assert engine._lora.unlisted_ids() == [] and lora_id not in engine._core.runner.lora.paths
        assert not engine._lora_still_loaded(SimpleNamespace(lora_id=lora_id))


def test_tensor_parallel_adapters_match_peft(tiny):
    """Two gloo ranks: column-parallel projections split B's rows, row-parallel ones A's
    columns; tokens and logits equal PEFT's, for an adapter loaded at start-up and one loaded
    while serving, which take turns in the one slot on both ranks."""
    folder, base, adapters = tiny
    model = Model.from_pretrained(folder / "base", device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=2)
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=128,
                   lora_modules={"all": str(folder / "all")}, max_loras=1) as engine:
        engine.load_lora_adapter("patterns", str(folder / "patterns"))
        jobs = [(PROMPTS[0], None), (PROMPTS[0], "all"), (PROMPTS[2], "patterns")]
        got = submit_all(engine, jobs)
        logits = engine.forward(PROMPTS[1], [{"target_name": "logits"}], lora="all")
    references = {None: base, **adapters}
    assert got == [expected_tokens(references[lora], prompt) for prompt, lora in jobs]
    torch.testing.assert_close(logits.targets[0].tensor, hf_reference(adapters["all"])(PROMPTS[1]),
                               atol=2e-4, rtol=1e-4)


def test_moe_attention_adapter_matches_peft_and_unadaptable_modules_are_refused(tmp_path):
    """On Mixtral (MoE MLP) an attention adapter applies and equals PEFT; DeepSeek's MLA
    attention takes no adapter, which is an error naming the module, not a silent no-op."""
    from tests.parallel_models import build

    moe = build("mixtral", tmp_path / "mixtral")
    reference = make_adapter(moe, tmp_path / "mixtral-qv", seed=4, targets=["q_proj", "v_proj"],
                             rank=4, b_std=0.3)
    with make_engine(tmp_path / "mixtral",
                     lora_modules={"qv": str(tmp_path / "mixtral-qv")}) as engine:
        got = engine.generate_outputs(PROMPTS[:2], use_tqdm=False, lora="qv")
    assert [o.token_ids for o in got] == [expected_tokens(reference, p) for p in PROMPTS[:2]]
    assert [o.token_ids for o in got] != [expected_tokens(moe, p) for p in PROMPTS[:2]]

    deepseek = build("deepseek", tmp_path / "deepseek")
    make_adapter(deepseek, tmp_path / "mla", seed=5, targets=["kv_a_proj_with_mqa"], rank=4)
    with pytest.raises(ValueError, match="kv_a_proj_with_mqa' cannot be adapted"):
        make_engine(tmp_path / "deepseek", lora_modules={"mla": str(tmp_path / "mla")})


@pytest.mark.parametrize("family, targets", [
    ("glm4", ["q_proj", "k_proj", "v_proj"]),  # q/k rows reordered on load: B's rows follow
    ("phi3", ["qkv_proj", "gate_up_proj"]),  # the checkpoint's own fused projections
    ("gemma2", ["q_proj", "o_proj", "down_proj"]),  # sandwich-norm layers, capped logits
    ("command-r-plus", ["q_proj", "k_proj", "up_proj"]),  # interleaved RoPE rows reordered
    ("olmo2", ["q_proj", "k_proj"]),  # normalised as whole projections after the adapter
])
def test_adapters_on_newer_families_match_peft(tmp_path, family, targets):
    from tests.parallel_models import build

    base = build(family, tmp_path / family)
    reference = make_adapter(base, tmp_path / "adapter", seed=6, targets=targets, rank=4,
                             b_std=0.3)
    with make_engine(tmp_path / family,
                     lora_modules={"a": str(tmp_path / "adapter")}) as engine:
        got = engine.generate_outputs(PROMPTS[:2], use_tqdm=False, lora="a")
        logits = engine.forward(PROMPTS[0], [{"target_name": "logits"}], lora="a")
    assert [o.token_ids for o in got] == [expected_tokens(reference, p) for p in PROMPTS[:2]]
    assert [o.token_ids for o in got] != [expected_tokens(base, p) for p in PROMPTS[:2]]
    torch.testing.assert_close(logits.targets[0].tensor, hf_reference(reference)(PROMPTS[0]),
                               atol=1e-4, rtol=1e-4)


def test_lora_memory_is_set_aside_from_the_kv_cache(tiny):
    """The KV planner leaves room for the slots: the estimate equals what the stacks take once
    every projection has them, plus the largest step's low-rank products."""
    from ksana_llm.runner.lora_slots import LoraSlots, lora_device_bytes
    from ksana_llm.runner.memory import blocks_leaving_room

    folder, _, _ = tiny
    module = Model.from_pretrained(folder / "base", device="cpu", dtype="float32",
                                   progress=False).module
    slots = LoraSlots(module, num_slots=2, max_rank=4, device=torch.device("cpu"),
                      dtype=torch.float32)
    stacks = sum(w.a.numel() + w.b_t.numel() for w in slots.allocate_all().values()) * 4
    widest = 2 * 3 * 4  # slots x parts (q, k, v) x rank
    assert lora_device_bytes(module, num_slots=2, max_rank=4, dtype=torch.float32,
                             max_step_tokens=100) == stacks + 2 * 100 * widest * 4
    assert lora_device_bytes(module, num_slots=0, max_rank=4, dtype=torch.float32,
                             max_step_tokens=100) == 0
    assert blocks_leaving_room(100, 1000, 2500) == 97
    with pytest.raises(ValueError, match="max_loras"):
        blocks_leaving_room(10, 1000, 9000)


def test_adapter_slots_sleep_with_the_weights(tiny):
    """Sleep mode frees the adapter slots' device stacks with the weights (level 2 here: on a
    CPU level 1 keeps the weights where they are); waking copies the resident adapters in
    again from their host copies, so once the base weights are loaded again every adapter
    answers as PEFT."""
    folder, base, adapters = tiny
    modules = {name: str(folder / name) for name in ("all", "qv-rslora")}
    jobs = [(PROMPTS[0], name) for name in modules]
    expected = [expected_tokens(adapters[name], PROMPTS[0]) for name in modules]
    with make_engine(folder / "base", lora_modules=modules, enable_sleep_mode=True) as engine:
        assert submit_all(engine, jobs) == expected
        lora = engine._core.runner.lora
        stacks = [t for w in lora.weights.values() for t in (w.a, w.b_t)]
        assert stacks and set(lora.resident.values()) == {1, 2}
        engine.sleep(level=2)
        assert all(t.untyped_storage().nbytes() == 0 for t in stacks)
        engine.wake_up()
        engine.update_weights(str(folder / "base"))
        assert submit_all(engine, jobs) == expected


@pytest.mark.parametrize("level", [1, 2])
def test_unloading_while_asleep_frees_the_adapter_after_waking(tiny, level):
    """While asleep the slots' memory is given back: an unload then only unlists the adapter
    (clearing its slot would write into nothing, and failed the engine); it is freed after
    waking, and the engine serves on."""
    folder, base, adapters = tiny
    prompt = PROMPTS[0]
    with make_engine(folder / "base", max_loras=1, enable_sleep_mode=True) as engine:
        engine.load_lora_adapter("x", str(folder / "all"))
        assert engine.generate_outputs([prompt], use_tqdm=False, lora="x")[0].token_ids \
            == expected_tokens(adapters["all"], prompt)
        weights = {name: p.detach().clone() for name, p in engine.model.module.named_parameters()}
        engine.sleep(level=level)
        engine.unload_lora_adapter("x")
        (lora_id,) = engine._lora.unlisted_ids()
        engine.wake_up()
        if level == 2:
            engine.update_weights(weights.items())
        out = engine.generate_outputs([prompt], use_tqdm=False)[0]
        assert engine.is_running and engine._lora.unlisted_ids() == []
        assert lora_id not in engine._core.runner.lora.paths
    assert out.token_ids == expected_tokens(base, prompt)
