"""`hf_overrides` (vLLM's --hf-overrides): config.json values changed before the model is built.
A tiny Llama loaded with a different RMSNorm epsilon and context length gives transformers'
logits and greedy tokens for the same overridden config (and not the original config's), on one
rank and over two gloo ranks (each worker applies them too); an Engine given a loaded model
refuses overrides it was not loaded with; a sub-config's keys are updated in place."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

import ksana_llm as kt
from ksana_llm.loader.hf_config import apply_hf_overrides, hf_overrides_applied
from tests.family_harness import greedy_trace, hf_reference
from tests.tiny_models import build_tiny_model

# A large epsilon changes every norm's output visibly; the context length shows in max_model_len.
OVERRIDES = {"rms_norm_eps": 0.25, "max_position_embeddings": 96}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama2", path)
    return path


def _hf_model(folder, overrides: dict) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(folder, config=config,
                                                dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (9, 30, 17)]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_overridden_model_equals_transformers_with_the_same_config(folder, tensor_parallel_size):
    reference = hf_reference(_hf_model(folder, OVERRIDES))
    original = hf_reference(_hf_model(folder, {}))
    prompt = _prompts()[1]
    # The override matters: the original config's logits are far from the overridden ones.
    assert (reference(prompt) - original(prompt)).abs().max() > 1e-2
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                     tensor_parallel_size=tensor_parallel_size,
                                     hf_overrides=dict(OVERRIDES))
    assert model.hf_config.rms_norm_eps == 0.25
    prompts = _prompts()
    expected = [greedy_trace(reference, p, 12)[0][len(p):] for p in prompts]
    config = kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4,
                   num_device_blocks=96) as engine:
        assert engine.max_model_len == 96
        outputs = engine.generate_outputs(prompts, use_tqdm=False)
        logits = engine.forward(prompt, [{"target_name": "logits"}]).targets[0].tensor
    assert [o.token_ids for o in outputs] == expected
    torch.testing.assert_close(logits, reference(prompt), atol=2e-4, rtol=1e-4)


def test_engine_config_carries_overrides_and_checks_a_loaded_model(folder):
    with kt.Engine(str(folder), device="cpu", dtype="float32", num_device_blocks=32,
                   hf_overrides={"max_position_embeddings": 80}) as engine:
        assert engine.max_model_len == 80
        assert engine.model.hf_config.max_position_embeddings == 80
        loaded = engine.model
        # A loaded model either holds the values asked for, or the Engine refuses them.
        with kt.Engine(loaded, num_device_blocks=16,
                       hf_overrides={"max_position_embeddings": 80}) as same:
            assert same.max_model_len == 80
        with pytest.raises(ValueError, match="hf_overrides"):
            kt.Engine(loaded, num_device_blocks=16, hf_overrides={"rms_norm_eps": 0.5})
    with pytest.raises(ValueError, match="hf_overrides"):
        kt.Model.from_pretrained(folder, device="cpu", progress=False, hf_overrides="eps=1")


def test_a_sub_config_is_updated_key_by_key():
    config = PretrainedConfig()
    config.text_config = LlamaConfig(hidden_size=64, rms_norm_eps=1e-6)
    apply_hf_overrides(config, {"text_config": {"rms_norm_eps": 0.5}, "new_key": [1, 2]})
    assert config.text_config.rms_norm_eps == 0.5 and config.text_config.hidden_size == 64
    assert config.new_key == [1, 2]
    assert hf_overrides_applied(config, {"text_config": {"rms_norm_eps": 0.5}})
    assert not hf_overrides_applied(config, {"text_config": {"rms_norm_eps": 0.4}})
    assert not hf_overrides_applied(config, {"missing": 1})
    with pytest.raises(ValueError, match="keys must be non-empty strings"):
        apply_hf_overrides(config, {"": 1})


def test_the_flag_reaches_the_engine_config(capsys):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse(["serve", "--hf-overrides", '{"rms_norm_eps": 0.25}']))[0]
    assert config.hf_overrides == {"rms_norm_eps": 0.25}
    with pytest.raises(SystemExit):
        parse(["serve", "--hf-overrides", "[1]"])
    assert "--hf-overrides" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, rope_parameters", [
    ({"rope_theta": 100.0}, {"rope_type": "default", "rope_theta": 100.0}),
    # The README's form (and Qwen2.5 model cards'): a scaling dict without rope_theta.
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
      "rope_theta": 10000.0}),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
     {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
])
def test_rope_overrides_reach_the_rotary_tables(folder, overrides, rope_parameters):
    """transformers 5 keeps rope_theta inside rope_parameters: a `rope_theta` override was set
    beside it and never read (the original theta's logits, silently), and a `rope_scaling` dict
    replaced it, losing the theta (a TypeError). Each must give transformers' logits for the
    config written out in full."""
    prompt = _prompts()[1]
    reference = hf_reference(_hf_model(folder, {"rope_parameters": rope_parameters}))
    original = hf_reference(_hf_model(folder, {}))
    assert (reference(prompt) - original(prompt)).abs().max() > 1e-3  # the override matters
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                     hf_overrides=overrides)
    with kt.Engine(model, num_device_blocks=32, block_token_num=4) as engine:
        logits = engine.forward(prompt, [{"target_name": "logits"}]).targets[0].tensor
        # The loaded model holds what was asked: an engine given the same overrides takes it.
        with kt.Engine(model, num_device_blocks=16, block_token_num=4, hf_overrides=overrides):
            pass
    torch.testing.assert_close(logits, reference(prompt), atol=2e-4, rtol=1e-4)
