"""`Engine.update_weights`: new weights while serving (an RL trainer's weight sync).

Two tiny random Llamas of one shape, A and B (different seeds): an engine serving A must answer
like transformers' B after an update from B's folder or B's state dict (whole or in parts, in
another dtype), with the prefix cache emptied (a prompt cached under A answers like B) and
requests running meanwhile finishing. An update that does not fit (a wrong shape after valid
tensors, an unknown name, another model type) is a ValueError that changes nothing. Each family's
own loading (fused projections, stacked experts, MLA, MTP, a tied head, FP8 online quantization)
is checked by comparing the updated module with one loaded from B's folder; tensor parallelism
(2 ranks, gloo) by transformers' tokens again.
"""

from __future__ import annotations


import re
import shutil

import pytest
import safetensors.torch
import torch

import ksana_llm as kt
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.loader.default_model import default_model_gguf
from ksana_llm.models.factory import load_model_module
from ksana_llm.models.weight_loading import expected_keys
from ksana_llm.models.weight_update import apply_update, check_update, weight_update
from tests.family_harness import greedy_trace, hf_reference
from tests.quantized_checkpoints import write_fp8_checkpoint
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 10
ENGINE = dict(device="cpu", dtype="float32", block_token_num=4, num_device_blocks=128)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (7, 21)]


def expected(hf: torch.nn.Module, batch: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    reference = hf_reference(hf)
    return [greedy_trace(reference, p, n)[0][len(p):] for p in batch]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """Folders and transformers models of A (seed 0) and B (seed 1), and their greedy tokens."""
    root = tmp_path_factory.mktemp("weights")
    hf_a = build_tiny_model("llama2", root / "a", seed=0)
    hf_b = build_tiny_model("llama2", root / "b", seed=1)
    batch = prompts()
    return {"a": root / "a", "b": root / "b", "hf_a": hf_a, "hf_b": hf_b, "prompts": batch,
            "tokens_a": expected(hf_a, batch), "tokens_b": expected(hf_b, batch)}


def greedy(engine: kt.Engine, batch: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    return [out.token_ids for out in engine.generate_outputs(batch, generation_config=config)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_update_from_a_folder_answers_like_the_new_checkpoint(pair, async_scheduling):
    with kt.Engine(str(pair["a"]), async_scheduling=async_scheduling, **ENGINE) as engine:
        assert greedy(engine, pair["prompts"]) == pair["tokens_a"]
        count = engine.update_weights(str(pair["b"]))
        assert count == len(pair["hf_b"].state_dict())
        assert greedy(engine, pair["prompts"]) == pair["tokens_b"]


def test_update_from_tensors_in_parts_and_another_dtype(pair):
    """A trainer's state dict in two calls (a dict, then (name, tensor) pairs), in float64: the
    tensors not given keep their values until their part comes."""
    state = {name: tensor.double() for name, tensor in pair["hf_b"].state_dict().items()}
    names = sorted(state)
    first, second = names[:len(names) // 2], names[len(names) // 2:]
    with kt.Engine(str(pair["a"]), **ENGINE) as engine:
        assert engine.update_weights({name: state[name] for name in first}) == len(first)
        halfway = greedy(engine, pair["prompts"])
        assert halfway not in (pair["tokens_a"], pair["tokens_b"])
        assert engine.update_weights([(name, state[name]) for name in second]) == len(second)
        assert greedy(engine, pair["prompts"]) == pair["tokens_b"]


def test_a_base_models_names_update_like_at_load(pair, tmp_path):
    """Names without the `model.` prefix (a trainer's `model.model.state_dict()`, a folder
    saved from the base model) get it, as at load. Tensors given outright may be a part: a
    head they lack keeps its values; a folder is whole: its embedding stands in for the head."""
    state = pair["hf_b"].state_dict()
    base = {name.removeprefix("model."): tensor for name, tensor in state.items()
            if name.startswith("model.")}
    assert "lm_head.weight" in state and len(base) == len(state) - 1
    with kt.Engine(str(pair["a"]), **ENGINE) as engine:
        assert engine.update_weights(base) == len(base)
        assert greedy(engine, pair["prompts"]) != pair["tokens_b"]  # A's head still
        engine.update_weights({"lm_head.weight": state["lm_head.weight"]})
        assert greedy(engine, pair["prompts"]) == pair["tokens_b"]

    folder = tmp_path / "base"
    folder.mkdir()
    shutil.copy(pair["b"] / "config.json", folder)
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in base.items()},
                                str(folder / "model.safetensors"))
    module, _ = load_model_module(pair["a"], device=torch.device("cpu"), dtype="float32",
                                  progress=False)
    update = weight_update(str(folder), pair["a"], module.config)
    assert check_update(module, update).num_tensors == len(base)
    apply_update(module, update)
    assert torch.equal(module.lm_head.weight, base["embed_tokens.weight"])
    assert torch.equal(module.model.layers[1].mlp.down_proj.weight,
                       base["layers.1.mlp.down_proj.weight"])


def test_the_prefix_cache_is_emptied(pair):
    """A prompt cached under A's weights must not reuse that KV after the update: its answer is
    B's (with the cached blocks it would not be)."""
    prompt = pair["prompts"][1]  # 21 tokens: 5 full blocks of 4
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with kt.Engine(str(pair["a"]), enable_prefix_caching=True, **ENGINE) as engine:
        assert greedy(engine, [prompt]) == pair["tokens_a"][1:]
        again = engine.generate_outputs([prompt], generation_config=config)[0]
        assert again.token_ids == pair["tokens_a"][1] and again.num_cached_tokens == 20
        engine.update_weights(str(pair["b"]))
        after = engine.generate_outputs([prompt], generation_config=config)[0]
        assert after.token_ids == pair["tokens_b"][1] and after.num_cached_tokens == 0


def test_requests_running_during_an_update_finish(pair):
    """A long request submitted before the update runs on (new weights from its next token);
    requests after it answer like B."""
    config = GenerationConfig(max_new_tokens=120, ignore_eos=True)
    with kt.Engine(str(pair["a"]), **ENGINE) as engine:
        handle = engine.submit(kt.Request(pair["prompts"][0], generation_config=config))
        next(handle.deltas())  # a token is out: the request is running
        engine.update_weights(str(pair["b"]))
        result = handle.result()
        assert len(result.token_ids) == 120 and result.finish_reason == "length"
        assert greedy(engine, pair["prompts"]) == pair["tokens_b"]


def test_an_update_that_does_not_fit_changes_nothing(pair, tmp_path):
    state = pair["hf_b"].state_dict()
    last = sorted(state)[-1]
    other_type = tmp_path / "moe"
    build_tiny_model("qwen3-moe", other_type)
    empty = tmp_path / "empty"  # a checkpoint folder whose weights file holds nothing
    empty.mkdir()
    shutil.copy(pair["a"] / "config.json", empty)
    safetensors.torch.save_file({}, str(empty / "model.safetensors"))
    bad_updates = {
        # every tensor valid but the last: the check catches it before any value changes
        "shape": ({**state, last: torch.zeros(3, 5)}, re.escape(f"{last}: shape (3, 5)")),
        "name": ({**state, "model.layers.9.mlp.up_proj.weight": state[last]},
                 "'model.layers.9.mlp.up_proj.weight'"),
        "model type": (str(other_type), "holds a 'qwen3_moe' model, this engine serves a 'llama'"),
        "no folder": (str(tmp_path / "missing"), "is not a checkpoint folder"),
        "empty folder": (str(empty), f"{re.escape(str(empty))} holds no tensors"),
        "not a tensor": ({"model.norm.weight": [1.0] * 64}, "expected \\(name, tensor\\) pairs"),
        "nothing": ({}, "no tensors given"),
        "a tensor alone": (state[last], "weights must be"),
    }
    with kt.Engine(str(pair["a"]), **ENGINE) as engine:
        for case, (weights, message) in bad_updates.items():
            with pytest.raises(ValueError, match=message):
                engine.update_weights(weights)
            assert greedy(engine, pair["prompts"]) == pair["tokens_a"], case


@pytest.mark.parametrize("source", ["file", "folder"])
def test_an_update_from_a_gguf_file_loads_its_weights(default_model_dir, hf_default_model,
                                                      source):
    """The default model is a GGUF file: an update from it (or from the folder holding it)
    loads its converted weights, as `Model.from_pretrained` does."""
    gguf = default_model_gguf()
    model = kt.Model.from_pretrained(default_model_dir, device="cpu", dtype="float32",
                                     progress=False)  # its own: the update changes its weights
    prompt = model.tokenizer.encode("The capital of France is")
    reference = greedy_trace(hf_reference(hf_default_model), prompt, 6)[0][len(prompt):]
    hidden = model.hf_config.hidden_size
    with kt.Engine(model, num_device_blocks=64) as engine:
        assert greedy(engine, [prompt], 6) == [reference]
        engine.update_weights({"model.norm.weight": -torch.ones(hidden)})
        assert greedy(engine, [prompt], 6) != [reference]
        engine.update_weights(str(gguf if source == "file" else gguf.parent))
        assert greedy(engine, [prompt], 6) == [reference]


class _ReadSpy:
    """safetensors' `safe_open`, recording the names whose values are read."""

    def __init__(self, real) -> None:
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        handle, spy = self.real(*args, **kwargs), self

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return handle.get_slice(name)

            def get_tensor(self, name):
                spy.read.append(name)
                return handle.get_tensor(name)

        return Handle()


def test_the_check_reads_no_matrix_of_a_folder(pair, tmp_path, monkeypatch):
    """The dry run takes the matrices' shapes from the safetensors headers (only vectors are
    read); a matrix of the wrong shape is still refused, naming it, and nothing changes."""
    import safetensors
    from safetensors.torch import save_file

    spy = _ReadSpy(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    model = kt.Model.from_pretrained(str(pair["a"]), device="cpu", dtype="float32",
                                     progress=False)
    before = {name: t.clone() for name, t in model.module.state_dict().items()}
    state = {name: t.contiguous() for name, t in pair["hf_b"].state_dict().items()}
    matrices = {name for name, t in state.items() if t.dim() > 1}
    spy.read.clear()
    checked = check_update(model.module, weight_update(str(pair["b"]), pair["a"],
                                                      model.hf_config))
    assert checked.num_tensors == len(state) and spy.read  # the vectors were read...
    assert not matrices & set(spy.read)  # ...and no matrix
    name = sorted(matrices)[-1]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((pair["b"] / "config.json").read_text())
    save_file({**state, name: state[name].reshape(-1, 2).contiguous()},
              str(bad / "model.safetensors"))
    spy.read.clear()
    with pytest.raises(ValueError, match=re.escape(name)):
        check_update(model.module, weight_update(str(bad), pair["a"], model.hf_config))
    assert not matrices & set(spy.read)
    for key, value in model.module.state_dict().items():
        assert torch.equal(value, before[key]), key


def _container_state(module: torch.nn.Module) -> dict[tuple[str, str], str]:
    """Every dict / list / set attribute of every submodule (per-stack loading state such as
    FusedExperts' int8_activations), as text: a dry run must leave them as they were."""
    return {(name, key): repr(value) for name, sub in module.named_modules()
            for key, value in vars(sub).items()
            if isinstance(value, (dict, list, set))
            and (not key.startswith("_") or key in ("_has_dense", "_ordered"))}


@pytest.mark.parametrize("family, quantization, safetensors", [
    ("qwen3-moe", None, True),          # stacked experts, q/k norms
    ("qwen3-moe", "w8a8_int8", True),   # int8 expert stacks, activations quantized per token
    ("deepseek-v3", None, True),        # MLA projections, grouped-topk experts, shared expert
    ("smollm-tied-mha", None, False),   # tied head: a .bin stores lm_head.weight too
    ("yi-gqa4-bias", "fp8", True),      # FP8 projections quantized as they load, biases
])
def test_each_family_updates_like_a_fresh_load(tmp_path, family, quantization, safetensors):
    """In place: every parameter keeps its identity (CUDA graphs hold their addresses), and
    every checkpoint key is reported filled by a whole folder."""
    build_tiny_model(family, tmp_path / "a", seed=0)
    build_tiny_model(family, tmp_path / "b", seed=1, safe_serialization=safetensors)
    load = dict(device=torch.device("cpu"), dtype="float32", progress=False,
                quantization=quantization)
    module, _ = load_model_module(tmp_path / "a", **load)
    fresh, _ = load_model_module(tmp_path / "b", **load)
    before = {name: value.clone() for name, value in module.state_dict().items()}
    identities = {name: id(p) for name, p in module.named_parameters()}
    state = _container_state(module)
    update = weight_update(str(tmp_path / "b"), tmp_path / "a", module.config)
    checked = check_update(module, update)
    assert set(expected_keys(module)) <= checked.filled
    assert all(torch.equal(before[name], value) for name, value in module.state_dict().items())
    assert _container_state(module) == state
    module.load_weights(update.stream(), require_all=False)
    assert {name: id(p) for name, p in module.named_parameters()} == identities
    after, wanted = module.state_dict(), fresh.state_dict()
    assert after.keys() == wanted.keys()
    changed = [name for name in after if not torch.equal(after[name], wanted[name])]
    assert not changed, changed


def test_updates_that_would_change_the_models_format_are_refused(tmp_path):
    """A tied model's head of the wrong shape, and dense tensors for an FP8 checkpoint's
    projections (they would replace its parameters instead of filling them)."""
    hf = build_tiny_model("smollm-tied-mha", tmp_path / "tied")
    module, _ = load_model_module(tmp_path / "tied", device=torch.device("cpu"),
                                  dtype="float32", progress=False)
    with pytest.raises(ValueError, match="shape"):
        check_update(module, weight_update({"lm_head.weight": torch.zeros(255, 64)},
                                           tmp_path / "tied", module.config))
    write_fp8_checkpoint(tmp_path / "tied", tmp_path / "fp8")
    quantized, _ = load_model_module(tmp_path / "fp8", device=torch.device("cpu"),
                                     dtype="float32", progress=False)
    dense = {"model.layers.0.mlp.up_proj.weight": hf.state_dict()["model.layers.0.mlp.up_proj.weight"]}
    with pytest.raises(ValueError, match="would replace model.layers.0.mlp"):
        check_update(quantized, weight_update(dense, tmp_path / "fp8", quantized.config))


def test_tensor_parallel_ranks_update_their_shards(pair):
    """TP 2 (two processes, gloo): B's state dict reaches the worker rank, which keeps its own
    slices; a bad tensor is refused by every rank and nothing changes."""
    state = pair["hf_b"].state_dict()
    with kt.Engine(str(pair["a"]), tensor_parallel_size=2, **ENGINE) as engine:
        assert greedy(engine, pair["prompts"]) == pair["tokens_a"]
        with pytest.raises(ValueError, match="down_proj"):
            engine.update_weights({**state, "model.layers.1.mlp.down_proj.weight":
                                   torch.zeros(64, 7)})
        assert greedy(engine, pair["prompts"]) == pair["tokens_a"]
        assert engine.update_weights(state) == len(state)
        assert greedy(engine, pair["prompts"]) == pair["tokens_b"]


@pytest.mark.parametrize("family", ["llama2", "qwen3-moe"])
def test_a_gptq_act_order_checkpoint_updates_in_place(tmp_path, family):
    """AutoGPTQ's activation order: each projection (and expert) keeps its input order, which
    the check compares with the one loaded (so it must read it)."""
    from tests.gptq_awq_checkpoints import write_gptq_from_files

    build_tiny_model(family, tmp_path / "a", seed=0)
    build_tiny_model(family, tmp_path / "b", seed=1)
    for name in ("a", "b"):
        write_gptq_from_files(tmp_path / name, tmp_path / f"gptq-{name}", desc_act=True)
    load = dict(device=torch.device("cpu"), dtype="float32", progress=False)
    module, _ = load_model_module(tmp_path / "gptq-a", **load)
    fresh, _ = load_model_module(tmp_path / "gptq-b", **load)
    identities = {name: id(p) for name, p in module.named_parameters()}
    update = weight_update(str(tmp_path / "gptq-b"), tmp_path / "gptq-a", module.config)
    assert set(expected_keys(module)) <= check_update(module, update).filled
    module.load_weights(update.stream(), require_all=False)
    assert {name: id(p) for name, p in module.named_parameters()} == identities
    after, wanted = module.state_dict(), fresh.state_dict()
    changed = [name for name in wanted if not torch.equal(after[name], wanted[name])]
    assert not changed, changed
