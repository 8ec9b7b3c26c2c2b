"""FP8 checkpoints in the hub's layout (DeepSeek V3 / Qwen3-FP8 / transformers' FineGrainedFP8),
written from a full-precision folder, for tests that load them with ksana-llm and transformers.

transformers only quantizes on a GPU, so the tests write the checkpoint themselves (with
`kernels.weight_quant.quantize_fp8`, which is also what online quantization uses); transformers
reads it back on its own (its dequantizing CPU path), which is the independent check of the
format.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ksana_llm.kernels.weight_quant import quantize_fp8

# The projections transformers' FP8 loader replaces with FP8Linear: every nn.Linear inside the
# decoder layers (attention, MLP, MLA, per-expert MLPs), not the router gate, embeddings, norms
# or the LM head.
QUANTIZED = re.compile(r"model\.layers\.\d+\..*(?:_proj|_proj_with_mqa|\.w[123])\.weight$")


def write_fp8_checkpoint(source: Path, target: Path,
                         block_size: tuple[int, int] | None = (16, 16)) -> Path:
    """`target` = `source` with every decoder projection stored as FP8 + `weight_scale_inv`
    (one scale per block, or per tensor with `block_size` None) and the config saying so."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, target / item.name)
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if QUANTIZED.match(name) and tensor.dim() == 2:
            data, scale = quantize_fp8(tensor, block_size)
            out[name] = data
            out[name.removesuffix("weight") + "weight_scale_inv"] = \
                scale.reshape(()) if block_size is None else scale
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3"}
    if block_size is not None:
        config["quantization_config"]["weight_block_size"] = list(block_size)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
