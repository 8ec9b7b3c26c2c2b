"""Mistral Small 3.1 / 3.2 (`Mistral3ForConditionalGeneration`) served as its language model,
for text, against transformers' whole model on text (fp32).

A tiny checkpoint as transformers saves it (`language_model.model.*`, a one-layer Pixtral tower
`vision_tower.*`, `multi_modal_projector.*`), its Mistral text model windowed at 12 tokens
(outrun by the 40-token test prompts): logits at prefill (whole and chunked), at 16 decode steps
and on a prefix-cache hit, and greedy tokens through the Engine (tests/family_harness.py); no
vision weight is loaded, and a weight update by the checkpoint's own names lands.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig,
                          PixtralVisionConfig)

from ksana_llm.models.llama import MistralForCausalLM as OurMistral
from tests.family_harness import check_family, load_ours

VOCAB = 256


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    text = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=VOCAB + 4, max_position_embeddings=256, sliding_window=12,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, head_dim=16, image_size=28,
                                 patch_size=14)
    torch.manual_seed(0)
    hf = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=VOCAB + 1)).eval()
    hf.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in stored)
    ours = load_ours(tmp_path)
    assert isinstance(ours, OurMistral) and ours.sliding_window == 12
    assert not any("vision" in name or "projector" in name for name, _ in ours.named_parameters())

    def reference(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids])).logits[0].float()

    check_family(ours, tmp_path, reference, vocab=VOCAB)
    # A weight update by the checkpoint's names (an RL trainer's push) reaches the same weight.
    name = "language_model.model.layers.1.mlp.down_proj.weight"
    ours.load_weights([(name, torch.zeros_like(stored[name]))], require_all=False)
    assert torch.count_nonzero(ours.model.layers[1].mlp.down_proj.weight) == 0
