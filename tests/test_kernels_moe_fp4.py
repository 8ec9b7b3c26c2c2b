"""MXFP4 (e2m1 codes, E8M0 scale bytes) in the MoE experts: the grouped kernel's decoding of
every scale byte against the reference, and `FusedExperts`' FP4 stacks taking later dense
tensors (a weight update) as MXFP4 by the OCP rule, or turning dense for other formats. In the
interpreter on CPU, natively on a GPU (benchmarks/gpu/run.sh tests)."""

from __future__ import annotations

from tests.kernel_harness import DEVICE  # noqa: I001 (sets TRITON_INTERPRET first)

import pytest
import torch

from ksana_llm.kernels import align_to_experts, expert_block_size, expert_matmul
from ksana_llm.kernels.reference import expert_matmul_ref
from ksana_llm.layers.moe import FusedExperts
from ksana_llm.loader.mxfp4 import mxfp4_weight
from ksana_llm.loader.quantized_weight import int8_weight
from tests.test_kernels_moe import load_experts, routing_of, spread_batch


@pytest.mark.parametrize("k", [96, 32])  # groups of 32, and one group per row
def test_expert_matmul_decodes_every_e8m0_scale_byte(k):
    """The kernel turns scale bytes into powers of two as `weight_quant.e8m0_scales` does, at
    the ends of the range too: 0 is the subnormal 2 ** -127 (not flushed to zero), 254 is
    2 ** 127, 255 is NaN (the outputs it scales come out NaN, the others finite)."""
    gen = torch.Generator().manual_seed(k)
    experts, n, tokens, top_k = 2, 48, 5, 2
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    exponents = torch.randint(100, 150, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    exponents[0, 0], exponents[0, 1] = 0, 1  # every group of rows 0 and 1: subnormal scales
    exponents[1, 2, 0] = 255
    exponents[1, 3] = 254  # 2 ** 127, on codes of 0.5 in its first two columns only: finite
    codes[1, 3] = 0
    codes[1, 3, 0] = 0x11
    x = torch.randn(tokens, k, generator=gen).to(DEVICE)
    routing = routing_of("spread", tokens, top_k, experts).to(DEVICE)
    blocks = align_to_experts(routing, experts, expert_block_size(tokens * top_k, experts))
    codes, exponents = codes.to(DEVICE), exponents.to(DEVICE)
    actual = expert_matmul(x, codes, blocks, top_k, exponents, 32, fp4=True)
    expected = expert_matmul_ref(x, codes, routing, top_k, exponents, 32, fp4=True)
    on_expert_1 = routing.reshape(-1) == 1
    assert on_expert_1.any() and (~on_expert_1).any()
    assert actual[on_expert_1, 2].isnan().all() and not actual[~on_expert_1].isnan().any()
    assert actual[on_expert_1, 3].abs().min() > 2.0 ** 120 and actual.isfinite()[:, 3].all()
    tiny = actual[~on_expert_1, :2]
    assert (tiny != 0).all() and tiny.abs().max() < 2.0 ** -110
    # scaled up by 2 ** 127 (exact), the subnormal outputs compare as ordinary numbers
    torch.testing.assert_close(actual[:, :2] * 2.0 ** 127, expected[:, :2] * 2.0 ** 127,
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3, equal_nan=True)


def nearest_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """The OCP rule written out: a block's scale 2 ** (floor(log2(largest)) - 2), each value
    the nearest of the scaled e2m1 grid (6 at most; no ties in random data)."""
    blocks = weight.reshape(weight.shape[0], -1, 32)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - 2)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=weight.device)
    nearest = grid[(blocks.abs() / scale).unsqueeze(-1).sub(grid).abs().argmin(-1)]
    return (nearest * blocks.sign() * scale).reshape(weight.shape)


def test_fp4_experts_take_dense_tensors_as_mxfp4_and_turn_dense_for_other_formats():
    """A dense tensor after MXFP4 ones (a bf16 weight update) is quantized to MXFP4 as it loads:
    the stack keeps its format, and an expert's own values come back exactly. A tensor in
    another quantized format turns the stack dense: the FP4 experts already stored keep their
    values, decoded as e2m1, not as integers."""
    experts = load_experts("mxfp4", 2, 64, 32)
    x, routing = spread_batch(5, 64, 2, seed=3)

    def held(expert: int) -> torch.Tensor:  # the values expert's down_proj holds [64, 32]
        return experts._expert_matmul(torch.eye(32, device=DEVICE), "w2", expert).T

    with torch.no_grad():
        before = experts(x, routing)
        down = torch.stack([held(e) for e in range(2)])
        experts.load_checkpoint_tensor("1.down_proj.weight", down[1].cpu())
        assert experts.w2.dtype == torch.uint8 and experts.fp4["w2"]
        assert torch.equal(held(1), down[1])  # MXFP4 values quantize to themselves
        scaled = down[0] * 1.3  # no MXFP4 numbers: each rounded to the nearest on its grid
        experts.load_checkpoint_tensor("0.down_proj.weight", scaled.cpu())
        assert torch.equal(held(0), nearest_mxfp4(scaled))
        experts.load_checkpoint_tensor("0.down_proj.weight", down[0].cpu())
        gen = torch.Generator().manual_seed(4)
        other_format = int8_weight(torch.randint(0, 256, (64, 32), generator=gen),
                                   torch.full((64, 1), 128), torch.rand(64, 1, generator=gen) / 99,
                                   32)
        experts.load_checkpoint_tensor("1.down_proj.weight", other_format)
        assert experts.w2.dtype == torch.float32 and experts.w2_scale is None
        assert not experts.fp4["w2"] and experts.fp4["w13"]
        experts.load_checkpoint_tensor("1.down_proj.weight", down[1].cpu())
        torch.testing.assert_close(experts(x, routing), before)


def test_only_an_fp4_stack_quantizes_dense_tensors_to_mxfp4():
    """MXFP4 gate/up with a dense down_proj (loaded after them): the dense stack stays exact,
    and so does a later dense update of it; the FP4 stack still takes dense tensors as MXFP4."""
    gen = torch.Generator().manual_seed(9)
    experts = FusedExperts(2, 64, 64)
    downs = [torch.randn(64, 64, generator=gen) for _ in range(2)]
    for e in range(2):
        for part in ("gate", "up"):
            experts.load_checkpoint_tensor(f"{e}.{part}_proj.weight", mxfp4_weight(
                torch.randint(0, 256, (64, 2, 16), dtype=torch.uint8, generator=gen),
                torch.randint(120, 125, (64, 2), dtype=torch.uint8, generator=gen)))
        experts.load_checkpoint_tensor(f"{e}.down_proj.weight", downs[e])
    assert experts.fp4 == {"w13": True, "w2": False} and experts.w2.dtype == torch.float32
    assert torch.equal(experts.w2[1], downs[1])
    experts.load_checkpoint_tensor("1.down_proj.weight", downs[0])
    assert torch.equal(experts.w2[1], downs[0])
    experts.load_checkpoint_tensor("0.gate_proj.weight", downs[0])
    assert experts.w13.dtype == torch.uint8 and experts.fp4["w13"]
