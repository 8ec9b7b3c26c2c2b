"""The GPU benchmark's pure-torch W4A16 checkpoint writer (benchmarks/gpu/int4_checkpoint.py)
writes what compressed-tensors writes: its packing equals the library's `pack_to_int32`, and
transformers reading the rewritten folder through the library gives the logits and greedy tokens
our engine gives holding the weights packed."""

from __future__ import annotations

import torch

from benchmarks.gpu.int4_checkpoint import (pack_int4_words, quantize_int4_groups,
                                            rewrite_as_w4a16)
from tests.family_harness import check_family, hf_reference, load_ours
from tests.quantized_checkpoints import assert_projections_quantized
from tests.tiny_models import build_tiny_model


def test_packing_equals_the_library():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (6, 64), generator=generator, dtype=torch.int8)
    codes[0, :2] = torch.tensor([-8, 7], dtype=torch.int8)
    assert torch.equal(pack_int4_words(codes), pack_to_int32(codes, 4))


def test_rounding_maps_each_groups_largest_magnitude_to_the_code_range():
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    codes, scale = quantize_int4_groups(weight, 32)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    error = (codes.float().view(4, 2, 32) * scale[..., None]).view(4, 64) - weight
    assert float((error.abs().view(4, 2, 32) - scale[..., None] / 2).max()) <= 1e-6


def test_rewritten_checkpoint_reads_the_same_in_transformers_and_ours(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "w4a16"
    build_tiny_model("llama2", folder)
    assert rewrite_as_w4a16(folder, group_size=32) == 2 * 7  # two layers' projections
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module = load_ours(folder)
    assert_projections_quantized(module, torch.uint8)  # packed: two codes a byte
    check_family(module, folder, hf_reference(reference), vocab=256)
