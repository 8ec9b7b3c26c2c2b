"""Tensor-parallel building blocks: each rank holds a slice of a layer's weights and the layer
all-reduces or all-gathers its output over the TP group.

- Column-parallel projections are `MergedLinear` with shards (ksana_llm.layers.linear): each rank
  keeps some output rows of every part, so attention heads and MLP columns split with no
  communication until the following row-parallel layer.
- `RowParallelLinear` (o_proj, down_proj): input columns split, partial products all-reduced,
  bias added once.
- `VocabParallelEmbedding` / `gather_vocab_logits`: the vocabulary split in row ranges (uneven
  when vocab % tp != 0), out-of-range ids masked and the lookups all-reduced; logits all-gathered.

Every module loads its slice from the full checkpoint tensor, so a rank never keeps more than its
shard. With tp_size 1 they are plain layers (no communication).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ksana_llm.distributed.context import ParallelContext, balanced_split
from ksana_llm.layers.int8_activations import token_absmax
from ksana_llm.layers.linear import QuantizedStorage
from ksana_llm.layers.lora import LoraBatch
from ksana_llm.loader.quantized_weight import QuantizedWeight, dense, quantize_on_load

SINGLE = ParallelContext()


def tp_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.tp_size > 1:
        dist.all_reduce(x, group=ctx.tp_group)
    return x


def tp_all_reduce_max(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The elementwise maximum over the ranks, in place."""
    if ctx.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    return x


def token_absmax_over_ranks(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor | None:
    """Each token's largest magnitude over every rank's slice of its features (what int8
    activations are scaled by, so that a split input quantizes as the whole one does); None on
    one rank, where the slice is the whole."""
    return tp_all_reduce_max(token_absmax(x), ctx) if ctx.tp_size > 1 else None


def tp_all_gather_rows(x: torch.Tensor, ctx: ParallelContext, total: int) -> torch.Tensor:
    """Concatenate each rank's slice of the last dim (balanced split of `total`) on every rank."""
    if ctx.tp_size == 1:
        return x
    widest = balanced_split(total, ctx.tp_size, 0)[1]
    padded = F.pad(x, (0, widest - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, padded, group=ctx.tp_group)
    sizes = [balanced_split(total, ctx.tp_size, r)[1] for r in range(ctx.tp_size)]
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


# The smallest scale group the quantized matmul kernels take (packed 4-bit codes' K tile): a
# rank's slice starting inside a scale block holds it in groups of gcd(block, start), and
# below this the kernels fall back to slower paths.
KERNEL_MIN_GROUP = 32


def scale_aligned_split(total: int, ctx: ParallelContext, scale_group: int = 1
                        ) -> tuple[int, int]:
    """This rank's (start, size) of `total` input columns of a row-parallel weight (an MLP's
    or the MoE experts' intermediate columns), given the checkpoint's scale blocks along them
    (`scale_group`, `loader.quantized.input_scale_group`). The even split, unless a rank's
    slice would start inside a block at a place that leaves groups smaller than the kernels
    take (`QuantizedWeight.columns` regroups a slice in groups of gcd(block, start)): then
    whole blocks, as evenly as they go, where every rank gets one. gpt-oss's 2880 expert
    columns over 4 ranks: 720 each would leave groups of 16, so 736, 736, 704, 704 (23, 23,
    22, 22 blocks of 32); Qwen3-30B-A3B-FP8's 768 over 4: 192 each, in groups of 64."""
    even = ctx.tp_split(total)
    if scale_group <= 1 or total % scale_group or total // scale_group < ctx.tp_size:
        return even
    smallest = min(scale_group, KERNEL_MIN_GROUP)
    if all(math.gcd(scale_group, balanced_split(total, ctx.tp_size, rank)[0]) >= smallest
           for rank in range(ctx.tp_size)):
        return even
    return ctx.tp_split(total, scale_group)


def kv_head_shard(num_kv_heads: int, ctx: ParallelContext) -> tuple[int, int]:
    """(first KV head, count) this rank keeps. Heads are split when there are at least as many
    as ranks, and replicated (each rank keeps the one its query heads read) when there are fewer."""
    if num_kv_heads % ctx.tp_size == 0:
        per_rank = num_kv_heads // ctx.tp_size
        return ctx.tp_rank * per_rank, per_rank
    if ctx.tp_size % num_kv_heads == 0:
        return ctx.tp_rank // (ctx.tp_size // num_kv_heads), 1
    raise ValueError(f"tensor_parallel_size {ctx.tp_size} cannot split {num_kv_heads} KV heads: "
                     "it must divide them or be a multiple of them")


def check_heads_divisible(num_heads: int, ctx: ParallelContext) -> None:
    if num_heads % ctx.tp_size:
        raise ValueError(f"tensor_parallel_size {ctx.tp_size} must divide the model's "
                         f"{num_heads} attention heads")


class RowParallelLinear(QuantizedStorage):
    """y = sum over ranks of x_r @ W_r^T, + bias: the input features are split."""

    takes_quantized_weights = True  # the weight loader hands it quantized weights as they are

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 ctx: ParallelContext = SINGLE, reduce_output: bool = True,
                 in_shard: tuple[int, int] | None = None) -> None:
        """`in_shard`: this rank's (start, size) of the input columns, where the layer before
        split its outputs otherwise than evenly (`scale_aligned_split`)."""
        super().__init__()
        self.ctx = ctx
        # False: return this rank's partial sum (a caller that adds several partial sums
        # all-reduces once); the bias is then added by rank 0 only, so the sum has it once.
        self.reduce_output = reduce_output
        self.in_features = in_features  # all ranks' columns
        self.in_start, local_in = in_shard if in_shard is not None \
            else ctx.tp_split(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora_name = ""  # its name in the model, under which an engine keeps its adapters

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        ctx = self.ctx
        # Under TP rank 0 adds the bias to its partial sum, so the sum has it once.
        bias_now = self.bias if ctx.tp_rank == 0 else None
        absmax = token_absmax_over_ranks(x, ctx) if self.int8_activations else None
        y = self.project(x, bias_now, absmax)
        if lora is not None:
            # This rank's input columns through A (a column slice of it), then the whole B: B is
            # linear, so the ranks' partial deltas sum to the full one in the same all-reduce.
            y = lora.add_delta(self.lora_name, x, y)
        return y if ctx.tp_size == 1 or not self.reduce_output else tp_all_reduce(y, ctx)

    def expected_checkpoint_keys(self) -> list[str]:
        return ["weight"] if self.bias is None else ["weight", "bias"]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight
                               ) -> list[str]:
        if name == "bias" and self.bias is not None:
            tensor = dense(tensor)
            if tuple(tensor.shape) != tuple(self.bias.shape):  # copy_ would broadcast a scalar
                raise ValueError(f"bias: shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(self.bias.shape)}")
            self.bias.data.copy_(tensor)
            return ["bias"]
        if name != "weight":
            raise ValueError(f"unexpected checkpoint tensor {name!r} for a row-parallel linear")
        local_in = self.local_in_features
        if tensor.shape != (self.weight.shape[0], self.in_features):
            raise ValueError(f"weight: shape {tuple(tensor.shape)} does not fit "
                             f"{tuple(self.weight.shape)} on TP rank {self.ctx.tp_rank}")
        if isinstance(tensor, torch.Tensor) and self.online_quantization \
                and self.quantized_capable:
            # Whole rows, then this rank's columns: every rank has the scales a single rank
            # would, so the numbers do not depend on the split.
            tensor = quantize_on_load(tensor, self.online_quantization)
        local = tensor.columns(self.in_start, local_in) if isinstance(tensor, QuantizedWeight) \
            else tensor[:, self.in_start:self.in_start + local_in]
        self.copy_rows(0, self.incoming(local))
        return ["weight"]


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split in row ranges across the TP ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.start, local = ctx.tp_split(vocab_size)
        self.weight = nn.Parameter(torch.empty(local, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside[:, None], 0)
        return tp_all_reduce(hidden, self.ctx)

    def expected_checkpoint_keys(self) -> list[str]:
        return ["weight"]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        # Both dims: a [vocab, 1] tensor would broadcast into every column without complaint.
        if name != "weight" or tuple(tensor.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"embedding {name!r}: shape {tuple(tensor.shape)}, expected "
                             f"[{self.vocab_size}, {self.weight.shape[1]}]")
        self.weight.data.copy_(tensor[self.start:self.start + self.weight.shape[0]])
        return ["weight"]


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: the same vocabulary split; logits are gathered by the model."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not a module call
        raise TypeError("use compute_logits")
