"""The grouped MoE matmul (kernels/fused_moe.py) against its torch reference, and `FusedExperts`'
Triton path against its per-expert torch path: routings uniform, skewed onto one expert and of
one token; block sizes 16-64; ragged N and K; in the interpreter on CPU (fp32, fp16), natively
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
from ksana_llm.layers.moe import FusedExperts
from ksana_llm.layers.moe_routers import Routing, SoftmaxTopKRouter


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


def test_expert_matmul_rejects_mismatched_inputs():
    routing = routing_of("spread", 4, 2, 4)
    blocks = align_to_experts(routing, 4, 16)
    weight = torch.randn(4, 32, 16)
    with pytest.raises(ValueError, match=r"weight \[experts, N, K\]"):
        expert_matmul(torch.randn(4, 8), weight, blocks, 2)
    with pytest.raises(ValueError, match="one floating dtype"):
        expert_matmul(torch.randn(4, 16, dtype=torch.float16), weight, blocks, 2)
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
        assert experts.syncs_with_host
        expected = experts(x, routing)
        experts.use_triton = True
        assert not experts.syncs_with_host
        actual = experts(x, routing)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)
    if tokens == 33:  # a skewed routing too: every token through the same two experts
        skewed = Routing(routing.weights, routing_of("skewed", tokens, 2, 8).to(DEVICE))
        experts.use_triton = False
        expected = experts(x, skewed)
        experts.use_triton = True
        assert_close(experts(x, skewed), expected, dtype)


def test_fused_experts_triton_path_reads_nothing_back():
    experts = make_experts(8, 32, 16, torch.float32)
    x = torch.randn(5, 32, device=DEVICE)
    routing = Routing(torch.rand(5, 2, device=DEVICE), routing_of("spread", 5, 2, 8).to(DEVICE))
    experts.use_triton = True
    with torch.no_grad(), HostReadGuard():
        experts(x, routing)
    experts.use_triton = False  # the per-expert path reads its expert counts back
    with pytest.raises(RuntimeError, match="host read"), torch.no_grad(), HostReadGuard():
        experts(x, routing)


def test_quantized_experts_keep_the_per_expert_path():
    experts = make_experts(4, 32, 16, torch.float32)
    experts.use_triton = True
    experts.w13_scale = torch.ones(4, 32, 1, device=DEVICE)  # as an FP8 / int8 load leaves it
    assert experts.syncs_with_host


def test_moe_benchmark_case_runs_here(monkeypatch):
    """benchmarks/gpu/run.sh moe's case, at a tiny shape; on CPU its CUDA timer (triton's
    do_bench) is replaced by a wall clock, the one part that cannot run here, and it runs in
    fp16 (the interpreter computes bf16 wrongly: numpy has no bfloat16)."""
    import time

    from benchmarks.gpu import bench_kernels

    if DEVICE == "cpu":
        def wall_ms(fn):
            start = time.perf_counter()
            fn()
            return {"ms": (time.perf_counter() - start) * 1e3, "ms_graph": None}

        monkeypatch.setattr(bench_kernels, "time_ms", wall_ms)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    row = bench_kernels.bench_moe_case("tiny", 8, 2, 32, 16, 5, device=DEVICE, dtype=dtype)
    assert 2 <= row["active_experts"] <= 8 and row["speedup_vs_per_expert"] > 0
    assert row["max_abs_err"] < 0.02  # both paths round each expert's output alike
