"""The grouped MoE matmul (kernels/fused_moe.py) against its torch reference, and `FusedExperts`'
Triton path against its per-expert torch path: routings uniform, skewed onto one expert and of
one token; block sizes 16-64; ragged N and K; dense and quantized experts (FP8 block / per-row
scales, int8 codes in groups, with zero points, packed 4-bit codes, GPTQ's activation order,
W8A8); in the interpreter on CPU (fp32, fp16), natively
with bf16 too on a GPU (benchmarks/gpu/run.sh tests). Also: the routing tensors' shapes depend
on the batch's size alone, and nothing in the Triton path reads a device value back to the host
(what lets a decode step with MoE layers be captured in a CUDA graph).
"""

from __future__ import annotations

from tests.kernel_harness import DEVICE, DTYPES, assert_close, dtype_id  # noqa: I001 (sets TRITON_INTERPRET first)

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ksana_llm.kernels import align_to_experts, expert_block_size, expert_matmul
from ksana_llm.kernels.fused_moe import expert_block_capacity
from ksana_llm.kernels.reference import expert_matmul_ref
from ksana_llm.layers.fused_kernels import use_fused_kernels
from ksana_llm.layers.moe import FusedExperts
from ksana_llm.layers.moe_routers import Routing, SoftmaxTopKRouter
from ksana_llm.loader.mxfp4 import mxfp4_weight
from ksana_llm.loader.quantized_weight import int4_weight, int8_weight, quantize_fp8_rows
from ksana_llm.loader.weight_quant import quantize_fp8


def routing_of(kind: str, tokens: int, top_k: int, experts: int, seed: int = 0) -> torch.Tensor:
    """[tokens, top_k] distinct expert ids per token: spread at random, or piled onto the
    first top_k experts (one expert then holds every token: the longest run)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "skewed":
        return torch.arange(top_k).repeat(tokens, 1)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


class HostReadGuard(TorchFunctionMode):
    """Raises on every torch call that hands a device value to Python or sizes an output from
    the data: what a CUDA graph cannot capture."""

    FORBIDDEN = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                 torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
                 torch.Tensor.nonzero, torch.nonzero, torch.Tensor.bincount, torch.bincount,
                 torch.Tensor.unique, torch.unique, torch.masked_select,
                 torch.Tensor.masked_select, torch.Tensor.cpu, torch.Tensor.numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise RuntimeError(f"host read: {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))


# ---- routing into blocks ---------------------------------------------------------------------
@pytest.mark.parametrize("kind,tokens,top_k,experts,block_m", [
    ("spread", 37, 2, 8, 16), ("spread", 5, 4, 60, 16), ("skewed", 50, 2, 8, 16),
    ("spread", 300, 8, 16, 64), ("skewed", 1, 1, 4, 32), ("spread", 3, 3, 3, 1)])
def test_blocks_hold_each_assignment_once_in_one_expert_runs(kind, tokens, top_k, experts,
                                                             block_m):
    routing = routing_of(kind, tokens, top_k, experts)
    blocks = align_to_experts(routing, experts, block_m)
    n = tokens * top_k
    ids, owners = blocks.assignment_ids.long(), blocks.block_experts.long()
    assert blocks.num_assignments == n and blocks.block_m == block_m
    assert ids.numel() == expert_block_capacity(n, experts, block_m) == owners.numel() * block_m
    real = ids[ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every assignment exactly once
    flat = routing.reshape(-1)
    rows = ids.view(-1, block_m)
    for b, owner in enumerate(owners.tolist()):
        mine = rows[b][rows[b] < n]
        if owner < 0:  # unused blocks hold padding only, and come after the used ones
            assert mine.numel() == 0 and (owners[b:] < 0).all()
            continue
        assert (flat[mine] == owner).all()  # a block belongs to one expert
        assert mine.tolist() == sorted(mine.tolist())  # in token order
    used = (owners >= 0).sum().item()
    counts = torch.bincount(flat, minlength=experts)
    assert used == int((-(-counts // block_m)).sum())  # each run padded to whole blocks only


def test_block_shapes_depend_on_the_batch_size_alone():
    shapes = {tuple(t.shape for t in align_to_experts(routing_of(kind, 24, 2, 16, seed), 16, 16)[:2])
              for kind in ("spread", "skewed") for seed in range(3)}
    assert len(shapes) == 1


def test_routing_into_blocks_reads_nothing_back():
    routing = routing_of("spread", 12, 2, 8).to(DEVICE)
    with HostReadGuard():
        align_to_experts(routing, 8, 16)
    with pytest.raises(RuntimeError, match="host read"):  # the guard does catch a read
        with HostReadGuard():
            torch.bincount(routing.reshape(-1)).tolist()


def test_block_size_follows_rows_per_expert():
    assert [expert_block_size(n, 64) for n in (8, 1024, 2048, 4096, 1 << 20)] == [16, 16, 32, 64, 64]
    assert expert_block_size(8, 0) == 16


# ---- the grouped matmul ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind,tokens,top_k,experts,n,k", [
    ("spread", 9, 2, 8, 48, 64), ("skewed", 40, 2, 6, 100, 72), ("spread", 1, 4, 16, 64, 40),
    ("spread", 70, 4, 4, 130, 96)])
def test_expert_matmul_matches_reference(dtype, kind, tokens, top_k, experts, n, k):
    gen = torch.Generator().manual_seed(tokens)
    routing = routing_of(kind, tokens, top_k, experts).to(DEVICE)
    x = torch.randn(tokens, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(experts, n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    block_m = expert_block_size(tokens * top_k, experts)
    blocks = align_to_experts(routing, experts, block_m)
    # the tokens' rows feed every k (gate/up), then one row per assignment (down)
    assert_close(expert_matmul(x, weight, blocks, top_k),
                 expert_matmul_ref(x, weight, routing, top_k), dtype)
    per_assignment = torch.randn(tokens * top_k, k, generator=gen).to(DEVICE, dtype)
    assert_close(expert_matmul(per_assignment, weight, blocks, 1),
                 expert_matmul_ref(per_assignment, weight, routing, 1), dtype)


def quantized_stack(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, int,
                                                                torch.Tensor | None]:
    """(values, scales [E, N, groups], group size, zero points) of a dense [E, N, K] stack, as
    `FusedExperts` holds them: FP8 with 32x32 block scales (FP8 checkpoints' layout, expanded
    per row), FP8 per row (online quantization), int8 codes in groups of 32, asymmetric int8
    codes with zero points (GPTQ / compressed-tensors integer checkpoints)."""
    experts, n, k = weight.shape
    if layout == "fp8-block32":
        pairs = [quantize_fp8(w, (32, 32)) for w in weight]
        scales = torch.stack([s.repeat_interleave(32, 0)[:n] for _, s in pairs])
        return torch.stack([d for d, _ in pairs]), scales, 32, None
    if layout == "fp8-per-row":
        rows = [quantize_fp8_rows(w) for w in weight]
        return torch.stack([r.data for r in rows]), torch.stack([r.scale for r in rows]), k, None
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-128, 128, (experts, n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(experts, n, k // 32, generator=gen) * 0.01 + 0.001
    if layout == "int8-g32":
        return codes, scales, 32, None
    if layout == "int8-g32-zero":
        zeros = torch.randint(-20, 20, scales.shape, generator=gen, dtype=torch.int16)
        return codes, scales, 32, zeros
    # packed 4-bit codes with zero points, in groups of 32 or one group per row; or MXFP4's
    # e2m1 codes with power-of-two scales in blocks of 32, E8M0 bytes (no zero points)
    nibbles = torch.randint(0, 16, (experts, n, k), generator=gen, dtype=torch.uint8)
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    if layout == "mxfp4":
        exponents = torch.randint(127 - 9, 127 - 4, (experts, n, k // 32), generator=gen)
        return packed, exponents.to(torch.uint8), 32, None
    group = 32 if layout == "int4-g32" else k
    scales = torch.rand(experts, n, k // group, generator=gen) * 0.05 + 0.01
    zeros = torch.randint(0, 16, scales.shape, generator=gen, dtype=torch.int8)
    return packed, scales, group, zeros


QUANTIZED_LAYOUTS = ["fp8-block32", "fp8-per-row", "int8-g32", "int8-g32-zero", "int4-g32",
                     "int4-per-row", "mxfp4"]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", QUANTIZED_LAYOUTS)
@pytest.mark.parametrize("tokens,top_k,experts,ordered", [(3, 2, 8, False), (40, 2, 4, False),
                                                           (7, 2, 4, True)])
def test_expert_matmul_on_quantized_experts_matches_reference(dtype, layout, tokens, top_k,
                                                              experts, ordered):
    """8-bit and packed 4-bit experts; `ordered`: each expert in its own activation order."""
    gen = torch.Generator().manual_seed(tokens)
    n, k = 80, 96
    values, scales, group, zeros = quantized_stack(
        torch.randn(experts, n, k, generator=gen) / k ** 0.5, layout)
    values, scales = values.to(DEVICE), scales.to(DEVICE)
    zeros = zeros.to(DEVICE) if zeros is not None else None
    order = torch.stack([torch.randperm(k, generator=gen) for _ in range(experts)]).to(DEVICE) \
        if ordered else None
    routing = routing_of("spread", tokens, top_k, experts).to(DEVICE)
    blocks = align_to_experts(routing, experts, expert_block_size(tokens * top_k, experts))
    x = torch.randn(tokens, k, generator=gen).to(DEVICE, dtype)
    fp4 = {"fp4": layout == "mxfp4"}
    actual = expert_matmul(x, values, blocks, top_k, scales, group, zeros, order, **fp4)
    assert_close(actual, expert_matmul_ref(x, values, routing, top_k, scales, group, zeros, order,
                                           **fp4), dtype)
    if ordered:  # the order matters: without it the numbers differ
        unordered = expert_matmul_ref(x, values, routing, top_k, scales, group, zeros, **fp4)
        assert (actual.float() - unordered.float()).abs().max() > 0.1


def test_expert_matmul_rejects_mismatched_inputs():
    routing = routing_of("spread", 4, 2, 4)
    blocks = align_to_experts(routing, 4, 16)
    weight = torch.randn(4, 32, 16)
    with pytest.raises(ValueError, match=r"weight \[experts, N, K\]"):
        expert_matmul(torch.randn(4, 8), weight, blocks, 2)
    with pytest.raises(ValueError, match="a's dtype"):
        expert_matmul(torch.randn(4, 16, dtype=torch.float16), weight, blocks, 2)
    with pytest.raises(ValueError, match="a's dtype"):  # 8-bit values without their scales
        expert_matmul(torch.randn(4, 16), weight.to(torch.int8), blocks, 2)
    with pytest.raises(ValueError, match=r"scale: expected \[experts, N, groups\]"):
        expert_matmul(torch.randn(4, 16), weight.to(torch.int8), blocks, 2,
                      torch.ones(4, 16, 1), 16)
    with pytest.raises(ValueError, match="group_size 24"):
        expert_matmul(torch.randn(4, 48), torch.zeros(4, 32, 48, dtype=torch.int8), blocks, 2,
                      torch.ones(4, 32, 2), 24)
    packed = torch.zeros(4, 32, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="zero_point: packed"):
        expert_matmul(torch.randn(4, 16), packed, blocks, 2, torch.ones(4, 32, 1), 16)
    exponents = torch.full((4, 32, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fp4: packed codes"):  # e2m1 codes: no zero points
        expert_matmul(torch.randn(4, 16), packed, blocks, 2, exponents, 16,
                      torch.zeros(4, 32, 1, dtype=torch.int8), fp4=True)
    with pytest.raises(ValueError, match="fp4: packed codes"):
        expert_matmul(torch.randn(4, 16), weight.to(torch.int8), blocks, 2, exponents, 16,
                      fp4=True)
    with pytest.raises(ValueError, match="E8M0 scales"):  # float scales are not exponent bytes
        expert_matmul(torch.randn(4, 16), packed, blocks, 2, torch.ones(4, 32, 1), 16, fp4=True)
    with pytest.raises(ValueError, match="input_order"):
        expert_matmul(torch.randn(4, 16), weight, blocks, 2, input_order=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="assignments"):
        expert_matmul(torch.randn(3, 16), weight, blocks, 2)
    with pytest.raises(ValueError, match="experts"):
        align_to_experts(routing.reshape(-1), 4, 16)


# ---- FusedExperts: the Triton path computes what the per-expert path computes ----------------
def make_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 seed: int = 0) -> FusedExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) / hidden ** 0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) / inter ** 0.5)
    return experts.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens", [1, 6, 33])
def test_fused_experts_triton_path_equals_per_expert_path(dtype, tokens):
    experts = make_experts(8, 64, 48, dtype)
    router = SoftmaxTopKRouter(64, 8, 2, renormalize=True).to(DEVICE, dtype)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
        routing = router(x)
        assert experts.syncs_with_host(False) and not experts.syncs_with_host(True)
        expected = experts(x, routing)
        with use_fused_kernels(True):
            actual = experts(x, routing)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)
    if tokens == 33:  # a skewed routing too: every token through the same two experts
        skewed = Routing(routing.weights, routing_of("skewed", tokens, 2, 8).to(DEVICE))
        expected = experts(x, skewed)
        with torch.no_grad(), use_fused_kernels(True):
            assert_close(experts(x, skewed), expected, dtype)


def test_fused_experts_triton_path_reads_nothing_back():
    experts = make_experts(8, 32, 16, torch.float32)
    x = torch.randn(5, 32, device=DEVICE)
    routing = Routing(torch.rand(5, 2, device=DEVICE), routing_of("spread", 5, 2, 8).to(DEVICE))
    with torch.no_grad(), HostReadGuard(), use_fused_kernels(True):
        experts(x, routing)
    # the per-expert path (outside the fused-kernel context) reads its expert counts back
    with pytest.raises(RuntimeError, match="host read"), torch.no_grad(), HostReadGuard():
        experts(x, routing)


def spread_batch(tokens: int, hidden: int, num_experts: int, seed: int
                 ) -> tuple[torch.Tensor, Routing]:
    """Random hidden states and a top-2 routing spread over the experts, with random weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    return x, Routing(torch.rand(tokens, 2, generator=gen).to(DEVICE),
                      routing_of("spread", tokens, 2, num_experts).to(DEVICE))


def load_experts(method: str, num: int, hidden: int, inter: int, seed: int = 5) -> FusedExperts:
    """Experts loaded as a checkpoint's per-expert tensors: "fp8" / "w8a8_int8" (online
    quantization: FP8 per row; int8 per row with int8 activations), "int8-zero" (asymmetric
    int8 codes in groups of 32, an integer checkpoint's), "int4" / "int4-act-order" (packed
    4-bit codes in groups of 32, GPTQ's, the latter in activation order: gate and up of an
    expert share one order, as GPTQ derives it from their common input), "mxfp4" (packed e2m1
    codes in blocks of 32, GPT-OSS's)."""
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(num, hidden, inter)
    if method in ("fp8", "w8a8_int8"):
        experts.online_quantization = method
    for e in range(num):
        orders = {size: torch.randperm(size, generator=gen) for size in (hidden, inter)}
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                            ("down", (hidden, inter))):
            weight = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            groups = (shape[0], shape[1] // 32)
            if method == "int8-zero":
                weight = int8_weight(torch.randint(0, 256, shape, generator=gen),
                                     torch.randint(100, 156, groups, generator=gen),
                                     torch.rand(groups, generator=gen) * 0.01, 32)
            elif method == "mxfp4":
                weight = mxfp4_weight(
                    torch.randint(0, 256, (shape[0], shape[1] // 32, 16), generator=gen,
                                  dtype=torch.uint8),
                    torch.randint(120, 125, groups, generator=gen, dtype=torch.uint8))
            elif method.startswith("int4"):
                weight = int4_weight(torch.randint(0, 16, shape, generator=gen),
                                     torch.randint(0, 17, groups, generator=gen),
                                     torch.rand(groups, generator=gen) * 0.05, 32,
                                     orders[shape[1]] if method == "int4-act-order" else None)
            experts.load_checkpoint_tensor(f"{e}.{part}_proj.weight", weight)
    return experts.to(DEVICE)


@pytest.mark.parametrize("method", ["fp8", "w8a8_int8", "int8-zero", "int4", "int4-act-order",
                                    "mxfp4"])
def test_quantized_experts_take_the_grouped_path_too(method):
    """Quantized experts as each kind of checkpoint or online quantization loads them run
    grouped with no host read, computing what their per-expert path computes."""
    experts = load_experts(method, 4, 64, 32)
    expected_dtype = {"fp8": torch.float8_e4m3fn, "int4": torch.uint8,
                      "int4-act-order": torch.uint8, "mxfp4": torch.uint8}.get(method, torch.int8)
    assert experts.w13.dtype == expected_dtype == experts.w2.dtype
    assert experts.fp4 == {"w13": method == "mxfp4", "w2": method == "mxfp4"}
    # MXFP4's scales stay the checkpoint's E8M0 bytes (a quarter of float32's memory)
    expected_scale = torch.uint8 if method == "mxfp4" else torch.float32
    assert experts.w13_scale.dtype == expected_scale == experts.w2_scale.dtype
    assert (experts.w13_input_order is not None) == (method == "int4-act-order")
    assert experts.int8_activations["w13"] == (method == "w8a8_int8")
    x, routing = spread_batch(9, 64, 4, seed=6)
    with torch.no_grad():
        expected = experts(x, routing)
        assert not experts.syncs_with_host(True)
        with HostReadGuard(), use_fused_kernels(True):
            actual = experts(x, routing)
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, atol=2e-5 * scale, rtol=1e-4)


def test_experts_in_groups_the_tiles_do_not_divide_keep_the_per_expert_path():
    experts = load_experts("int8-zero", 2, 64, 32)
    assert not experts.syncs_with_host(True)
    experts.group_sizes["w13"] = 24  # no 16-wide tile lies in one such group (w13: 2 groups)
    assert experts.syncs_with_host(True)


def test_moe_benchmark_case_runs_here(monkeypatch):
    """benchmarks/gpu/run.sh moe's case, at a tiny shape; on CPU its CUDA timer (triton's
    do_bench) is replaced by a wall clock, the one part that cannot run here, and it runs in
    fp16 (the interpreter computes bf16 wrongly: numpy has no bfloat16)."""
    import time

    from benchmarks.gpu import bench_moe

    if DEVICE == "cpu":
        def wall_ms(fn):
            start = time.perf_counter()
            fn()
            return {"ms": (time.perf_counter() - start) * 1e3, "ms_graph": None}

        monkeypatch.setattr(bench_moe, "time_ms", wall_ms)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    for quantization in bench_moe.QUANTIZATIONS:
        row = bench_moe.bench_moe_case("tiny", 8, 2, 32, 32, 5, device=DEVICE, dtype=dtype,
                                       quantization=quantization)
        assert 2 <= row["active_experts"] <= 8 and row["speedup_vs_per_expert"] > 0
        assert row["weights"] == (quantization or str(dtype).removeprefix("torch."))
        assert row["max_abs_err"] < 0.02  # both paths round each expert's output alike
