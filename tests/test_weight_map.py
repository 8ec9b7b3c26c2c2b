"""KsanaLLM weight-name maps: a checkpoint whose tensors have other names loads through
`<model_type>_weight_map.json` (folder first, then the package), and equals transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ksana_llm.api.model import Model
from ksana_llm.loader import (WeightMap, find_weight_map, iterate_weights, load_weight_map,
                              weight_map_for)
from ksana_llm.loader import weight_map as weight_map_module
from tests.family_harness import check_prefill_and_decode, hf_reference
from tests.tiny_models import build_tiny_model

VOCAB = 256

# Llama name -> a GPT-style name nobody in our registry knows.
_TO_GPT = [
    (r"^model\.embed_tokens\.weight$", "transformer.wte.weight"),
    (r"^model\.norm\.weight$", "transformer.ln_f.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"transformer.h.\1.ln_1."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.h.\1.ln_2."),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.", r"transformer.h.\1.attn.\2."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"transformer.h.\1.mlp.w1."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"transformer.h.\1.mlp.w2."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.h.\1.mlp.c_proj."),
]

# The KsanaLLM map that undoes it (std::regex_replace syntax: `$1`), plus a dropped extra tensor.
GPT_MAP = {
    "transformer\\.wte\\.weight": "model.embed_tokens.weight",
    "transformer\\.ln_f\\.weight": "model.norm.weight",
    ".*visual.*": "deprecated",
    "transformer\\.h\\.(\\d+)\\.ln_1\\.weight": "model.layers.$1.input_layernorm.weight",
    "transformer\\.h\\.(\\d+)\\.ln_2\\.weight": "model.layers.$1.post_attention_layernorm.weight",
    "transformer\\.h\\.(\\d+)\\.attn\\.([qkvo])\\.weight": "model.layers.$1.self_attn.$2_proj.weight",
    "transformer\\.h\\.(\\d+)\\.mlp\\.w1\\.": "model.layers.$1.mlp.gate_proj.",
    "transformer\\.h\\.(\\d+)\\.mlp\\.w2\\.": "model.layers.$1.mlp.up_proj.",
    "transformer\\.h\\.(\\d+)\\.mlp\\.c_proj\\.": "model.layers.$1.mlp.down_proj.",
}


def _gpt_name(name: str) -> str:
    import re

    for pattern, replacement in _TO_GPT:
        if re.search(pattern, name):
            return re.sub(pattern, replacement, name)
    return name  # lm_head.weight keeps its name: a map needs no entry for it


def _renamed_copy(source: Path, target: Path, *, model_type: str | None = None) -> Path:
    """`source`'s checkpoint with GPT-style tensor names and one extra vision tensor."""
    target.mkdir()
    tensors = {_gpt_name(k): v for k, v in load_file(source / "model.safetensors").items()}
    assert "transformer.h.1.attn.q.weight" in tensors and "model.norm.weight" not in tensors
    tensors["transformer.visual.proj.weight"] = torch.randn(7, 3)  # must be dropped
    save_file(tensors, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    if model_type is not None:
        config["model_type"] = model_type
        config["architectures"] = ["MyGptForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("tiny_llama")
    return build_tiny_model("llama2", folder), folder


def _load(folder: Path) -> Model:
    return Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)


def test_renamed_checkpoint_loads_through_folder_map(tiny, tmp_path: Path) -> None:
    hf_model, original = tiny
    folder = _renamed_copy(original, tmp_path / "renamed")
    with pytest.raises(ValueError, match="has no place"):  # without the map the names are unknown
        _load(folder)
    (folder / "llama_weight_map.json").write_text(json.dumps(GPT_MAP))
    model = _load(folder)
    check_prefill_and_decode(model.module, hf_reference(hf_model), vocab=VOCAB, chunks=[16, 24])


def test_unknown_model_type_loads_as_llama_when_a_map_exists(tiny, tmp_path: Path) -> None:
    """KsanaLLM's rule: a family it does not know, with a weight map, is Llama under other names."""
    hf_model, original = tiny
    folder = _renamed_copy(original, tmp_path / "my_gpt", model_type="my_gpt")
    with pytest.raises(ValueError, match="my_gpt_weight_map.json"):
        _load(folder)
    (folder / "my_gpt_weight_map.json").write_text(json.dumps(GPT_MAP))
    check_prefill_and_decode(_load(folder).module, hf_reference(hf_model), vocab=VOCAB)


def test_package_map_is_used_when_the_folder_has_none(tiny, tmp_path: Path, monkeypatch) -> None:
    hf_model, original = tiny
    folder = _renamed_copy(original, tmp_path / "renamed")
    package = tmp_path / "package_maps"
    if weight_map_module.PACKAGE_WEIGHT_MAP_DIR.is_dir():  # a temp copy of the shipped maps
        shutil.copytree(weight_map_module.PACKAGE_WEIGHT_MAP_DIR, package)
    else:
        package.mkdir()
    (package / "llama_weight_map.json").write_text(json.dumps(GPT_MAP))
    assert find_weight_map(folder, "llama", package_dir=package) == package / "llama_weight_map.json"
    # Loading goes through the package folder (pointed at the temp copy).
    monkeypatch.setattr(weight_map_module, "PACKAGE_WEIGHT_MAP_DIR", package)
    check_prefill_and_decode(_load(folder).module, hf_reference(hf_model), vocab=VOCAB)


def test_yis_original_checkpoints_load_through_the_shipped_map(tiny, tmp_path: Path) -> None:
    """01-ai's first Yi releases: `model_type: "Yi"`, `YiForCausalLM`, and `ln1` / `ln2` for
    the two norms of each layer; the package's yi map renames them."""
    hf_model, original = tiny
    folder = tmp_path / "yi"
    folder.mkdir()
    tensors = {k.replace("input_layernorm", "ln1").replace("post_attention_layernorm", "ln2"): v
               for k, v in load_file(original / "model.safetensors").items()}
    assert "model.layers.0.ln1.weight" in tensors
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((original / "config.json").read_text())
    config.update(model_type="Yi", architectures=["YiForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    check_prefill_and_decode(_load(folder).module, hf_reference(hf_model), vocab=VOCAB)


def test_folder_map_wins_over_package_map(tiny, tmp_path: Path, monkeypatch) -> None:
    hf_model, original = tiny
    folder = _renamed_copy(original, tmp_path / "renamed")
    package = tmp_path / "package_maps"
    package.mkdir()
    # The package's map would drop every tensor; the folder's is the right one.
    (package / "llama_weight_map.json").write_text(json.dumps({".*": "deprecated"}))
    (folder / "llama_weight_map.json").write_text(json.dumps(GPT_MAP))
    assert find_weight_map(folder, "llama", package_dir=package) == folder / "llama_weight_map.json"
    assert weight_map_for(folder, "llama", package_dir=package).map_name("transformer.wte.weight") \
        == "model.embed_tokens.weight"
    monkeypatch.setattr(weight_map_module, "PACKAGE_WEIGHT_MAP_DIR", package)
    check_prefill_and_decode(_load(folder).module, hf_reference(hf_model), vocab=VOCAB)
    # And with the folder's map gone, the package's (broken) one is what loads.
    (folder / "llama_weight_map.json").unlink()
    with pytest.raises(ValueError, match="missing"):
        _load(folder)


@pytest.mark.parametrize("content, expected", [
    ({"transformer\\.h\\.(\\d+\\.ln_1": "model.layers.$1.x"}, ["not a valid regex", "ln_1"]),
    ({"transformer\\.h\\.(\\d+)\\.ln_1": "model.layers.$2.x"}, ["uses $2, but the regex has 1", "ln_1"]),
    ({"transformer\\.wte": 3}, ["must be a string", "wte"]),
    (["not", "an", "object"], ["must be a JSON object"]),
])
def test_bad_map_raises_value_error_naming_file_and_key(tmp_path: Path, content, expected) -> None:
    path = tmp_path / "llama_weight_map.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as info:
        load_weight_map(path)
    for part in [str(path), *expected]:
        assert part in str(info.value)


def test_bad_regex_fails_the_load_before_any_weights(tiny, tmp_path: Path) -> None:
    _, original = tiny
    folder = _renamed_copy(original, tmp_path / "renamed")
    path = folder / "llama_weight_map.json"
    path.write_text(json.dumps({"transformer\\.h\\.(\\d+": "model.layers.$1"}))
    with pytest.raises(ValueError, match="not a valid regex") as info:
        _load(folder)
    assert str(path) in str(info.value) and "transformer" in str(info.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        _load(folder)


def test_names_follow_std_regex_replace_semantics() -> None:
    wm = WeightMap.from_mapping({
        "\\.w(\\d)\\b": ".weight_$1",  # every match in the name is replaced
        "^a\\.(b)": "x.$1",  # never reached for names the first entry already matched
        "(cost)": "$$$1 ($&) [$`|$']",
        "vision": "deprecated",
    })
    assert wm.map_name("m.w1.w2") == "m.weight_1.weight_2"
    assert wm.map_name("a.b.w3") == "a.b.weight_3"  # first matching entry wins, no chaining
    assert wm.map_name("a.b.c") == "x.b.c"
    assert wm.map_name("unit.cost.x") == "unit.$cost (cost) [unit.|.x].x"
    assert wm.map_name("model.vision_tower.proj") is None
    assert wm.map_name("lm_head.weight") == "lm_head.weight"  # no entry: unchanged
    renamed = list(wm.apply([("m.w1", torch.zeros(1)), ("vision.x", torch.zeros(1)),
                             ("lm_head.weight", torch.zeros(1))]))
    assert [name for name, _ in renamed] == ["m.weight_1", "lm_head.weight"]


def test_two_tensors_mapping_to_one_name_is_an_error(tiny) -> None:
    _, original = tiny
    wm = WeightMap.from_mapping({"model\\.layers\\.\\d+\\.": "model.layers.0."}, "collapse")
    with pytest.raises(ValueError, match="both map to"):
        list(wm.apply(iterate_weights(original, progress=False)))
