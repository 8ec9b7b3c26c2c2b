"""Activations quantized to int8 on the fly, one scale per token: what llm-compressor's W8A8
checkpoints ask for (int8 weights whose `input_activations` are {int, 8 bits, symmetric,
dynamic, strategy "token"}), so a projection multiplies the same numbers the checkpoint was
calibrated and evaluated with.

The numbers are compressed-tensors' own (`loader.weight_quant.quantize_int8_rows`, which
quantizes W8A8's weights too): a token's scale is its largest magnitude over 127.5 (int8's 255
steps halved), and its codes are round(x / scale) clamped to [-128, 127]. They are computed in
float32 whatever the model's dtype (the library divides in the model's dtype).
"""

from __future__ import annotations

import torch

from ksana_llm.loader.weight_quant import INT_WEIGHT_DTYPE, quantize_int8_rows


def token_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each token's (row's) largest magnitude, float32 [..., 1]: what its scale comes from.
    A row-parallel projection, which sees a slice of each token, takes the maximum over the
    ranks' values so that every rank quantizes with the scale the whole token has."""
    return x.detach().abs().amax(dim=-1, keepdim=True).float()


def quantize_tokens(x: torch.Tensor, absmax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 codes (x's shape) and float32 scales ([..., 1]), from `absmax` when given (see
    `token_absmax`)."""
    return quantize_int8_rows(x, absmax)


def dequantize_tokens(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                      ) -> torch.Tensor:
    """The activations the codes stand for, in `dtype`: for the quantized-weight paths that
    take activations in the model's dtype (group scales, zero points, FP8, the GPU kernels)."""
    return (codes.float() * scale).to(dtype)


def int8_codes_matmul(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """Activation codes [..., K] (scales [..., 1]) times int8 weight codes [N, K] with one
    float32 scale per row ([N, 1]): int32 sums of the codes' products (exact: 2^14 per term,
    below 2^31 up to 131,072 inputs) scaled once per output. The matmul that makes W8A8 fast
    where torch has it (on a CPU it reads a byte per weight and skips dequantization)."""
    leading = codes.shape[:-1]
    sums = torch._int_mm(codes.reshape(-1, codes.shape[-1]), weight.t())
    out = sums.float().mul_(scale.reshape(-1, 1)).mul_(weight_scale.reshape(1, -1)).to(dtype)
    if bias is not None:
        out += bias
    return out.reshape(*leading, weight.shape[0])


def int8_matmul_runs(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     zero_point: torch.Tensor | None) -> bool:
    """Whether `int8_codes_matmul` takes this product: int8 codes without zero points, one scale
    per row, on a CPU. On a GPU (`torch._int_mm` there needs more than 16 rows and sizes in
    multiples of 8, and has not been measured here) the activations are dequantized into the
    W8A16 paths instead, which gives the same numbers."""
    return (x.device.type == "cpu" and weight.dtype == INT_WEIGHT_DTYPE and zero_point is None
            and weight_scale.shape[-1] == 1)
