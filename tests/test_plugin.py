"""KsanaLLM plugins: `ksana_plugin.py` in the model folder, class `KsanaPlugin` with optional
`init_plugin`, `preprocess` (may rewrite tokens and place input embeddings) and `postprocess`
(may add fields to the output). A plugin that fails to initialise is disabled with a warning."""

from __future__ import annotations

import logging
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.api.outputs import RequestOutput
from ksana_llm.api.plugin import Plugin, PluginError
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import greedy_trace, hf_reference
from tests.tiny_models import build_tiny_model

VOCAB = 256
NUM_NEW = 8

# Places the embeddings of other tokens at given positions -- what a ViT plugin does with image
# features -- using the checkpoint's own embedding table, loaded in init_plugin as a ViT would load
# its weights. Blocks follow KsanaLLM: pos[i] starts block i, a flat list of k * hidden floats.
EMBEDDING_PLUGIN = '''
from pathlib import Path

from safetensors.torch import load_file


class KsanaPlugin:
    def init_plugin(self, **kwargs):
        self.init_kwargs = kwargs
        weights = load_file(str(Path(kwargs["model_path"]) / "model.safetensors"))
        self.table = weights["model.embed_tokens.weight"]

    def preprocess(self, **kwargs):
        python_input = kwargs["ksana_python_input"]
        swaps = kwargs["additional_params"]["swap"]  # [[start, [token, ...]], ...]
        refit = python_input.input_refit_embedding
        refit.pos = [start for start, _ in swaps]
        refit.embeddings = [self.table[tokens].flatten().tolist() for _, tokens in swaps]
        # Anything set on the input comes back in postprocess: the same object.
        python_input.seen = {"prompt": kwargs["prompt"], "messages": kwargs["messages"],
                             "num_tokens": len(python_input.input_tokens)}

    def postprocess(self, **kwargs):
        output = kwargs["ksana_python_output"]
        output.num_generated = len(output.output_tokens[0])  # an attribute: lands in extra
        output.extra["seen"] = kwargs["ksana_python_input"].seen
'''

TOKEN_PLUGIN = '''
class KsanaPlugin:
    def preprocess(self, **kwargs):
        python_input = kwargs["ksana_python_input"]
        prefix = kwargs["additional_params"]["prefix"]
        python_input.input_tokens = prefix + [t for t in python_input.input_tokens if t != 9]
        python_input.sampling_config.max_new_tokens = 5
        python_input.sampling_config.topk = 1  # KsanaLLM's name for top_k
'''

BROKEN_PLUGINS = {
    "init_raises": '''
class KsanaPlugin:
    def init_plugin(self, **kwargs):
        raise RuntimeError("no ViT weights in " + kwargs["model_path"])

    def preprocess(self, **kwargs):
        raise AssertionError("a disabled plugin must never run")
''',
    "import_fails": "import a_module_that_does_not_exist\n",
    "no_class": "class SomethingElse:\n    pass\n",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("tiny_plugin")
    return build_tiny_model("llama2", folder), folder


def _with_plugin(tiny_folder: Path, target: Path, source: str) -> Path:
    shutil.copytree(tiny_folder, target)
    (target / "ksana_plugin.py").write_text(textwrap.dedent(source))
    return target


def _load(folder: Path, **kwargs) -> Model:
    return Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False, **kwargs)


def _engine(model: Model) -> kt.Engine:
    return kt.Engine(model, generation_config=GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True),
                     block_token_num=4, num_device_blocks=64)


def test_preprocess_embeddings_and_postprocess_field(tiny, tmp_path: Path) -> None:
    hf_model, original = tiny
    model = _load(_with_plugin(original, tmp_path / "m", EMBEDDING_PLUGIN))
    assert isinstance(model.plugin, Plugin)
    init_kwargs = model.plugin.instance.init_kwargs
    assert init_kwargs["model_path"] == str(model.path) and init_kwargs["model_type"] == "llama"
    assert init_kwargs["preprocess"] is True and init_kwargs["postprocess"] is True

    torch.manual_seed(5)
    prompt = torch.randint(3, VOCAB, (12,)).tolist()
    swap = [[2, [17]], [5, [40, 41]]]  # one block of one row, one of two rows
    substituted = list(prompt)
    substituted[2], substituted[5], substituted[6] = 17, 40, 41
    reference = hf_reference(hf_model)
    expected = greedy_trace(reference, substituted, NUM_NEW)[0][len(prompt):]
    plain = greedy_trace(reference, prompt, NUM_NEW)[0][len(prompt):]
    assert expected != plain, "the substitution must change the continuation for this test to bite"

    # What preprocess hands the engine: the same tokens, three embedding rows at 2, 5 and 6.
    result = model.plugin.run_preprocess(prompt, generation_config=GenerationConfig(),
                                         prompt="some text", additional_params={"swap": swap})
    assert result.token_ids == prompt and result.input_embeddings[0] == [2, 5, 6]
    assert result.input_embeddings[1].shape == (3, hf_model.config.hidden_size)

    with _engine(model) as engine:
        # The plain prompt first, so its KV is in the prefix cache: the embedding request must
        # not reuse it (same tokens, different inputs).
        engine.submit(kt.Request(prompt, additional_params={"swap": []})).result()
        out = engine.submit(kt.Request(prompt, additional_params={"swap": swap})).result()
    assert out.prompt_token_ids == prompt
    assert out.token_ids == expected
    # postprocess saw the same input object preprocess filled, and its fields reach the caller.
    assert out.extra == {"num_generated": NUM_NEW,
                         "seen": {"prompt": None, "messages": None, "num_tokens": 12}}


@pytest.mark.parametrize("kind", sorted(BROKEN_PLUGINS))
def test_broken_plugin_is_disabled_with_a_warning(tiny, tmp_path: Path, caplog, kind: str) -> None:
    hf_model, original = tiny
    folder = _with_plugin(original, tmp_path / kind, BROKEN_PLUGINS[kind])
    with caplog.at_level(logging.WARNING, logger="ksana_llm.plugin"):
        model = _load(folder)
    assert model.plugin is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(folder / "ksana_plugin.py") in r.getMessage() and "without" in r.getMessage()
               for r in warnings), [r.getMessage() for r in warnings]
    if kind == "init_raises":
        assert "no ViT weights" in caplog.text
    # The model still serves, exactly as transformers does.
    torch.manual_seed(6)
    prompt = torch.randint(3, VOCAB, (9,)).tolist()
    expected = greedy_trace(hf_reference(hf_model), prompt, NUM_NEW)[0][len(prompt):]
    with _engine(model) as engine:
        out = engine.submit(kt.Request(prompt, additional_params={"ignored": 1})).result()
    assert out.token_ids == expected and out.extra == {}


def test_preprocess_rewrites_input_tokens_and_settings(tiny, tmp_path: Path) -> None:
    hf_model, original = tiny
    model = _load(_with_plugin(original, tmp_path / "tok", TOKEN_PLUGIN))
    prompt = [5, 9, 11, 9, 13, 14]
    rewritten = [1, 30, 31, 5, 11, 13, 14]
    config = GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True, top_k=50)
    result = model.plugin.run_preprocess(prompt, generation_config=config,
                                         additional_params={"prefix": [1, 30, 31]})
    assert result.token_ids == rewritten and result.input_embeddings is None
    assert result.generation_config.max_new_tokens == 5 and result.generation_config.top_k == 1
    assert config.max_new_tokens == NUM_NEW and config.top_k == 50  # the caller's config is untouched

    expected = greedy_trace(hf_reference(hf_model), rewritten, 5)[0][len(rewritten):]
    with _engine(model) as engine:
        out = engine.submit(kt.Request(prompt, config, additional_params={"prefix": [1, 30, 31]})).result()
    assert out.prompt_token_ids == rewritten
    assert out.token_ids == expected and out.finish_reason == "length"  # 5 tokens, as the plugin set


def test_plugin_false_skips_the_folder_plugin(tiny, tmp_path: Path) -> None:
    _, original = tiny
    folder = _with_plugin(original, tmp_path / "off", BROKEN_PLUGINS["init_raises"])
    assert _load(folder, plugin=False).plugin is None
    with pytest.raises(ValueError, match="plugin must be"):
        _load(folder, plugin=3)


class _Scripted:
    """A plugin object whose preprocess does whatever the test hands it."""

    def __init__(self, action) -> None:
        self.action = action

    def preprocess(self, **kwargs) -> None:
        self.action(kwargs["ksana_python_input"])

    def postprocess(self, **kwargs) -> None:
        raise RuntimeError("postprocess bug")


def _scripted(action) -> Plugin:
    return Plugin(_Scripted(action), Path("scripted.py"), hidden_size=4, vocab_size=10,
                  device=torch.device("cpu"), dtype=torch.float32)


def _set(**fields):
    def action(python_input) -> None:
        for name, value in fields.items():
            target = python_input
            *path, last = name.split("__")
            for part in path:
                target = getattr(target, part)
            setattr(target, last, value)
    return action


def _raise(exc: Exception):
    def action(python_input) -> None:
        raise exc
    return action


@pytest.mark.parametrize("action, error, message", [
    (_set(input_tokens=[1, 10]), ValueError, "input_tokens must be in [0, 10)"),
    (_set(input_tokens=[]), ValueError, "input_tokens must be a non-empty list"),
    (_set(input_refit_embedding__pos=[0, 1], input_refit_embedding__embeddings=[[0.0] * 4]),
     ValueError, "2 positions in pos but 1 embeddings"),
    (_set(input_refit_embedding__pos=[1], input_refit_embedding__embeddings=[[0.0] * 6]),
     ValueError, "not a multiple of hidden_size 4"),
    (_set(input_refit_embedding__pos=[2], input_refit_embedding__embeddings=[[0.0] * 8]),
     ValueError, "covers positions [2, 4), outside the 3 input tokens"),
    (_set(input_refit_embedding__pos=[0, 1], input_refit_embedding__embedding_tensors=[
        torch.zeros(2, 4), torch.zeros(4)]), ValueError, "overlap"),
    (_set(sampling_config__temperature=-1.0), ValueError, "temperature"),
    (_raise(ValueError("image missing")), ValueError, "image missing"),
    (_raise(KeyError("max_pixels")), PluginError, "preprocess failed"),
])
def test_preprocess_results_are_validated(action, error, message) -> None:
    with pytest.raises(error) as info:
        _scripted(action).run_preprocess([1, 2, 3], generation_config=GenerationConfig())
    assert message in str(info.value)


def test_a_lone_stop_string_a_plugin_sets_becomes_a_list() -> None:
    """As GenerationConfig(stop="x") does: the engine matches stop strings from a list."""
    result = _scripted(_set(sampling_config__stop="</answer>", sampling_config__stop_token_ids=(7,))
                       ).run_preprocess([1, 2, 3], generation_config=GenerationConfig())
    assert result.generation_config.stop == ["</answer>"]
    assert result.generation_config.stop_token_ids == [7]


def test_request_embeddings_reach_the_plugin_and_come_back() -> None:
    rows = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    seen = {}

    def keep(python_input) -> None:
        seen["pos"] = list(python_input.input_refit_embedding.pos)

    result = _scripted(keep).run_preprocess([1, 2, 3], generation_config=GenerationConfig(),
                                            input_embeddings=([0, 2], rows))
    assert seen["pos"] == [0, 2]
    assert result.input_embeddings[0] == [0, 2]
    torch.testing.assert_close(result.input_embeddings[1], rows)


def test_failing_postprocess_is_logged_and_leaves_the_output(tiny, caplog) -> None:
    hf_model, original = tiny
    plugin = _scripted(lambda python_input: None)
    result = plugin.run_preprocess([1, 2, 3], generation_config=GenerationConfig())
    output = RequestOutput("r2", [1, 2, 3], text="ab", token_ids=[4, 5], finished=True)
    with caplog.at_level(logging.ERROR, logger="ksana_llm.plugin"):
        plugin.run_postprocess(result, output)
    assert "postprocess failed for request r2" in caplog.text
    assert output.extra == {} and output.token_ids == [4, 5]

    # Inside the engine: the request still finishes, and the engine keeps serving.
    model = _load(original, plugin=False)
    model.plugin = Plugin(_Scripted(lambda python_input: None), Path("scripted.py"),
                          hidden_size=hf_model.config.hidden_size, vocab_size=VOCAB,
                          device=model.device, dtype=model.dtype)
    prompt = [7, 8, 9, 10]
    expected = greedy_trace(hf_reference(hf_model), prompt, NUM_NEW)[0][len(prompt):]
    with _engine(model) as engine:
        first = engine.submit(kt.Request(prompt)).result()
        second = engine.submit(kt.Request(prompt)).result()
        assert engine.is_running
    assert first.token_ids == expected == second.token_ids and first.extra == {}
