"""LoRA adapter files: bad ones are clear errors (and a rank that refuses one fails the load, not
the engine), adapters the engine saves are read by PEFT and the engine alike, and adapters named
after a fused checkpoint's modules go through its weight map. References: PEFT on transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import hf_reference
from tests.lora_adapters import ALL_TARGETS, make_adapter
from tests.lora_harness import (NUM_TOKENS, PROMPTS, expected_tokens, lora_setup, make_engine,
                                rewrite_adapter, submit_all)

tiny = lora_setup  # the module's adapters, built once


def test_bad_adapters_are_clear_errors(tiny, tmp_path):
    folder, _, _ = tiny
    good = folder / "all"
    first_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    cases = {
        "max_lora_rank": (str(good), {"max_lora_rank": 4}),
        "use_dora": (rewrite_adapter(good, tmp_path / "dora", config={"use_dora": True}), {}),
        "modules_to_save": (rewrite_adapter(good, tmp_path / "mts",
                                     config={"modules_to_save": ["lm_head"]}), {}),
        "peft_type": (rewrite_adapter(good, tmp_path / "ia3", config={"peft_type": "IA3"}), {}),
        "alora_invocation_tokens": (rewrite_adapter(good, tmp_path / "alora",
                                             config={"alora_invocation_tokens": [5, 6]}), {}),
        "layer_replication": (rewrite_adapter(good, tmp_path / "replicate",
                                       config={"layer_replication": [[0, 2]]}), {}),
        "'pissa_niter_4' changes the base": (rewrite_adapter(
            good, tmp_path / "pissa", config={"init_lora_weights": "pissa_niter_4"}), {}),
        "'olora' changes the base": (rewrite_adapter(
            good, tmp_path / "olora", config={"init_lora_weights": "olora"}), {}),
        "lacks its lora_B": (rewrite_adapter(good, tmp_path / "noB", tensors=lambda w: {
            k: v for k, v in w.items() if k != first_b}), {}),
        "lm_head": (rewrite_adapter(good, tmp_path / "head", tensors=lambda w: {
            **w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 8)}), {}),
        "do not fit": (rewrite_adapter(good, tmp_path / "shape", tensors=lambda w: {
            **w, first_b: torch.zeros(7, 8)}), {}),
        "not a folder": (str(tmp_path / "missing"), {}),
    }
    for message, (path, settings) in cases.items():
        with pytest.raises(ValueError, match=message):
            make_engine(folder / "base", lora_modules={"bad": path}, **settings)
    with make_engine(folder / "base", max_loras=2) as engine:
        for message, (path, settings) in cases.items():
            if not settings:
                with pytest.raises(ValueError, match=message):
                    engine.load_lora_adapter("bad", path)
        assert engine.lora_adapters == {}  # nothing half-loaded
        engine.load_lora_adapter("bad", str(good))  # the name and slot are free again
        with pytest.raises(ValueError, match="lora"):
            engine.submit(kt.Request(PROMPTS[0], lora=3))
        with pytest.raises(ValueError, match="export_kv does not work with a LoRA adapter"):
            engine.submit(kt.Request(PROMPTS[0], lora="bad", export_kv=True))
    assert kt.EngineConfig(lora_modules={"a": "x", "b": "y"}, max_loras=1).num_lora_slots == 1
    assert kt.EngineConfig(lora_modules={str(i): "x" for i in range(6)}).num_lora_slots == 4
    with make_engine(folder / "base") as engine, pytest.raises(ValueError, match="no LoRA slots"):
        engine.load_lora_adapter("a", str(good))


def test_a_rank_that_refuses_an_adapter_fails_the_load_not_the_engine(tiny, tmp_path):
    """Pipeline parallelism: rank 0 cannot check the layers another stage holds. An adapter
    whose second layer names a module nothing can adapt is refused by that stage's worker: the
    load is a ValueError, the slot is cleared on every rank, and the engine serves on."""
    folder, base, adapters = tiny
    bad = rewrite_adapter(folder / "all", tmp_path / "bad", tensors=lambda w: {
        **w, "base_model.model.model.layers.1.mlp.experts.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.1.mlp.experts.lora_B.weight": torch.zeros(64, 8)})
    model = Model.from_pretrained(folder / "base", device="cpu", dtype="float32", progress=False,
                                  pipeline_parallel_size=2)
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=128,
                   max_loras=1) as engine:
        with pytest.raises(ValueError, match="experts' cannot be adapted"):
            engine.load_lora_adapter("bad", bad)
        assert engine.lora_adapters == {}
        engine.load_lora_adapter("all", str(folder / "all"))
        got = submit_all(engine, [(PROMPTS[0], None), (PROMPTS[1], "all")])
    assert got == [expected_tokens(base, PROMPTS[0]), expected_tokens(adapters["all"], PROMPTS[1])]
    # The same adapter given at start-up: the engine does not start, with the worker's reason.
    model = Model.from_pretrained(folder / "base", device="cpu", dtype="float32", progress=False,
                                  pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="experts' cannot be adapted"):
        kt.Engine(model, block_token_num=4, num_device_blocks=128, lora_modules={"bad": bad})


def test_saved_adapters_are_read_by_peft_and_by_the_engine_alike(tiny, tmp_path):
    """`save_lora_adapter` writes PEFT's format: PEFT loads the file and the engine gives its
    logits."""
    import copy

    from peft import PeftModel

    from tests.lora_adapters import write_adapter_files

    folder, base, _ = tiny
    write_adapter_files(base, tmp_path / "saved", seed=7, targets=["v_proj", "gate_proj"], rank=3)
    reference = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "saved").eval()
    with make_engine(folder / "base", lora_modules={"saved": str(tmp_path / "saved")}) as engine:
        logits = engine.forward(PROMPTS[0], [{"target_name": "logits"}], lora="saved")
    torch.testing.assert_close(logits.targets[0].tensor, hf_reference(reference)(PROMPTS[0]),
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits.targets[0].tensor, hf_reference(base)(PROMPTS[0]),
                              atol=1e-3)


def test_fused_checkpoint_names_go_through_the_weight_map(tmp_path):
    """Qwen v1 stores q/k/v as one `c_attn` and names its MLP w1/w2/c_proj; an adapter trained
    on it names those modules. Its weight map renames them as it renames the weights, and a
    `c_attn` adapter (one A for q, k and v, B's rows split between them) applies to the fused
    projection. Reference: PEFT on transformers' Qwen2 with the same numbers (the Qwen v1
    checkpoint is that model rearranged, and the c_attn adapter its q/k/v adapters stacked)."""
    from ksana_llm.loader.lora import save_lora_adapter
    from tests.family_harness import write_checkpoint
    from tests.test_family_qwen import qwen_v1_config, qwen_v1_reference, qwen_v1_tensors

    hf = qwen_v1_reference()
    folder = write_checkpoint(tmp_path / "qwen", qwen_v1_config(), qwen_v1_tensors(hf),
                              "safetensors")
    rank = 4
    peft_model = make_adapter(hf, tmp_path / "qwen2-adapter", seed=6, targets=ALL_TARGETS,
                              rank=rank)
    ab = load_file(tmp_path / "qwen2-adapter" / "adapter_model.safetensors")

    def pair(layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = f"base_model.model.model.layers.{layer}.{module}"
        return ab[f"{key}.lora_A.weight"], ab[f"{key}.lora_B.weight"]

    def padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every module at rank 3r (the stacked c_attn's), zeros beyond its own r.
        return (torch.cat([a, a.new_zeros(2 * rank, a.shape[1])]),
                torch.cat([b, b.new_zeros(b.shape[0], 2 * rank)], dim=1))

    modules = {}
    for i in range(hf.config.num_hidden_layers):
        q, k, v = (pair(i, f"self_attn.{p}_proj") for p in "qkv")
        modules[f"transformer.h.{i}.attn.c_attn"] = (torch.cat([q[0], k[0], v[0]]),
                                                     torch.block_diag(q[1], k[1], v[1]))
        modules[f"transformer.h.{i}.attn.c_proj"] = padded(*pair(i, "self_attn.o_proj"))
        modules[f"transformer.h.{i}.mlp.w1"] = padded(*pair(i, "mlp.up_proj"))
        modules[f"transformer.h.{i}.mlp.w2"] = padded(*pair(i, "mlp.gate_proj"))
        modules[f"transformer.h.{i}.mlp.c_proj"] = padded(*pair(i, "mlp.down_proj"))
    # The same scaling as the reference's alpha / r = 2r / r, at rank 3r.
    save_lora_adapter(tmp_path / "v1-adapter", modules, lora_alpha=2 * 3 * rank)

    with make_engine(folder, lora_modules={"v1": str(tmp_path / "v1-adapter")},
                     max_lora_rank=3 * rank) as engine:
        got = engine.generate_outputs(PROMPTS, use_tqdm=False, lora="v1")
        logits = engine.forward(PROMPTS[0], [{"target_name": "logits"}], lora="v1")
    assert [o.token_ids for o in got] == [expected_tokens(peft_model, p) for p in PROMPTS]
    torch.testing.assert_close(logits.targets[0].tensor, hf_reference(peft_model)(PROMPTS[0]),
                               atol=1e-4, rtol=1e-4)
    assert [o.token_ids for o in got] != [expected_tokens(hf, p) for p in PROMPTS]
