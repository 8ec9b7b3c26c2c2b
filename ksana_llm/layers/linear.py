"""Linear layers that know how to load checkpoint tensors, including fused (merged) ones."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from ksana_llm.kernels.reference import fp8_linear_ref
from ksana_llm.loader.weight_quant import PACKED_INT4_DTYPE, dequantize_weight
from ksana_llm.layers.int8_activations import (dequantize_tokens, int8_codes_matmul,
                                               int8_matmul_runs, quantize_tokens)
from ksana_llm.layers.lora import LoraBatch
from ksana_llm.loader.quantized_weight import (QuantizedLayout, QuantizedWeight,
                                               in_input_order, quantize_on_load)

logger = logging.getLogger("ksana_llm.model")


def prepack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 CPU weight, or None where it does not apply.

    Measured on a 2-core AMD EPYC (AVX2) VM with SmolLM2's shapes: 1.05-1.8x faster than
    `F.linear` (MKL) from 1 to 1,024 rows, and 1.2-2x for the 49152-row LM head; on a 2-core
    Xeon VM 1.3-2x faster from 4 rows, but slower at 1-2 (see `prepacked_wins_few_rows`). The
    price is a second copy of the weight, which is why only CPU float32 weights get one.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


# "1" / "0": prepack CPU float32 weights always / never; unset: when they fit (see below).
PREPACK_ENV_VAR = "KSANA_LLM_CPU_PREPACK"


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available to new allocations (MemAvailable), or None
    where /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prepack_fits(num_bytes: int) -> bool:
    """Whether to make prepacked copies of `num_bytes` of CPU weights: $KSANA_LLM_CPU_PREPACK
    ("1"/"0") decides when set; otherwise only when the copies take at most half the memory
    available now, leaving the rest to the KV cache and activations (a model whose float32
    weights fill a third of RAM would otherwise run out of memory for a 1.05-2x speed-up)."""
    forced = os.environ.get(PREPACK_ENV_VAR)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{PREPACK_ENV_VAR} must be 0 or 1, got {forced!r}")
        return forced == "1"
    available = available_memory_bytes()
    if available is None or num_bytes <= available // 2:
        return True
    logger.warning("CPU weights not prepacked: a second copy (%.1f GB) would take more than half "
                   "the %.1f GB available; set %s=1 to force it", num_bytes / 2**30,
                   available / 2**30, PREPACK_ENV_VAR)
    return False


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Decode batches of up to this many rows may do better with F.linear (see
# `prepacked_wins_few_rows`); from twice as many the prepacked copies won on every CPU measured.
FEW_ROWS = 2


def cpu_vendor() -> str:
    """/proc/cpuinfo's `vendor_id` ("GenuineIntel", "AuthenticAMD", ...), "" where there is
    none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        return ""
    return ""


def prepacked_wins_few_rows() -> bool:
    """Whether the prepacked copies multiply one or two rows faster than `F.linear` (MKL) on
    this CPU. Measured over all of SmolLM2's weights (read from memory, as a decode step reads
    them): on a 2-core AMD EPYC (AVX2) VM the prepacked copies won from one row up (1.05-1.8x);
    on a 2-core Intel Xeon VM `F.linear` won up to 2 rows (20.1 against 24.3 ms a pass at one
    row, 21.3 against 26.1 at two) and lost from 4 (36.2 against 27.2). A rule by vendor, not a
    timing at load: a timing can come out either way on a noisy machine, and a model should
    compute the same numbers every time it loads on one."""
    return cpu_vendor() != "GenuineIntel"


# Up to here the Triton kernel reads fewer bytes than dequantize-then-matmul: it reads the FP8
# weight once per 64 rows (4 bytes a weight at 256 rows), the dequantizing path 13 (FP8 read,
# fp32 written and read, 16-bit written and read by the matmul). Not measured on a GPU yet.
FP8_KERNEL_MAX_ROWS = 256


def fp8_kernel_for(group_size: int, per_row: bool, packed: bool = False
                   ) -> Callable[..., torch.Tensor] | None:
    """The Triton quantized-weight matmul when it can run here (triton on a CUDA machine, a
    group size its tiles divide), else None."""
    from ksana_llm.kernels import triton_available

    if not torch.cuda.is_available() or not triton_available():
        return None
    from ksana_llm.kernels.fp8_matmul import fp8_linear, kernel_block_k

    return fp8_linear if kernel_block_k(group_size, per_row, packed) is not None else None


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_size: int,
               bias: torch.Tensor | None,
               kernel: Callable[..., torch.Tensor] | None,
               zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """x times a quantized weight (8-bit, or packed 4-bit codes; with their `zero_point`s where
    the codes have them). On a GPU, batches of up to FP8_KERNEL_MAX_ROWS rows (decode steps)
    take `kernel` (see `fp8_kernel_for`), which reads the FP8 bytes once per 64 rows; larger ones
    (prefill chunks), and the CPU, dequantize the weight to x's dtype and run the dense matmul
    (the torch reference), whose extra passes over the weight the many rows amortize."""
    if kernel is not None and x.is_cuda and x.numel() <= FP8_KERNEL_MAX_ROWS * x.shape[-1]:
        return kernel(x, weight, scale, group_size, bias, zero_point)
    return fp8_linear_ref(x, weight, scale, group_size, bias, zero_point)


def int8_activation_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           group_size: int, bias: torch.Tensor | None,
                           kernel: Callable[..., torch.Tensor] | None,
                           zero_point: torch.Tensor | None = None,
                           absmax: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized to int8 per token (a W8A8 checkpoint's activations; `absmax`, each token's
    largest magnitude, when x is a slice of it: see `layers.int8_activations`) times a quantized
    weight: as int8 codes times int8 codes where `int8_matmul_runs`, else dequantized into
    `fp8_matmul` (the same numbers)."""
    codes, token_scale = quantize_tokens(x, absmax)
    if int8_matmul_runs(x, weight, scale, zero_point):
        return int8_codes_matmul(codes, token_scale, weight, scale, bias, x.dtype)
    return fp8_matmul(dequantize_tokens(codes, token_scale, x.dtype), weight, scale, group_size,
                      bias, kernel, zero_point)


def quantized_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None,
                     kernel: Callable[..., torch.Tensor] | None,
                     zero_point: torch.Tensor | None, int8_activations: bool,
                     token_absmax: torch.Tensor | None = None) -> torch.Tensor:
    """x times a quantized weight, its input quantized to int8 first where the weight asks
    (`int8_activation_matmul`), else as it is (`fp8_matmul`): what the projections and the MoE
    experts both do."""
    if int8_activations:
        return int8_activation_matmul(x, weight, scale, group_size, bias, kernel, zero_point,
                                      token_absmax)
    return fp8_matmul(x, weight, scale, group_size, bias, kernel, zero_point)


class QuantizedStorage(nn.Module):
    """What a projection needs to keep its weight at one byte per number (see
    `loader.quantized_weight`), or half a byte (4-bit checkpoints): the weight parameter turns
    FP8 (or int8, an integer checkpoint's codes, or uint8 [rows, cols / 2], packed 4-bit codes;
    with a `weight_zero_point` buffer where the codes have zero points) when the first
    `QuantizedWeight` arrives, with a `weight_scale` buffer of [rows, groups] float32 scales
    beside it. `online_quantization` ("fp8", "w8a8_int8") quantizes full-precision tensors per
    row as they arrive (`loader.quantized_weight.quantize_on_load`); `int8_activations` (W8A8)
    quantizes the input to int8 per token before the matmul, as the checkpoint does;
    `quantized_capable` False (a weight other code reads as a dense matrix, MLA's absorbed
    `kv_b_proj`) takes quantized tensors dequantized. Weights stay as they load: a module built for bf16 whose checkpoint is
    quantized never holds the bf16 copy."""

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.weight_scale: torch.Tensor | None
        self.register_buffer("weight_scale", None, persistent=False)
        self.weight_zero_point: torch.Tensor | None  # [rows, groups]: see QuantizedWeight
        self.register_buffer("weight_zero_point", None, persistent=False)
        # GPTQ's activation order: the weight's columns take the inputs in this order.
        self.input_order: torch.Tensor | None
        self.register_buffer("input_order", None, persistent=False)
        self.weight_group_size = 0
        self.int8_activations = False
        self.quantized_capable = True
        # "fp8" / "w8a8_int8": full-precision tensors quantized per row as they load
        self.online_quantization: str | None = None
        self._has_dense_rows = False
        self._dense_dtype = torch.float32
        # oneDNN's copy of a CPU float32 weight (see prepack), used from this many rows up.
        self.packed_weight: torch.Tensor | None = None
        self.packed_min_rows = 1
        # The Triton FP8 matmul, False where it cannot run, None until the first GPU matmul.
        self._fp8_kernel: Callable[..., torch.Tensor] | bool | None = None

    @property
    def is_quantized(self) -> bool:
        return self.weight_scale is not None

    def prepack(self) -> None:
        """Called once the weights are loaded (CPU float32 only: see prepack_cpu_weight)."""
        self.packed_weight = prepack_cpu_weight(self.weight)

    @property
    def local_in_features(self) -> int:
        """The weight's input columns on this rank (a packed weight stores two a byte)."""
        columns = self.weight.shape[1]
        return 2 * columns if self.weight.dtype == PACKED_INT4_DTYPE else columns

    def incoming(self, tensor: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """A checkpoint tensor in the form this module stores: 8-bit (switching storage on the
        first one) or dense. A fused projection whose parts disagree (one part quantized,
        another not; FP8 and int8; other scale blocks or input orders) keeps every part dense
        rather than mixing them."""
        if isinstance(tensor, torch.Tensor) and self.online_quantization \
                and self.quantized_capable:
            tensor = quantize_on_load(tensor, self.online_quantization)
        if isinstance(tensor, QuantizedWeight):
            if tensor.fp4:  # FP4 codes as int8 (exactly): the projections' kernels read those
                tensor = tensor.unpacked()
            if self.quantized_capable and not self._has_dense_rows \
                    and self._store_quantized(tensor):
                return tensor
            tensor = tensor.dequantize()
        self._store_dense()
        return tensor

    def _store_quantized(self, tensor: QuantizedWeight) -> bool:
        """Switch the weight to quantized storage (FP8, int8 or packed 4-bit, as `tensor`
        holds) for `tensor`'s scale layout; False when the weight already holds rows of another
        kind or layout."""
        layout = tensor.layout
        if self.is_quantized:
            stored = QuantizedLayout.of(self.weight, self.weight_scale.shape[1],
                                        self.weight_group_size, self.weight_zero_point,
                                        self.int8_activations)
            return layout == stored and _same_order(tensor.input_order, self.input_order)
        (rows, columns), device = self.weight.shape, self.weight.device
        self._dense_dtype = self.weight.dtype
        if tensor.packed:
            columns //= 2  # even: a packed part's columns are the module's
        if layout.zero_dtype is not None:
            self.register_buffer("weight_zero_point",
                                 torch.zeros(rows, layout.groups, dtype=layout.zero_dtype,
                                             device=device), persistent=False)
        self.weight = nn.Parameter(torch.empty(rows, columns, dtype=tensor.data.dtype,
                                               device=device), requires_grad=False)
        # A buffer, not a parameter: the checkpoint's `weight_scale_inv` arrives inside the
        # weight's QuantizedWeight, so the loader expects no tensor of this name.
        self.register_buffer("weight_scale", torch.ones(rows, layout.groups, device=device),
                             persistent=False)
        if tensor.input_order is not None:
            self.register_buffer("input_order", tensor.input_order.to(device), persistent=False)
        self.weight_group_size = tensor.group_size
        self.int8_activations = tensor.int8_activations
        return True

    def _quantized_matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
                          token_absmax: torch.Tensor | None) -> torch.Tensor:
        if self._fp8_kernel is None and x.is_cuda:  # decided once: checking costs a launch's time
            self._fp8_kernel = fp8_kernel_for(self.weight_group_size,
                                              self.weight_scale.shape[1] == 1,
                                              self.weight.dtype == PACKED_INT4_DTYPE) or False
        return quantized_matmul(x, self.weight, self.weight_scale, self.weight_group_size, bias,
                                self._fp8_kernel or None, self.weight_zero_point,
                                self.int8_activations, token_absmax)

    def _store_dense(self) -> None:
        """Dense rows are coming: rows already stored quantized are dequantized first."""
        self._has_dense_rows = True
        if self.is_quantized:
            dense_weight = in_input_order(
                dequantize_weight(self.weight.data, self.weight_scale, self.weight_group_size,
                                  self._dense_dtype, self.weight_zero_point), self.input_order)
            self.weight = nn.Parameter(dense_weight, requires_grad=False)
            self.weight_scale = None
            self.weight_zero_point = None
            self.input_order = None
            self.weight_group_size = 0
            if self.int8_activations:
                logger.info("a projection's parts do not share one quantized layout: it is "
                            "held dense, its activations no longer quantized to int8")
            self.int8_activations = False

    def copy_rows(self, offset: int, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Fill rows [offset, offset + rows) of the weight (and its scales)."""
        rows = tensor.shape[0]
        if isinstance(tensor, QuantizedWeight):
            self.weight.data[offset:offset + rows].copy_(tensor.data)
            self.weight_scale[offset:offset + rows].copy_(tensor.scale)
            if tensor.zero_point is not None:
                self.weight_zero_point[offset:offset + rows].copy_(tensor.zero_point)
        else:
            self.weight.data[offset:offset + rows].copy_(tensor)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None,
                token_absmax: torch.Tensor | None = None) -> torch.Tensor:
        """x times the weight, + bias. `token_absmax`: each token's largest magnitude over the
        whole input when x is this rank's slice of it (int8 activations under tensor
        parallelism)."""
        if self.weight_scale is not None:
            if self.input_order is not None:
                x = x.index_select(-1, self.input_order)
            return self._quantized_matmul(x, bias, token_absmax)
        packed = self.packed_weight
        if packed is not None and x.dim() == 2 and x.shape[0] >= self.packed_min_rows:
            return packed_linear(x, packed, bias)
        return nn.functional.linear(x, self.weight, bias)


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))


class MergedLinear(QuantizedStorage):
    """One matmul for several projections stacked along the output dim (QKV, gate/up).

    Checkpoints store the parts separately; `load_shard` copies part `index` into its rows. Under
    tensor parallelism a rank keeps only some rows of each part: `shards[i]` is (first row, row
    count) of part i's full checkpoint tensor (column-parallel), and `out_sizes` are the kept
    sizes. Without shards every row is kept.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 shards: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.full_sizes = list(out_sizes)
        self.shards = list(shards) if shards is not None else [(0, n) for n in out_sizes]
        if len(self.shards) != len(self.full_sizes):
            raise ValueError("one shard per part")
        self.out_sizes = [size for _, size in self.shards]
        self.offsets = [sum(self.out_sizes[:i]) for i in range(len(self.out_sizes))]
        total = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None
        self.lora_name = ""  # its name in the model, under which an engine keeps its adapters

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        y = self.project(x, self.bias)
        return y if lora is None else lora.add_delta(self.lora_name, x, y)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor | QuantizedWeight, index: int
                   ) -> None:
        dims = 2 if param is self.weight else 1
        if len(tensor.shape) != dims:  # a scalar or a stray dim: name it, do not index past it
            raise ValueError(f"shard {index} has shape {tuple(tensor.shape)}, expected a "
                             f"{dims}-d tensor")
        if tensor.shape[0] != self.full_sizes[index]:
            raise ValueError(f"shard {index} has {tensor.shape[0]} rows, "
                             f"expected {self.full_sizes[index]}")
        first, size = self.shards[index]
        offset = self.offsets[index]
        if param is not self.weight:  # the bias
            param.data[offset:offset + size].copy_(tensor[first:first + size])
            return
        if tensor.shape[1] != self.local_in_features:
            raise ValueError(f"shard {index} has {tensor.shape[1]} columns, expected "
                             f"{self.local_in_features}")
        local = tensor.rows(first, size) if isinstance(tensor, QuantizedWeight) \
            else tensor[first:first + size]
        self.copy_rows(offset, self.incoming(local))
