"""An adapter whose host copy max_cpu_loras dropped is read again from its folder when it next
takes a slot; if the folder is gone by then, only that adapter's requests fail (caused by a
ValueError naming it), in the same steps as other requests that get PEFT's tokens, and the engine goes
on serving -- that adapter too, once its folder is back."""

from __future__ import annotations

import shutil

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.outputs import RequestError
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from tests.lora_harness import NUM_TOKENS, PROMPTS, expected_tokens, lora_setup

tiny = lora_setup  # the module's adapters, built once


@pytest.mark.parametrize("setup", ["sync", "async", "tp2"])
def test_adapter_folder_gone_fails_only_its_requests(tiny, tmp_path, setup):
    """Also with the GPU's step loop (async scheduling, overlapped outputs), and over two gloo
    ranks (every rank reads the adapter again, or none keeps it)."""
    folder, base, adapters = tiny
    modules = {}
    for name in ("all", "qv-rslora"):  # copies the test may take away
        shutil.copytree(folder / name, tmp_path / name)
        modules[name] = str(tmp_path / name)
    loop = dict(async_scheduling=True, overlap_output_processing=True) \
        if setup == "async" else {}
    model = Model.from_pretrained(folder / "base", device="cpu", dtype="float32",
                                  progress=False, tensor_parallel_size=2 if setup == "tp2" else 1)
    with kt.Engine(model, generation_config=GenerationConfig(max_new_tokens=NUM_TOKENS,
                                                             ignore_eos=True),
                   block_token_num=4, num_device_blocks=128, lora_modules=modules, max_loras=1,
                   max_cpu_loras=1, **loop) as engine:
        def tokens(lora: str | None, prompt: list[int] = PROMPTS[0]) -> list[int]:
            return engine.submit(kt.Request(prompt, lora=lora)).result().token_ids

        assert tokens("all") == expected_tokens(adapters["all"], PROMPTS[0])
        assert tokens("qv-rslora") == expected_tokens(adapters["qv-rslora"], PROMPTS[0])
        runner = engine._core.runner
        slots = runner.local.lora if setup == "tp2" else runner.lora
        ids = {path: lora_id for lora_id, path in slots.paths.items()}
        assert not slots.has_host_copy(ids[modules["all"]])  # dropped for "qv-rslora"'s
        assert slots.has_host_copy(ids[modules["qv-rslora"]])
        shutil.rmtree(tmp_path / "all")

        # All at once: the two "all" requests wait for the slot "qv-rslora" holds, then fail
        # when it is theirs; the others run in the same steps.
        jobs = [(PROMPTS[1], "qv-rslora"), (PROMPTS[0], "all"), (PROMPTS[2], None),
                (PROMPTS[1], "all")]
        handles = [engine.submit(kt.Request(prompt, lora=lora)) for prompt, lora in jobs]
        for (prompt, lora), handle in zip(jobs, handles):
            if lora == "all":
                with pytest.raises(RequestError, match=f"could not be read again.*{tmp_path}/all"
                                   ) as failure:
                    handle.result()
                assert isinstance(failure.value.__cause__, ValueError)  # HTTP: a 400
            else:
                reference = base if lora is None else adapters[lora]
                assert handle.result().token_ids == expected_tokens(reference, prompt)
        assert not engine.failure
        assert engine.stats().num_running == 0

        shutil.copytree(folder / "all", tmp_path / "all")  # back: served again
        assert tokens("all", PROMPTS[2]) == expected_tokens(adapters["all"], PROMPTS[2])
        assert tokens(None, PROMPTS[1]) == expected_tokens(base, PROMPTS[1])


def test_max_cpu_loras_must_hold_every_slot():
    """A step may copy max_loras adapters into slots, each from its host copy."""
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= the LoRA slots \(2"):
        kt.EngineConfig(max_loras=2, max_cpu_loras=1)
    assert kt.EngineConfig(max_loras=2, max_cpu_loras=2).max_cpu_loras == 2


def test_failed_adapter_requests_end_in_a_step_that_reads_a_grammar_row_back(
        default_model, default_model_dir, tmp_path):
    """Async scheduling with structured output: while a grammar request runs, every step reads
    the step in flight back before sampling (its grammar masks the next token). The step that
    finds an adapter unreadable is such a step; the failed requests' outputs made before that
    read-back still reach them (they fail, not hang), and the grammar request gets the tokens it
    gets alone."""
    from transformers import AutoModelForCausalLM

    from tests.lora_adapters import write_adapter_files

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    for seed, name in enumerate(("gone", "kept")):
        write_adapter_files(hf, tmp_path / name, seed=seed, targets=["q_proj", "v_proj"], rank=4)
    del hf
    prompt = default_model.tokenizer.encode("Count to ten:")
    # Digits are single tokens: 24 steps of grammar, never done before max_new_tokens.
    digits = GenerationConfig(max_new_tokens=24, ignore_eos=True,
                              structured_output={"kind": "regex", "value": "[0-9]{200}"})
    with kt.Engine(default_model, generation_config=GenerationConfig(max_new_tokens=4,
                                                                     ignore_eos=True),
                   block_token_num=16, num_device_blocks=64, max_loras=1, max_cpu_loras=1,
                   lora_modules={name: str(tmp_path / name) for name in ("gone", "kept")},
                   async_scheduling=True, overlap_output_processing=True) as engine:
        alone = engine.submit(kt.Request(prompt, digits)).result(timeout=120).token_ids
        assert len(alone) == 24
        for name in ("gone", "kept"):  # "gone"'s host copy is dropped for "kept"'s
            engine.submit(kt.Request(prompt, lora=name)).result(timeout=120)
        shutil.rmtree(tmp_path / "gone")
        # "gone" waits for the slot "kept" holds (4 steps), then fails while digits run on.
        kept, grammar, gone = (engine.submit(kt.Request(prompt, config, lora=lora))
                               for config, lora in ((None, "kept"), (digits, None),
                                                    (None, "gone")))
        with pytest.raises(RequestError, match="could not be read again"):
            gone.result(timeout=120)
        assert not grammar.output.finished  # it failed in a step that read a grammar row back
        assert grammar.result(timeout=120).token_ids == alone
        assert len(kept.result(timeout=120).token_ids) == 4
        assert not engine.failure
