"""LoRA adapters for tests: saved by PEFT itself, with random non-zero B matrices (PEFT
initialises B to zero, which would make every adapter a no-op); or, where PEFT is not installed
(the GPU machine's image) and no PEFT reference is needed, written in PEFT's file format by hand."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ksana_llm as kt
from ksana_llm.loader.lora import save_lora_adapter

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: torch.nn.Module, folder: Path, *, seed: int, targets: list[str],
                 rank: int, b_std: float = 0.1, **lora_kwargs) -> torch.nn.Module:
    """Save a PEFT LoRA adapter of `base` (alpha = 2 x rank) in `folder`; return the PEFT model
    (eval mode), the reference for that adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                        init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    model.save_pretrained(folder)
    return model.eval()


def write_adapter_files(base: torch.nn.Module, folder: Path, *, seed: int, targets: list[str],
                        rank: int, std: float = 0.1) -> None:
    """A random adapter in PEFT's format, without PEFT: A and B of every linear layer whose
    name ends in one of `targets`."""
    torch.manual_seed(seed)
    save_lora_adapter(folder, {
        name: (torch.randn(rank, module.in_features) * std,
               torch.randn(module.out_features, rank) * std)
        for name, module in base.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets},
        lora_alpha=2 * rank)


def check_adapter_matches_peft(base: torch.nn.Module, model_folder: Path, adapter_folder: Path,
                               check_model: Callable[[kt.Model], None] | None = None,
                               **engine_kwargs: Any) -> None:
    """An all-target rank-4 adapter of `base` (transformers' model of what the engine will hold)
    served by an Engine on `model_folder` next to a base request: each gives the greedy tokens
    of transformers' `base` and of PEFT's adapter on it. `check_model` looks at the loaded model
    first (what it holds)."""
    from tests.family_harness import greedy_trace, hf_reference

    peft = make_adapter(base, adapter_folder, seed=1, targets=ALL_TARGETS, rank=4)
    torch.manual_seed(5)
    prompt = torch.randint(3, 256, (14,)).tolist()
    expected = {lora: greedy_trace(hf_reference(model), prompt, 12)[0][len(prompt):]
                for lora, model in ((None, base), ("sql", peft))}
    assert expected["sql"] != expected[None]
    config = kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with kt.Engine(str(model_folder), generation_config=config, device="cpu", dtype="float32",
                   block_token_num=4, num_device_blocks=64,
                   lora_modules={"sql": str(adapter_folder)}, **engine_kwargs) as engine:
        if check_model is not None:
            check_model(engine.model)
        handles = {lora: engine.submit(kt.Request(prompt, lora=lora)) for lora in expected}
        got = {lora: handle.result().token_ids for lora, handle in handles.items()}
    assert got == expected
