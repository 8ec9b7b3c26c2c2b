"""LG EXAONE 4.0 (`Exaone4ForCausalLM`) end to end against transformers (fp32).

Tiny random models saved by transformers, norm weights drawn away from 1: the 32B's kind (a
windowed layer of 8 tokens, outrun by the 40-token prompts, which rotates, and a full layer,
which takes no positions) and the 1.2B's (no window, every layer rotates). Both normalise q and
k per head and each block's output after it (OLMo 2's layout): logits at prefill (whole and
chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens through the Engine
(tests/family_harness.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Exaone4Config, Exaone4ForCausalLM

from ksana_llm.layers.norm import RMSNorm
from ksana_llm.models.olmo2 import Exaone4ForCausalLM as OurExaone4
from tests.family_harness import check_family, hf_reference, load_ours, spread_weights

VOCAB = 256
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "hybrid": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                   tie_word_embeddings=False),
    "full": dict(sliding_window=None, layer_types=["full_attention"] * 2,
                 tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_matches_transformers(tmp_path, name):
    torch.manual_seed(0)
    hf = spread_weights(Exaone4ForCausalLM(Exaone4Config(**SHAPE, **CONFIGS[name])), qk_std=0.3)
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    assert isinstance(ours, OurExaone4)
    expected = [True, False] if name == "hybrid" else [True, True]
    assert [layer.rotates for layer in ours.model.layers] == expected
    # transformers' EXAONE 4 norms round before the weight multiply, as Llama's (unlike OLMo 2's)
    assert not any(m.weight_in_float32 for m in ours.modules() if isinstance(m, RMSNorm))
    check_family(ours, tmp_path, hf_reference(hf), vocab=VOCAB)
