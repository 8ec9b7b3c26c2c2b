"""CUDA graphs for decode steps and the profiled KV-cache sizing.

On CPU the graph path runs as `capture=False`: the same static buffers, padding and bucketed
forward, eagerly, with the Triton kernels in their interpreter (TRITON_INTERPRET=1). On a CUDA
machine the same test captures and replays real graphs. Either way the logits and the KV cache
must equal those of the normal (eager, unpadded) path step for step.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ksana_llm.api.core_builder import capture_sizes  # noqa: E402
from ksana_llm.config import EngineConfig  # noqa: E402
from ksana_llm.api.model import Model  # noqa: E402
from ksana_llm.engine.kv_cache import BlockManager  # noqa: E402
from ksana_llm.engine.request import Sequence  # noqa: E402
from ksana_llm.generation_config import GenerationConfig  # noqa: E402
from ksana_llm.layers.moe import FusedExperts  # noqa: E402
from ksana_llm.runner.cuda_graphs import (DecodeInputs, choose_bucket,  # noqa: E402
                                          graph_batch_sizes, unsupported_reason)
from ksana_llm.runner.memory import (MemoryProfile, kv_blocks_from_profile,  # noqa: E402
                                     plan_device_blocks, profile_memory, profile_step,
                                     run_profile_step)
from ksana_llm.runner.model_runner import (ModelRunner, SeqSlice, StepInput,  # noqa: E402
                                           kv_bytes_per_block)
from tests.tiny_models import build_tiny_model  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GiB, MiB = 2**30, 2**20


# ---- buckets ------------------------------------------------------------------------------------
def test_graph_batch_sizes_and_bucket_choice():
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in zip(sizes[4:], sizes[5:]))
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(1) == (1,)
    assert [choose_bucket(n, sizes) for n in (1, 3, 5, 8, 9, 17, 250, 256)] == \
        [1, 4, 8, 8, 16, 24, 256, 256]
    assert choose_bucket(257, sizes) is None
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size"):
        graph_batch_sizes(0)


# ---- static buffers -----------------------------------------------------------------------------
def _decode_slices(seed: int, n: int, block_size: int, num_blocks: int) -> list[SeqSlice]:
    """n decode rows with random contexts and block tables scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    slices = []
    for _ in range(n):
        start = int(torch.randint(0, 40, (1,), generator=gen))
        table = torch.randperm(num_blocks, generator=gen)[:start // block_size + 1].tolist()
        slices.append(SeqSlice([int(torch.randint(3, 250, (1,), generator=gen))], start, table, True))
    return sorted(slices, key=lambda s: s.start)  # build() orders decodes this way


def test_static_buffers_hold_the_unpadded_batch_then_padding(tmp_path):
    """Filled for n rows in a larger bucket, the buffers' first n rows equal what the normal
    batch builder makes of the same rows; the padding rows write no slot and read no context."""
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    block_size, num_blocks = 4, 64
    runner = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32,
                         num_blocks=num_blocks, block_size=block_size, attention_backend="triton")
    inputs = DecodeInputs(16, 12, torch.device("cpu"), block_size)
    for seed, n, bucket in ((0, 13, 16), (1, 3, 4), (2, 5, 8)):  # big, then smaller: no stale rows
        slices = _decode_slices(seed, n, block_size, num_blocks)
        ids, positions, meta, _, _ = runner.build(slices)
        inputs.fill([s.token_ids[0] for s in slices], [s.start for s in slices],
                    [s.block_table for s in slices], bucket)
        kb = meta.kernel_batch
        assert inputs.input_ids(bucket)[:n].tolist() == ids.tolist()
        assert inputs.positions(bucket)[:n].tolist() == positions.tolist()
        assert inputs.slots(bucket)[:n].tolist() == meta.slot_mapping.tolist()
        assert inputs.context_lens(bucket)[:n].tolist() == kb.decode_context_lens.tolist()
        for row, s in enumerate(slices):
            used = len(s.block_table)
            assert inputs.block_tables(bucket)[row, :used].tolist() == \
                kb.decode_block_tables[row, :used].tolist()
        assert inputs.slots(bucket)[n:].tolist() == [-1] * (bucket - n)
        assert inputs.context_lens(bucket)[n:].tolist() == [0] * (bucket - n)
        assert inputs.input_ids(bucket)[n:].tolist() == [0] * (bucket - n)
        # The decode kernel takes the rows longest context first, then the padding rows; the
        # same order the eager builder gives its kernel batch.
        order, lens = inputs.order(bucket).tolist(), inputs.context_lens(bucket).tolist()
        assert sorted(order) == list(range(bucket)) and order[n:] == list(range(n, bucket))
        assert [lens[i] for i in order[:n]] == sorted(lens[:n], reverse=True)
        assert order[:n] == kb.decode_order.tolist()
        meta_static = inputs.metadata(bucket, None)
        assert meta_static.num_decodes == bucket
        assert meta_static.kernel_batch.decode_block_tables.shape == (bucket, 12)
    assert not inputs.fits([[0] * 13])  # wider than the buffers: runs eagerly
    assert inputs.fits([[0] * 12] * 16) and not inputs.fits([[0]] * 17)


def test_explicit_graph_sizes_are_the_buckets(tmp_path):
    """cuda_graph_sizes (vLLM's list form): exactly those buckets, the largest sizing the static
    buffers; a batch takes the smallest that holds it, and runs eagerly above the largest."""
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    runner = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32, num_blocks=16,
                         block_size=4, attention_backend="triton")
    runner.setup_cuda_graphs([6, 1, 3, 3], capture=False)
    graphs = runner.decode_graphs
    assert graphs.sizes == (1, 3, 6) and graphs.inputs.max_batch_size == 6
    assert [choose_bucket(n, graphs.sizes) for n in (1, 2, 4, 6, 7)] == [1, 3, 6, 6, None]
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        runner.setup_cuda_graphs([0, 2], capture=False)
    with pytest.raises(ValueError, match="cuda_graph_sizes or cuda_graph_max_batch_size"):
        EngineConfig(cuda_graph_sizes=[1, 2], cuda_graph_max_batch_size=2)
    # What the engine asks its runner for (vLLM's rule): one value is the largest batch, with
    # the default buckets below; several are the sizes; none above max_num_seqs.
    assert capture_sizes(EngineConfig(cuda_graph_sizes=[24])) == 24
    assert graph_batch_sizes(capture_sizes(EngineConfig(cuda_graph_sizes=[24]))) == (
        1, 2, 4, 8, 16, 24)
    assert capture_sizes(EngineConfig(cuda_graph_sizes=[1, 3, 64, 512], max_num_seqs=64)) == \
        [1, 3, 64]
    assert capture_sizes(EngineConfig(cuda_graph_sizes=[512], max_num_seqs=64)) == 64
    assert capture_sizes(EngineConfig(max_num_seqs=32)) == 32
    assert capture_sizes(EngineConfig(cuda_graph_max_batch_size=8)) == 8


# ---- when graphs are used -----------------------------------------------------------------------
def test_graphs_are_skipped_with_the_reason(tmp_path):
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    runner = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32, num_blocks=8,
                         block_size=4, attention_backend="triton")
    assert runner.decode_graphs is None
    assert runner.cuda_graph_status.startswith("off: device is cpu")
    off = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32, num_blocks=8,
                      block_size=4, cuda_graphs=False)
    assert off.decode_graphs is None and "disabled" in off.cuda_graph_status

    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert unsupported_reason(module, cuda, "triton") is None
    assert "triton" in unsupported_reason(module, cuda, "torch")
    moe = torch.nn.ModuleDict({"experts": FusedExperts(4, 8, 16)})
    # on the Triton backend dense experts run grouped (fused kernels), with no host reads
    assert unsupported_reason(moe, cuda, "triton") is None
    # quantized experts in groups no kernel tile divides keep the per-expert path
    moe.experts.w13 = torch.nn.Parameter(torch.zeros(4, 32, 8, dtype=torch.int8),
                                         requires_grad=False)
    moe.experts.w13_scale, moe.experts.group_sizes["w13"] = torch.ones(4, 32, 2), 24
    assert "syncs with the host" in unsupported_reason(moe, cuda, "triton")
    moe.supports_cuda_graphs = True  # a model may vouch for itself
    assert unsupported_reason(moe, cuda, "triton") is None
    module.supports_cuda_graphs = False
    try:
        assert "syncs with the host" in unsupported_reason(module, cuda, "triton")
    finally:
        del module.supports_cuda_graphs
    with pytest.raises(ValueError, match="triton"):
        ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32, num_blocks=8,
                    block_size=4, attention_backend="torch").setup_cuda_graphs(4, capture=False)


# ---- the graph path computes what the eager path computes --------------------------------------
# CPU runs the kernels in Triton's interpreter (slow): fewer models there than on a GPU. Without
# a window the 512-token tables make the decode kernel split each context in two (padding rows
# then go through the split-merge pass too); with mistral's window it takes one split.
# The E4M3 case: the per-layer cache scales must reach the graphs' metadata too (the eager step
# applies them, so a graph step without them would differ).
# The MoE case: its experts take the grouped Triton matmuls, whose routing buffers are sized by
# the bucket, so padding rows route somewhere too and must not disturb the real rows.
# DeepSeek-V3: MLA's latent cache through the same kernels (its store skips padding rows too).
CASES = [("cpu", "yi-gqa4-bias", "auto"), ("cpu", "yi-gqa4-bias", "fp8_e4m3"),
         ("cpu", "qwen3-moe", "auto"), ("cpu", "deepseek-v3", "auto")] + (
    [("cuda", "yi-gqa4-bias", "auto"), ("cuda", "mistral-sliding", "auto"),
     ("cuda", "yi-gqa4-bias", "fp8_e4m3"), ("cuda", "qwen3-moe", "auto"),
     ("cuda", "deepseek-v3", "auto")]
    if torch.cuda.is_available() else [])
FP8_SCALES = (0.002, 0.003)


class GraphDriver:
    """Feeds sequences through one runner that has decode graphs; each decode step runs twice,
    through the graphs and through the normal eager path, which rewrites the same K/V."""

    def __init__(self, module: torch.nn.Module, device: torch.device, max_graph_batch: int,
                 kv_cache_dtype: str = "auto", **runner_kwargs) -> None:
        self.block_size, num_blocks = 4, 128  # 512 tokens: as long as the tiny models' context
        self.bm = BlockManager(num_blocks, self.block_size)
        fp8 = kv_cache_dtype != "auto"
        self.runner = ModelRunner(module, device=device, dtype=torch.float32,
                                  num_blocks=num_blocks, block_size=self.block_size,
                                  attention_backend="triton", cuda_graphs=False,
                                  kv_cache_dtype=kv_cache_dtype,
                                  kv_scales=FP8_SCALES if fp8 else None, **runner_kwargs)
        self.runner.setup_cuda_graphs(max_graph_batch, capture=device.type == "cuda")
        self.graphs = self.runner.decode_graphs

    def _slices(self, work: list[tuple[Sequence, int, bool]]) -> list[SeqSlice]:
        slices = []
        for seq, n, sample in work:
            assert self.bm.allocate(seq, n)
            start = seq.num_computed_tokens
            slices.append(SeqSlice(seq.tokens_slice(start, start + n), start, seq.block_table,
                                   sample, lora_slot=seq.lora_slot))
        return slices

    @staticmethod
    def _in_slice_order(result) -> torch.Tensor:
        # Logits rows follow `sampled`, which each path may order its own way: slice order here.
        return result.logits[torch.tensor(result.sampled).argsort()]

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        slices = self._slices([(s, s.num_tokens, True) for s in seqs])
        result = self.runner.execute(StepInput(slices, [], []))
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
        return self._in_slice_order(result)

    def decode(self, work: list[tuple[Sequence, int, bool]]
               ) -> tuple[torch.Tensor, torch.Tensor, set[int], set[int]]:
        """(graph logits, eager logits, cache slots the graph step changed, the rows' slots)."""
        slices = self._slices(work)
        bs = self.block_size
        slots = {s.block_table[s.start // bs] * bs + s.start % bs for s in slices}
        step = StepInput(slices, [], [])
        def raw(t: torch.Tensor) -> torch.Tensor:  # FP8 entries compare as their bytes
            return t.view(torch.uint8) if t.element_size() == 1 else t

        before = [(raw(k).clone(), raw(v).clone()) for k, v in self.runner.kv_caches]
        graph = self.runner.execute(step)
        changed = set()
        after = [(raw(k), raw(v)) for k, v in self.runner.kv_caches]
        for (k0, v0), (k1, v1) in zip(before, after):
            diff = (k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)  # [blocks, bs]
            changed |= set(diff.flatten().nonzero().flatten().tolist())
        self.runner.decode_graphs = None  # the same step through the normal path
        try:
            eager = self.runner.execute(step)
        finally:
            self.runner.decode_graphs = self.graphs
        for seq, n, _ in work:
            seq.num_computed_tokens += n
        assert sorted(graph.sampled) == sorted(eager.sampled)
        return self._in_slice_order(graph), self._in_slice_order(eager), changed, slots


@pytest.mark.parametrize("device,name,kv_cache_dtype", CASES)
def test_graph_decode_equals_eager_decode(tmp_path, device, name, kv_cache_dtype):
    build_tiny_model(name, tmp_path)
    module = Model.from_pretrained(tmp_path, device=device, dtype="float32",
                                   progress=False).module
    driver = GraphDriver(module, torch.device(device), max_graph_batch=8,
                         kv_cache_dtype=kv_cache_dtype)
    torch.manual_seed(3)
    seqs = [Sequence(f"s{i}", torch.randint(3, 256, (n,)).tolist(), GenerationConfig())
            for i, n in enumerate((5, 11, 27, 9, 3, 7, 12, 4, 6))]
    for seq, row in zip(seqs, driver.prefill(seqs)):
        seq.output_token_ids.append(int(row.argmax()))

    def decode(rows: list[Sequence], sample: list[bool] | None = None) -> None:
        flags = sample or [True] * len(rows)
        runs = driver.graphs.steps_run
        graph, eager, changed, slots = driver.decode([(s, 1, f) for s, f in zip(rows, flags)])
        assert driver.graphs.steps_run == runs + (len(rows) <= 8)
        torch.testing.assert_close(graph, eager, atol=2e-5, rtol=1e-5)
        # Exactly the real rows' slots were written: padding rows (slot -1) write nothing.
        assert changed == slots
        picked = iter(eager)
        for seq, f in zip(rows, flags):  # greedy continuation (a fixed token for unsampled rows)
            seq.output_token_ids.append(int(next(picked).argmax()) if f else 7)

    from ksana_llm.kernels import choose_num_splits  # the split count the graphs were built with

    width = driver.graphs.inputs.width * 4
    assert [choose_num_splits(b, 2, width if name != "mistral-sliding" else 24, 132)
            for b in (1, 4, 8)] == ([2, 2, 2] if name != "mistral-sliding" else [1, 1, 1])
    for _ in range(4):  # contexts grow across block boundaries (block size 4), past the window
        decode(seqs[:3])  # bucket 4 with one padding row
        decode(seqs[3:8])  # bucket 8 with three
        decode(seqs[8:9])  # bucket 1
    decode(seqs[:5], sample=[True, False, True, True, False])  # logits of some rows only
    decode(seqs)  # 9 rows: beyond the largest bucket, eager both times


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decode_with_lora_adapters_equals_eager_decode(tmp_path, device):
    """An engine with LoRA slots captures its graphs with the adapters in them: rows of two
    adapters (slots 1 and 3, slot 2 empty) and of the base model in one graph step equal the
    eager step, which computes only the slots it uses and is itself checked against PEFT in
    tests/test_lora.py."""
    from tests.lora_adapters import ALL_TARGETS, write_adapter_files

    base = build_tiny_model("yi-gqa4-bias", tmp_path / "base")
    write_adapter_files(base, tmp_path / "a", seed=1, targets=ALL_TARGETS, rank=4)
    write_adapter_files(base, tmp_path / "b", seed=2, targets=["q_proj", "down_proj"], rank=2)
    module = Model.from_pretrained(tmp_path / "base", device=device, dtype="float32",
                                   progress=False).module
    driver = GraphDriver(module, torch.device(device), max_graph_batch=4, max_loras=3,
                         max_lora_rank=4, lora_adapters=[(7, str(tmp_path / "a")),
                                                         (8, str(tmp_path / "b"))])
    driver.runner.lora.activate(1, 7)  # adapter ids 7 and 8 into slots 1 and 3
    driver.runner.lora.activate(3, 8)
    torch.manual_seed(3)
    seqs = [Sequence(f"s{i}", torch.randint(3, 256, (n,)).tolist(), GenerationConfig())
            for i, n in enumerate((5, 11, 7))]
    for seq, slot in zip(seqs, (1, 0, 3)):
        seq.lora_slot = slot
    twin = Sequence("twin", list(seqs[0].prompt_token_ids), GenerationConfig())  # s0, base
    rows = [*seqs, twin]
    prefill = driver.prefill(rows)
    assert not torch.allclose(prefill[0], prefill[3], atol=1e-3)  # the adapter is applied
    for seq, row in zip(rows, prefill):
        seq.output_token_ids.append(int(row.argmax()))
    for _ in range(3):
        runs = driver.graphs.steps_run
        graph, eager, _, _ = driver.decode([(s, 1, True) for s in rows])  # bucket 4
        assert driver.graphs.steps_run == runs + 1
        torch.testing.assert_close(graph, eager, atol=2e-5, rtol=1e-5)
        for seq, row in zip(rows, eager):
            seq.output_token_ids.append(int(row.argmax()))


# ---- KV sizing from a profiled step -------------------------------------------------------------
def test_kv_blocks_from_profile_arithmetic():
    profile = MemoryProfile(total=100 * GiB, peak_used=10 * GiB, activation_peak=2 * GiB)
    # (100 GiB * (0.9 - 0.01) - 10 GiB) / 1 MiB
    assert kv_blocks_from_profile(profile, MiB, ratio=0.9, reserved_ratio=0.01) == 79 * 1024
    assert kv_blocks_from_profile(profile, MiB, ratio=None, reserved_ratio=0.01) == 79 * 1024
    assert kv_blocks_from_profile(profile, 3 * MiB, ratio=0.5, reserved_ratio=0.0) == \
        int(40 * GiB // (3 * MiB))
    with pytest.raises(ValueError, match="block_device_memory_ratio"):
        kv_blocks_from_profile(profile, MiB, ratio=0.1, reserved_ratio=0.01)


def test_profile_step_is_the_largest_step():
    step, num_blocks = profile_step(2048, 256, 16)
    slices = step.slices
    assert len(slices) == 256 and sum(s.num_tokens for s in slices) == 2048
    assert slices[0].num_tokens == 2048 - 255 and all(s.num_tokens == 1 for s in slices[1:])
    assert all(s.sample for s in slices)
    assert num_blocks == -(-1793 // 16) + 1
    assert max(b for s in slices for b in s.block_table) == num_blocks - 1
    step, num_blocks = profile_step(4, 16, 16)  # more rows than tokens: one token each
    assert [s.num_tokens for s in step.slices] == [1, 1, 1, 1] and num_blocks == 2
    # Speculative decoding: decode rows carry their drafts, and every one of their rows counts.
    step, num_blocks = profile_step(2048, 256, 16, num_draft_tokens=3)
    assert len(step.slices) == 256 and sum(s.num_tokens for s in step.slices) == 2048
    assert all((s.num_tokens, s.num_draft_tokens) == (4, 3) for s in step.slices[1:])
    assert step.slices[0].num_tokens == 2048 - 255 * 4 and num_blocks == -(-1028 // 16) + 1
    step, _ = profile_step(64, 256, 16, num_draft_tokens=3)  # the budget bounds the rows
    assert [s.num_tokens for s in step.slices] == [4] * 16


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profile_step_runs_through_runner_and_sampler(tmp_path, backend):
    device = torch.device(DEVICES[-1])  # the GPU where there is one (Triton compiled there)
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device=device.type, dtype="float32",
                                   progress=False).module
    tokens = run_profile_step(module, device=device, dtype=torch.float32,
                              block_size=4, max_step_tokens=48, max_num_seqs=6,
                              attention_backend=backend)
    assert tokens.shape == (6,) and 0 <= int(tokens.min()) and int(tokens.max()) < 256
    drafted = run_profile_step(module, device=device, dtype=torch.float32, block_size=4,
                               max_step_tokens=48, max_num_seqs=6, attention_backend=backend,
                               num_draft_tokens=2)
    assert drafted.shape == (1 + 5 * 3,)  # the prefill row and every decode row's 1 + 2
    if device.type == "cuda":  # the whole profiled plan, on a real device
        per_block = kv_bytes_per_block(module, 4, torch.float32)
        profile = profile_memory(module, device=device, dtype=torch.float32, block_size=4,
                                 max_step_tokens=48, max_num_seqs=6, attention_backend=backend)
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        assert profile.peak_used >= weights and profile.activation_peak > 0
        blocks = plan_device_blocks(module, device=device, dtype=torch.float32, block_size=4,
                                    max_step_tokens=48, max_num_seqs=6,
                                    attention_backend=backend, ratio=0.05, reserved_ratio=0.01)
        expected = kv_blocks_from_profile(profile, per_block, ratio=0.05, reserved_ratio=0.01)
        assert abs(blocks - expected) <= 0.01 * expected  # other processes may move a little
