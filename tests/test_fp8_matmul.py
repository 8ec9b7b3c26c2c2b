"""The Triton quantized-weight matmul (W8A16, W4A16) against its torch reference: FP8 weights
with block, per-row and per-tensor scales, int8 codes (integer checkpoints) with group scales,
asymmetric int8 codes with zero points, packed 4-bit codes with zero points in groups and per
row, ragged shapes, bias; in the interpreter on CPU (fp32, fp16), natively with bf16 too on a GPU
(benchmarks/gpu/run.sh tests).
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ksana_llm.kernels.reference import fp8_linear_ref  # noqa: E402
from ksana_llm.loader.weight_quant import quantize_fp8  # noqa: E402
from ksana_llm.loader.fp8_weights import quantized_weight_from_checkpoint  # noqa: E402
from ksana_llm.loader.quantized_weight import (QuantizedWeight, int4_weight,  # noqa: E402
                                               int8_weight, quantize_fp8_rows)

DEVICE = "cuda" if ON_GPU else "cpu"


KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 4e-2)}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows, n, k, layout", [
    (1, 64, 128, (16, 16)),    # one decode row, group scales
    (5, 70, 96, (32, 32)),     # N not a tile multiple
    (17, 48, 80, (16, 32)),    # K ends inside a group
    (33, 40, 64, "row"),       # per-row scales (online quantization)
    (3, 32, 48, None),         # one scale per tensor
    (6, 40, 96, "int8-g32"),   # int8 codes in groups of 32 (GPTQ / AWQ / compressed-tensors)
    (18, 24, 72, "int8-g48"),  # K ends inside a group; codes across int8's whole range
    (5, 40, 96, "int8-asym-g32"),  # asymmetric 8-bit: codes - 128 with zero points - 128
    (9, 24, 80, "int8-asym-row"),  # ... one zero point per row
    (1, 40, 128, "int4-g32"),  # packed 4-bit codes, a decode row (AWQ / GPTQ int4)
    (7, 72, 160, "int4-g64"),  # K ends inside a group, N not a tile multiple
    (20, 24, 96, "int4-row"),  # one zero point and scale per row (group_size -1)
])
def test_fp8_matmul_kernel_matches_reference(dtype, rows, n, k, layout):
    from ksana_llm.kernels import fp8_linear

    torch.manual_seed(4)
    weight = torch.randn(n, k)
    if layout == "row":
        fp8 = quantize_fp8_rows(weight)
    elif isinstance(layout, str) and layout.startswith("int4"):  # codes 0..15, zeros 0..16
        group = k if layout == "int4-row" else int(layout.removeprefix("int4-g"))
        groups = -(-k // group)
        fp8 = int4_weight(torch.randint(0, 16, (n, k)), torch.randint(0, 17, (n, groups)),
                          torch.rand(n, groups) / 8, group)
        assert fp8.packed
    elif isinstance(layout, str) and layout.startswith("int8-asym"):  # codes 0..255, zeros 0..256
        group = k if layout == "int8-asym-row" else int(layout.removeprefix("int8-asym-g"))
        groups = -(-k // group)
        fp8 = int8_weight(torch.randint(0, 256, (n, k)), torch.randint(0, 257, (n, groups)),
                          torch.rand(n, groups) / 256, group)
        assert fp8.zero_point is not None and fp8.zero_point.dtype == torch.int16
    elif isinstance(layout, str):  # int8 codes: the whole range, group scales
        group = int(layout.removeprefix("int8-g"))
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        fp8 = QuantizedWeight(codes, torch.rand(n, -(-k // group)) / 64, group)
    else:
        data, scale = quantize_fp8(weight, layout)
        fp8 = quantized_weight_from_checkpoint(data, scale, layout, "w")
    fp8 = fp8.to(DEVICE)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    for b in (None, bias):
        out = fp8_linear(x, fp8.data, fp8.scale, fp8.group_size, b, fp8.zero_point)
        expected = fp8_linear_ref(x.float(), fp8.data, fp8.scale, fp8.group_size,
                                  None if b is None else b.float(), fp8.zero_point)
        assert out.dtype == dtype and out.shape == (rows, n)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.float(), expected, atol=atol * k ** 0.5, rtol=rtol)
    batched = fp8_linear(x.view(1, rows, k), fp8.data, fp8.scale, fp8.group_size,
                         zero_point=fp8.zero_point)
    assert batched.shape == (1, rows, n)


def test_fp8_matmul_kernel_refuses_bad_inputs():
    from ksana_llm.kernels import fp8_linear

    fp8 = quantize_fp8_rows(torch.randn(16, 32)).to(DEVICE)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        fp8_linear(x, fp8.data.float(), fp8.scale, fp8.group_size)
    with pytest.raises(ValueError, match="does not match the weight's 32 columns"):
        fp8_linear(x[:, :16], fp8.data, fp8.scale, fp8.group_size)
    with pytest.raises(ValueError, match="group_size 24"):
        fp8_linear(x, fp8.data, torch.ones(16, 2, device=DEVICE), 24)
    int4 = int4_weight(torch.randint(0, 16, (16, 32)), torch.full((16, 2), 8),
                       torch.ones(16, 2), 16).to(DEVICE)
    with pytest.raises(ValueError, match="zero_point"):
        fp8_linear(x, int4.data, int4.scale, int4.group_size)
    with pytest.raises(ValueError, match="zero_point"):  # FP8 values have no zero points
        fp8_linear(x, fp8.data, fp8.scale, fp8.group_size,
                   zero_point=torch.zeros_like(fp8.scale, dtype=torch.int16))
    with pytest.raises(ValueError, match="group_size 16: the kernel needs a multiple of 32"):
        fp8_linear(x, int4.data, int4.scale, int4.group_size, zero_point=int4.zero_point)
