"""Per-layer scales for an E4M3 KV cache, measured on the model itself: `kv_cache_scales.json`.

The engine computes each calibration prompt with a cache of the model's own dtype and hands its
K/V back (`Request(export_kv=True)`, the prefill/decode transfer path), so every model family is
covered, MLA latents included. A layer's scale is max |K, V| over all prompts divided by
`CALIBRATION_TARGET`: the largest value seen lands at half of E4M3's range (448), leaving the
other half for larger values in real traffic. FP8 is floating point, so the headroom costs almost
no precision: only values below 2**-6 of the target (after scaling) become subnormal.

    ksana-llm calibrate-kv-scales --model DIR            # writes DIR/kv_cache_scales.json
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ksana_llm.api.engine import Engine
from ksana_llm.api.model import Model
from ksana_llm.api.outputs import Request
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.loader.kv_scales import KV_SCALES_FILENAME

CALIBRATION_TARGET = 224.0  # half of E4M3's largest finite value

# Used when no text is given: prose, code, numbers and Chinese, so that the K/V of the usual
# kinds of tokens are all seen.
DEFAULT_CALIBRATION_TEXTS = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion about maintenance costs, the members agreed to postpone the new library wing "
    "and to spend the savings on repairing the roads near the school.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Quarterly revenue: Q1 1,204.5; Q2 1,387.2; Q3 1,512.9; Q4 1,698.0 (in thousands of "
    "dollars). Growth from Q1 to Q4 was 40.97%, and the median quarter was 1,450.05.",
    "人工智能正在改变医疗、教育和交通等多个领域。研究人员希望在提高效率的同时，确保系统的安全与公平。",
    "User: Can you explain why the sky is blue?\nAssistant: Sunlight is scattered by the "
    "molecules of the air, and blue light, with its shorter wavelength, is scattered the most.",
)


def calibrate_kv_scales(model: Model | Engine, texts: Sequence[str | list[int]] | None = None,
                        ) -> list[float]:
    """One scale per decoder layer: max |K, V| over the prompts' tokens / CALIBRATION_TARGET.
    `texts`: strings or token-id lists (default: `DEFAULT_CALIBRATION_TEXTS`). `model` may be a
    loaded `Model` (a temporary engine with a cache of the model's dtype is made) or an `Engine`
    whose cache is not FP8."""
    texts = list(DEFAULT_CALIBRATION_TEXTS if texts is None else texts)
    if not texts:
        raise ValueError("texts: give at least one calibration prompt")
    if isinstance(model, Engine):
        return _measure(model, texts)
    with Engine(model, enable_prefix_caching=False) as engine:
        return _measure(engine, texts)


def _measure(engine: Engine, texts: list[str | list[int]]) -> list[float]:
    if engine.kv_layout.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("calibrate with an engine whose KV cache has the model's dtype "
                         "(kv_cache_dtype='auto'): an FP8 cache's values are already rounded")
    num_layers = engine.model.module.num_layers
    amax = [0.0] * num_layers
    one_token = GenerationConfig(max_new_tokens=1, temperature=0)
    for text in texts:
        kv = engine.submit(Request(text, generation_config=one_token, export_kv=True)).result()
        # Tensors come as K, V per layer (the MTP draft layers last: they keep scale 1.0).
        for layer in range(num_layers):
            for tensor in kv.exported_kv.tensors[2 * layer:2 * layer + 2]:
                if tensor.numel():
                    amax[layer] = max(amax[layer], float(tensor.float().abs().max()))
    # A layer that saw only zeros keeps 1.0 rather than a scale of 0.
    return [a / CALIBRATION_TARGET if a > 0 else 1.0 for a in amax]


def write_kv_cache_scales(path: str | os.PathLike[str], scales: Sequence[float], *,
                          model_type: str = "") -> Path:
    """Write `scales` in KsanaLLM's `kv_cache_scales.json` format (tensor-parallel rank "0").
    A folder `path` gets the file inside it."""
    path = Path(path)
    if path.is_dir():
        path = path / KV_SCALES_FILENAME
    data = {"model_type": model_type, "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {str(layer): float(scale) for layer, scale in enumerate(scales)}}}}
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path
