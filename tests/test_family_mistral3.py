"""Mistral Small 3.1 / 3.2 (`Mistral3ForConditionalGeneration`) served as its language model,
for text, against transformers' whole model on text (fp32).

A tiny checkpoint as transformers saves it (`language_model.model.*`, a one-layer Pixtral tower
`vision_tower.*`, `multi_modal_projector.*`), its Mistral text model windowed at 12 tokens
(outrun by the 40-token test prompts): logits at prefill (whole and chunked), at 16 decode steps
and on a prefix-cache hit, and greedy tokens through the Engine (tests/family_harness.py); no
vision weight is loaded, and a weight update by the checkpoint's own names lands. A PEFT LoRA
adapter made on the composite (its q/v projections, the vision tower's too) serves as PEFT's
merged model does on text.
"""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig,
                          PixtralVisionConfig)

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.models.llama import MistralForCausalLM as OurMistral
from tests.family_harness import check_family, greedy_trace, load_ours

VOCAB = 256


def tiny_mistral3() -> Mistral3ForConditionalGeneration:
    text = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=VOCAB + 4, max_position_embeddings=256, sliding_window=12,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, head_dim=16, image_size=28,
                                 patch_size=14)
    torch.manual_seed(0)
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=VOCAB + 1)).eval()


def text_reference(hf: torch.nn.Module):
    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids])).logits[0].float()
    return logits


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    hf = tiny_mistral3()
    hf.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in stored)
    ours = load_ours(tmp_path)
    assert isinstance(ours, OurMistral) and ours.sliding_window == 12
    assert not any("vision" in name or "projector" in name for name, _ in ours.named_parameters())
    check_family(ours, tmp_path, text_reference(hf), vocab=VOCAB)
    # A weight update by the checkpoint's names (an RL trainer's push) reaches the same weight.
    name = "language_model.model.layers.1.mlp.down_proj.weight"
    ours.load_weights([(name, torch.zeros_like(stored[name]))], require_all=False)
    assert torch.count_nonzero(ours.model.layers[1].mlp.down_proj.weight) == 0


def test_lora_adapter_made_on_the_composite(tmp_path):
    hf = tiny_mistral3()
    hf.save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=r".*\.(q_proj|v_proj)"))
    peft_model.save_pretrained(tmp_path / "adapter")
    names = list(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any("vision_tower" in n for n in names) and any("language_model" in n for n in names)
    merged = peft_model.merge_and_unload().eval()
    prompt = list(range(3, 40))
    expected = greedy_trace(text_reference(merged), prompt, 8)[0][len(prompt):]
    model = Model.from_pretrained(tmp_path / "base", device="cpu", dtype="float32",
                                  progress=False)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with kt.Engine(model, generation_config=config,
                   lora_modules={"a": str(tmp_path / "adapter")}) as engine:
        adapted = engine.generate_outputs([prompt], use_tqdm=False, lora="a")[0].token_ids
        base = engine.generate_outputs([prompt], use_tqdm=False)[0].token_ids
    assert adapted == expected
    assert base == greedy_trace(text_reference(hf), prompt, 8)[0][len(prompt):] != adapted
