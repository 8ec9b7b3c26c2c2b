"""Rewrite a saved checkpoint's projections as an llm-compressor W4A16 checkpoint, in pure torch.

The GPU benchmark (`bench_engine.py --int4-weights`) measures the engine on 4-bit weights held
packed (the Triton W4A16 matmul in decode steps) without the compressed-tensors library, which
the GPU machine's image lacks: this writes the same on-disk format the library's
`pack-quantized` compressor writes (symmetric round-to-nearest codes -8..7 stored plus 8, eight
to an int32, the first in the lowest bits; one scale per row and group of inputs;
`weight_shape`), so transformers reads it through the library and our engine through its own
loader. `tests/test_int4_checkpoint_writer.py` checks both read the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The projections llm-compressor quantizes in its W4A16 presets (every Linear but the LM head).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_int4_groups(weight: torch.Tensor, group_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # on the weight's device
    """(codes -8..7 as int8 [rows, cols], float32 scales [rows, groups]): symmetric
    round-to-nearest, each group's largest magnitude mapped to 7.5 (compressed-tensors'
    symmetric int4 range is [-8, 7] with scale = max|w| / ((7 - -8) / 2))."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"{cols} inputs are not whole groups of {group_size}")
    groups = weight.detach().to(torch.float32).view(rows, cols // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 7.5
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / scale[..., None]).clamp(-8, 7).to(torch.int8)
    return codes.view(rows, cols), scale


def pack_int4_words(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [rows, cols] as int32 words [rows, cols / 8]: each stored plus 8, eight
    to a word, the first in the lowest bits (compressed-tensors' `pack_to_int32`)."""
    rows, cols = codes.shape
    if cols % 8:
        raise ValueError(f"{cols} columns are not whole words of 8 codes")
    nibbles = (codes.to(torch.int64) + 8).view(rows, cols // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (nibbles << shifts).sum(dim=-1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def rewrite_as_w4a16(folder: Path, group_size: int = 128, device: str = "cpu") -> int:
    """Replace every projection weight of the safetensors checkpoint in `folder` with its
    W4A16 parts (`weight_packed`, `weight_scale` in the checkpoint's dtype, `weight_shape`) and
    say so in config.json's `quantization_config`; returns how many weights were rewritten.
    The rounding runs on `device` (a GPU rounds Llama-3-8B's 7 B weights in seconds)."""
    rewritten = 0
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            base, _, leaf = name.rpartition(".")
            if leaf != "weight" or base.rpartition(".")[2] not in PROJECTIONS:
                out[name] = tensor
                continue
            codes, scale = quantize_int4_groups(tensor.to(device), group_size)
            out[f"{base}.weight_packed"] = pack_int4_words(codes).cpu()
            out[f"{base}.weight_scale"] = scale.to(tensor.dtype).cpu()
            out[f"{base}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
            rewritten += 1
        save_file(out, path, metadata={"format": "pt"})
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group_size, "dynamic": False, "observer": "minmax"},
            "input_activations": None, "output_activations": None}}}
    config_path.write_text(json.dumps(config, indent=2))
    return rewritten
