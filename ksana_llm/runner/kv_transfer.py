"""Moving a prompt's KV cache between engines (prefill/decode disaggregation).

A prefill engine computes a prompt and exports its KV as a `TransferredKv`: the token ids it
covers and, for every cache tensor of the runner (K and V of each layer, then of each draft
layer), one `[num_tokens, heads, dim]` tensor on the host. The layout is per token, not per
block, so the engines may use different block sizes. A decode engine that receives it writes
those rows into blocks of its own (`scatter_tokens`) and computes only what the KV lacks.

`to_bytes` / `from_bytes` carry it over the wire as a safetensors payload (the server's
`GET /kv_transfer/{id}`). `KvTransferSteps` is the model runner's part.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ksana_llm.kernels.kv_quant import raw
from ksana_llm.runner.host_copy import start_host_copy

__all__ = ["KvLayout", "KvTransferSteps", "TransferredKv", "gather_tokens", "scatter_tokens",
           "token_slots", "weights_fingerprint"]

_FORMAT = "ksana-llm-kv/1"
# Entries of each weight tensor the fingerprint reads (evenly spread over the tensor).
FINGERPRINT_SAMPLES = 1024


def weights_fingerprint(module: nn.Module, samples_per_tensor: int = FINGERPRINT_SAMPLES) -> str:
    """A hash of a model's weights: each parameter's name, shape and dtype, and the bytes of up
    to `samples_per_tensor` evenly spread entries. Engines serving the same checkpoint in the
    same dtype and quantization agree on any device and block size; another model of the same
    shapes (a fine-tune, another revision) differs in almost every entry, so in the hash.
    Integer arithmetic picks the entries and raw bytes are hashed: no rounding can differ
    between devices. One copy to the host, of a few MB at most."""
    digest = hashlib.sha256()
    samples: list[torch.Tensor] = []
    for name, param in module.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        flat = param.detach().reshape(-1)
        count = min(flat.numel(), samples_per_tensor)
        if count:
            index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
            samples.append(flat[index].contiguous().view(torch.uint8))
    if samples:
        digest.update(torch.cat([s.cpu() for s in samples]).numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class KvLayout:
    """What an engine's KV rows look like: one per-token shape per cache tensor, a dtype, and
    for an FP8 cache the per-layer scales its entries are read with."""

    token_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    kv_scales: tuple[float, ...] = ()  # () = 1.0 for every layer
    weights_fingerprint: str = ""  # `weights_fingerprint` of the model; "" = unknown

    @property
    def bytes_per_token(self) -> int:
        return sum(math.prod(shape) for shape in self.token_shapes) * self.dtype.itemsize

    def check(self, kv: TransferredKv) -> None:
        """ValueError unless `kv` came from an engine with this layout (same model, draft
        layers and dtype; tensor-parallel shards would differ too)."""
        shapes = tuple(tuple(t.shape[1:]) for t in kv.tensors)
        if shapes != self.token_shapes:
            raise ValueError(
                f"imported_kv: its cache tensors {_describe(shapes)} do not match this engine's "
                f"{_describe(self.token_shapes)} (a different model, draft layers or parallelism)")
        dtypes = {t.dtype for t in kv.tensors}
        if dtypes - {self.dtype}:
            raise ValueError(f"imported_kv: its dtype {sorted(map(str, dtypes))} differs from this "
                             f"engine's {self.dtype}")
        if any(t.shape[0] != kv.num_tokens for t in kv.tensors):
            raise ValueError("imported_kv: every tensor must hold one row per token id")
        if kv.weights_fingerprint and self.weights_fingerprint \
                and kv.weights_fingerprint != self.weights_fingerprint:
            # Same shapes, other weights (a fine-tune, another revision): its KV reads as noise.
            raise ValueError("imported_kv: it comes from a model with other weights (weights "
                             f"fingerprint {kv.weights_fingerprint}, this engine's "
                             f"{self.weights_fingerprint})")
        if not _same_scales(kv.kv_scales, self.kv_scales):
            # The same bytes would read as other values here.
            raise ValueError("imported_kv: its FP8 cache scales differ from this engine's (both "
                             "models need the same kv_cache_scales.json)")


def _same_scales(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Equal scale lists, a layer a list leaves out counting as 1.0."""
    n = max(len(a), len(b))
    return a + (1.0,) * (n - len(a)) == b + (1.0,) * (n - len(b))


def _describe(shapes: tuple[tuple[int, ...], ...]) -> str:
    return f"{len(shapes)} x {list(shapes[0]) if shapes else []}"


@dataclass(frozen=True)
class TransferredKv:
    """A prompt prefix's KV: row i of every tensor is the KV of `token_ids[i]` at position i."""

    token_ids: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]  # each [num_tokens, heads, dim], on the host
    kv_scales: tuple[float, ...] = ()  # an FP8 cache's per-layer scales; () = all 1.0
    # The exporting model's `weights_fingerprint`; "" (KV built by hand) is taken on trust.
    weights_fingerprint: str = ""
    # LongRoPE models: computed with the long factors (layers.rotary_longrope); a sequence
    # that takes the other set recomputes its prompt instead (engine.scheduler).
    long_rope: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def truncated(self, num_tokens: int) -> TransferredKv:
        """The first `num_tokens` positions (views, no copy)."""
        return dataclasses.replace(self, token_ids=self.token_ids[:num_tokens],
                                   tensors=tuple(t[:num_tokens] for t in self.tensors))

    def usable_prefix(self, prompt_token_ids: list[int]) -> int:
        """How many leading positions of `prompt_token_ids` this KV holds: the common prefix,
        less the prompt's last token (whose logits the receiving engine must compute)."""
        limit = min(self.num_tokens, len(prompt_token_ids) - 1)
        n = 0
        while n < limit and self.token_ids[n] == prompt_token_ids[n]:
            n += 1
        return n

    def to_bytes(self) -> bytes:
        tensors = {f"cache.{i}": t.contiguous() for i, t in enumerate(self.tensors)}
        tensors["token_ids"] = torch.tensor(self.token_ids, dtype=torch.int64)
        if self.kv_scales:
            tensors["kv_scales"] = torch.tensor(self.kv_scales, dtype=torch.float64)
        return save_safetensors(tensors, metadata={
            "format": _FORMAT, "weights_fingerprint": self.weights_fingerprint,
            "long_rope": "1" if self.long_rope else "0"})

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferredKv:
        """ValueError for a payload that is not one `to_bytes` wrote."""
        try:
            tensors = load_safetensors(data)
            metadata = _payload_metadata(data)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"not a KV transfer payload: {exc}") from exc
        token_ids = tensors.pop("token_ids", None)
        scales = tensors.pop("kv_scales", None)
        caches = [tensors.pop(f"cache.{i}", None) for i in range(len(tensors))]
        if token_ids is None or token_ids.dtype != torch.int64 or token_ids.dim() != 1 or tensors \
                or any(
                c is None or c.dim() < 1 or c.shape[0] != token_ids.numel() for c in caches):
            raise ValueError("not a KV transfer payload: expected token_ids and cache.0..N "
                             "with one row per token")
        if scales is not None and (scales.dim() != 1 or not scales.is_floating_point()):
            raise ValueError("not a KV transfer payload: kv_scales must be a list of numbers")
        return cls(tuple(token_ids.tolist()), tuple(caches),
                   () if scales is None else tuple(scales.tolist()),
                   metadata.get("weights_fingerprint", ""), metadata.get("long_rope") == "1")


def _payload_metadata(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors payload (`load` returns only the tensors): its
    header is an 8-byte little-endian length, then that much JSON."""
    length = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
    return {str(k): str(v) for k, v in metadata.items()}


Slots = tuple[torch.Tensor, torch.Tensor]  # (block id, offset in the block) of each position


def token_slots(block_table: list[int], num_tokens: int, block_size: int,
                device: torch.device) -> Slots:
    """Where positions 0..num_tokens-1 of a sequence live in caches of `block_size`-token blocks
    (made once for every cache tensor of the sequence)."""
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return (blocks.to(device, non_blocking=True),
            (positions % block_size).to(device, non_blocking=True))


def gather_tokens(cache: torch.Tensor, slots: Slots) -> torch.Tensor:
    """A sequence's rows at `slots` from one `[num_blocks, block_size, heads, dim]` cache, as a
    new `[num_tokens, heads, dim]` tensor on the cache's device."""
    return raw(cache)[slots].view(cache.dtype)


def scatter_tokens(cache: torch.Tensor, slots: Slots, rows: torch.Tensor) -> None:
    """Write `rows` ([num_tokens, heads, dim], any device) at `slots` of the cache."""
    raw(cache)[slots] = raw(rows.to(cache.device, non_blocking=True))


class KvTransferSteps:
    """A mixin of `ModelRunner`: its KV rows out (`export_kv`) and in (`_import_kv`, run by
    `execute` before the forward). It works on the runner's `kv_caches`, `draft_kv_caches`,
    `block_size`, `device`, `cache_dtype` and `kv_scales`."""

    @property
    def _all_caches(self) -> list[torch.Tensor]:
        return [t for pair in self.kv_caches + self.draft_kv_caches for t in pair]

    @functools.cached_property
    def weights_fingerprint(self) -> str:
        return weights_fingerprint(self.model)

    def weights_changed(self) -> None:
        """The weights were replaced (`update_weights`): the fingerprint that KV exported from
        now on carries, and imported KV must match, is read again when next asked for."""
        vars(self).pop("weights_fingerprint", None)

    @property
    def kv_layout(self) -> KvLayout:
        return KvLayout(tuple(tuple(t.shape[2:]) for t in self._all_caches), self.cache_dtype,
                        self.kv_scales, self.weights_fingerprint)

    def export_kv(self, block_table: list[int], token_ids: list[int]) -> TransferredKv:
        """The KV of a sequence's first len(token_ids) positions, copied to the host (this waits
        for the device, once: the rows must be final before the blocks are freed)."""
        slots = token_slots(block_table, len(token_ids), self.block_size, self.device)
        copies = [start_host_copy(gather_tokens(cache, slots)) for cache in self._all_caches]
        return TransferredKv(tuple(token_ids), tuple(copy.wait() for copy in copies),
                             self.kv_scales, self.weights_fingerprint)

    def _import_kv(self, imports: list[tuple[list[int], TransferredKv]]) -> None:
        for block_table, kv in imports:
            slots = token_slots(block_table, kv.num_tokens, self.block_size, self.device)
            for cache, rows in zip(self._all_caches, kv.tensors):
                scatter_tokens(cache, slots, rows)
