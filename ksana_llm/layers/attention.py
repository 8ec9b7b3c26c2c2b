"""Attention over the paged KV cache, and the metadata that describes one step's batch.

The runner lays a step's tokens out as [decode tokens (one per sequence) | prefill chunks], builds
one `AttentionMetadata`, and every layer reads it; models never see the scheduler.

This is the torch backend (CPU, and any device): it writes new K/V into the cache by slot, then
runs `scaled_dot_product_attention` over K/V gathered from the blocks — each group of decodes in
one batched call, each prefill chunk in its own call (MLA batches short chunks of one length:
`AttentionMetadata.chunk_batches`).

The cache's storage layout (head-major) and FP8 rounding: `layers.kv_cache_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ksana_llm.kernels._common import CacheWrite
from ksana_llm.kernels.kv_quant import through_cache
from ksana_llm.layers.kv_cache_layout import gather_kv, gather_rows, store_kv
from ksana_llm.layers.lora import LoraBatch

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V: [num_blocks, block_size, kv_heads, head_dim]


class _RowsMemo:
    """`rows(num_kv_heads)`: the gather rows of `self.blocks`, computed once per step rather than
    once per layer."""

    blocks: torch.Tensor | None
    _rows: tuple[int, torch.Tensor] | None

    def rows(self, num_kv_heads: int) -> torch.Tensor:
        if self._rows is None or self._rows[0] != num_kv_heads:
            self._rows = (num_kv_heads, gather_rows(self.blocks, num_kv_heads))
        return self._rows[1]


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer keeps per cached token; models declare it, the runner allocates it.

    K is [num_blocks, block_size, num_kv_heads, head_dim] and V the same with `v_head_dim`. A
    `v_head_dim` of 0 means the layer keeps no separate V (MLA stores one compressed latent per
    token in K and reads its values from there).
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: same as head_dim

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_dim) * elem


@dataclass
class PrefillChunk(_RowsMemo):
    """One sequence's query chunk in the flattened batch."""

    start: int  # first token index in the flattened batch
    num_tokens: int
    context_len: int  # tokens attended to: cached prefix + this chunk
    # The blocks holding the context, [W]; None when the chunk has no cached prefix (attend to
    # the chunk's own K/V directly, plain causal).
    blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_tokens, W * block_size] bool, True = attend
    _rows: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)


@dataclass
class DecodeGroup(_RowsMemo):
    """Decode tokens [start, start + count) whose contexts are padded to one length.

    Decodes are grouped by similar context length so that padding (gathered and attended for
    nothing) stays small when short and long sequences decode together.
    """

    start: int
    count: int
    length: int  # L: tokens gathered per sequence, W * block_size
    blocks: torch.Tensor  # [count, W] the blocks of each context, padded with any block
    mask: torch.Tensor | None = None  # [count, 1, 1, L] bool; None when nothing is padded
    _rows: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)


@dataclass
class KernelBatch:
    """The batch as the Triton kernels read it (block tables and lengths, no gathered slots)."""

    decode_block_tables: torch.Tensor  # [num_decodes, W] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, the new token included
    prefill_block_tables: torch.Tensor  # [num_prefills, W] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, rows after the decodes
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, cached prefix + this chunk
    # [num_decodes] int32: the order the decode kernel's programs take the rows in, longest
    # context first (`runner.host_arrays.longest_first`); None: row order
    decode_order: torch.Tensor | None = None

    def to(self, device: torch.device) -> KernelBatch:
        return KernelBatch(*(None if t is None else t.to(device, non_blocking=True) for t in (
            self.decode_block_tables, self.decode_context_lens, self.prefill_block_tables,
            self.prefill_query_start_loc, self.prefill_seq_lens, self.decode_order)))


@dataclass
class AttentionMetadata:
    """One step's batch for the attention layers.

    The torch backend reads `decode_groups` / `prefills` (gathered slots and masks); the Triton
    backend reads `kernel_batch` instead, and the runner builds only the one its backend needs.
    """

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    positions: torch.Tensor | None = None  # [T] absolute position of each new token
    num_decodes: int = 0  # the first num_decodes tokens are single-token decodes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    kernel_batch: KernelBatch | None = None
    sliding_window: int | None = None  # the Triton kernels apply it themselves
    # An FP8 cache's per-layer scales (`kv_scale`); empty = 1.0 everywhere.
    kv_scales: tuple[float, ...] = ()
    # The step's LoRA adapters (ksana_llm.layers.lora); None when no token uses one.
    lora: LoraBatch | None = None
    # [T] bool: rows of sequences whose KV takes LongRoPE's long factors (layers.rotary_longrope);
    # None when the step holds no such sequence.
    long_rope_rows: torch.Tensor | None = None
    _slot_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False,
                                                                  compare=False)
    _chunk_batches: dict[tuple[float, int], list[ChunkBatch]] = field(
        default_factory=dict, repr=False, compare=False)
    _window_masks: dict[tuple[str, int, int], torch.Tensor] = field(
        default_factory=dict, repr=False, compare=False)

    def kv_scale(self, layer_idx: int) -> float:
        """The FP8 cache scale of layer `layer_idx`: 1.0 for a layer beyond the list (the MTP
        draft layers) or when there is none."""
        return self.kv_scales[layer_idx] if layer_idx < len(self.kv_scales) else 1.0

    def slot_index(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) of each new token, computed once per step."""
        if self._slot_index is None:
            self._slot_index = (self.slot_mapping // block_size, self.slot_mapping % block_size)
        return self._slot_index

    def window_mask(self, kind: str, index: int, q_pos: torch.Tensor, num_keys: int,
                    window: int) -> torch.Tensor:
        """[len(q_pos), num_keys] bool, True where key position k (0, 1, ...) is causal and in
        the window (q - window < k <= q): the mask of the decode group or prefill chunk that
        starts at row `index` (`kind` "decode" / "prefill") for layers with their own window,
        computed once per step and window."""
        key = (kind, index, window)
        if key not in self._window_masks:
            k_pos = torch.arange(num_keys, device=q_pos.device)
            self._window_masks[key] = ((k_pos[None, :] <= q_pos[:, None])
                                       & (k_pos[None, :] > q_pos[:, None] - window))
        return self._window_masks[key]

    def chunk_batches(self, max_tokens: float, num_kv_heads: int) -> list[ChunkBatch]:
        """The prefill chunks over a cached prefix with fewer than `max_tokens` rows, batched by
        length (groups of two or more), computed once per step. Speculative decoding's verify
        slices (1 + k tokens over a long context each) are the case this is for."""
        key = (max_tokens, num_kv_heads)
        if key not in self._chunk_batches:
            self._chunk_batches[key] = _batch_equal_chunks(self.prefills, max_tokens, num_kv_heads)
        return self._chunk_batches[key]


@dataclass(frozen=True)
class ChunkBatch:
    """Prefill chunks of one length n attended in one call (`AttentionMetadata.chunk_batches`)."""

    chunks: tuple[int, ...]  # their indices in `AttentionMetadata.prefills`
    num_tokens: int  # n
    rows: torch.Tensor  # [C * n] their rows of the flat batch, chunk after chunk
    kv_rows: torch.Tensor  # gather rows (`gather_rows`) of their blocks, padded to one width
    mask: torch.Tensor  # [C, n, W * block_size] bool, True = attend (False on the padding)


def _batch_equal_chunks(prefills: list[PrefillChunk], max_tokens: float,
                        num_kv_heads: int) -> list[ChunkBatch]:
    by_length: dict[int, list[int]] = {}
    for i, chunk in enumerate(prefills):
        if chunk.blocks is not None and chunk.num_tokens < max_tokens:
            by_length.setdefault(chunk.num_tokens, []).append(i)
    batches = []
    for n, indices in by_length.items():
        if len(indices) < 2:
            continue
        chunks = [prefills[i] for i in indices]
        first = chunks[0]
        width = max(c.blocks.shape[0] for c in chunks)
        block_size = first.mask.shape[1] // first.blocks.shape[0]
        table = first.blocks.new_zeros((len(chunks), width))  # padding: block 0, masked out
        mask = first.mask.new_zeros((len(chunks), n, width * block_size))
        for j, chunk in enumerate(chunks):
            table[j, :chunk.blocks.shape[0]] = chunk.blocks
            mask[j, :, :chunk.mask.shape[1]] = chunk.mask
        rows = torch.tensor([c.start + t for c in chunks for t in range(n)], dtype=torch.long)
        batches.append(ChunkBatch(tuple(indices), n, rows.to(first.blocks.device,
                                                             non_blocking=True),
                                  gather_rows(table, num_kv_heads), mask))
    return batches


def _alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                allowed: torch.Tensor | None) -> torch.Tensor:
    """ALiBi as an additive mask [..., Hq, Tq, Tk]: slope * (k_pos - q_pos), -inf where not
    allowed. q_pos: [..., Tq], k_pos: [Tk], allowed broadcastable to the result."""
    distance = (k_pos[None, :] - q_pos[..., :, None]).to(slopes.dtype)  # [..., Tq, Tk]
    bias = slopes[:, None, None] * distance.unsqueeze(-3)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, scale: float, softcap: float | None, gqa: bool,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, or with logit soft-capping (Gemma 2) or attention
    sinks (GPT-OSS), which SDPA has no option for, the same computed out: scores * scale capped
    at softcap * tanh(s / softcap), masked, softmax in float32 -- with `sinks` (float32,
    broadcastable to the scores' [..., Hq, n, 1]) as one more column of the softmax, dropped
    before the values. q [..., Hq, n, D], k/v [..., Hkv, L, D]."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, length = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink_column = sinks.expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def kernel_kv_write(v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                    dtype: torch.dtype) -> CacheWrite | None:
    """On the Triton backend, where the RoPE kernel can store the step's K/V into the cache
    itself (`kernels.apply_rotary_(write_kv=...)`; then call `paged_attention` with
    `kv_stored=True`); None elsewhere: the torch backend, or an FP8 cache, which `store_kv`
    quantizes."""
    k_cache, v_cache = kv_cache
    if meta.kernel_batch is None or k_cache.dtype != dtype or v_cache.dtype != dtype:
        return None
    return CacheWrite(v, k_cache, v_cache, meta.slot_mapping)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata, scale: float,
                    alibi_slopes: torch.Tensor | None = None,
                    kv_scale: float = 1.0, *, kv_stored: bool = False,
                    layer_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] / [T, Hkv, Dv] for the new tokens. Returns [T, Hq, Dv].

    `alibi_slopes` ([Hq], float32) adds ALiBi position biases (Baichuan-13B); it needs
    `meta.positions`. `kv_scale` is the layer's FP8 cache scale (ignored by other caches).
    `kv_stored`: the new K/V are in the cache already (`kernel_kv_write`; Triton backend only).
    `layer_window`: this layer's own sliding window, for models whose layers differ (Gemma 3:
    windowed and full layers interleaved; such a model declares no model-wide window, so the
    step's metadata carries none). Blocks outside it stay cached: the full layers read them.
    `softcap`: attention logit soft-capping, softcap * tanh(score / softcap) (Gemma 2).
    `sinks` ([Hq]): a learned logit per head in the softmax's denominator, attached to no value
    (GPT-OSS), so a head may give its keys less than all of its weight.
    """
    if layer_window is not None:
        if meta.sliding_window is not None:
            raise ValueError("layer_window: the model declares a model-wide sliding window too")
        if alibi_slopes is not None:
            raise ValueError("layer_window: not combined with ALiBi")
    if meta.kernel_batch is not None:
        return _kernel_attention(q, k, v, kv_cache, meta, scale, alibi_slopes, kv_scale,
                                 kv_stored, layer_window or meta.sliding_window, softcap, sinks)
    if kv_stored:
        raise ValueError("kv_stored: only the Triton backend's steps store K/V ahead")
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim, v_dim = k.shape[1], k.shape[2], v.shape[2]
    slot_index = meta.slot_index(k_cache.shape[1])
    store_kv(k_cache, slot_index, k, kv_scale)
    store_kv(v_cache, slot_index, v, kv_scale)
    cached = {"dtype": q.dtype, "kv_scale": kv_scale}
    gqa = q.shape[1] != num_kv_heads

    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    # With one query token, the query heads that share a KV head can act as that head's "query
    # positions": plain multi-head attention with no head expansion (faster than enable_gqa).
    group_size = q.shape[1] // num_kv_heads
    sinks = None if sinks is None else sinks.float()
    for g in meta.decode_groups:
        n, length = g.count, g.length
        rows = g.rows(num_kv_heads)
        kd = gather_kv(k_cache, rows, (n,), **cached)  # [n, Hkv, L, D]
        vd = gather_kv(v_cache, rows, (n,), **cached)
        qd = q[g.start:g.start + n].view(n, num_kv_heads, group_size, head_dim)
        mask = g.mask
        if layer_window is not None and length > layer_window:
            mask = meta.window_mask("decode", g.start, meta.positions[g.start:g.start + n],
                                    length, layer_window)[:, None, None, :]
        if alibi_slopes is not None:
            q_pos = meta.positions[g.start:g.start + n, None]  # [n, 1]
            bias = _alibi_bias(alibi_slopes, q_pos, torch.arange(length, device=q.device),
                               None if mask is None else mask.view(n, 1, 1, length))
            mask = bias.view(n, num_kv_heads, group_size, length).to(q.dtype)
        o = _attend(qd, kd, vd, mask, False, scale, softcap, False,
                    None if sinks is None else sinks.view(num_kv_heads, group_size, 1))
        out[g.start:g.start + n] = o.reshape(n, q.shape[1], v_dim)
    for chunk in meta.prefills:
        s, n = chunk.start, chunk.num_tokens
        qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if chunk.blocks is None:
            kp = through_cache(k[s:s + n], k_cache.dtype, kv_scale).transpose(0, 1)  # [Hkv, n, D]
            vp = through_cache(v[s:s + n], v_cache.dtype, kv_scale).transpose(0, 1)
        else:
            rows = chunk.rows(num_kv_heads)
            kp, vp = gather_kv(k_cache, rows, (), **cached), gather_kv(v_cache, rows, (), **cached)
        mask, causal = chunk.mask, chunk.mask is None and n > 1
        if layer_window is not None and chunk.context_len > layer_window:
            q_pos = meta.positions[s:s + n]
            mask = meta.window_mask("prefill", s, q_pos, kp.shape[1], layer_window)
            causal = False
        if alibi_slopes is not None:
            ctx = kp.shape[1]
            k_pos = torch.arange(ctx, device=q.device)
            q_pos = torch.arange(chunk.context_len - n, chunk.context_len, device=q.device)
            allowed = mask if mask is not None else k_pos[None, :] <= q_pos[:, None]
            mask, causal = _alibi_bias(alibi_slopes, q_pos, k_pos, allowed).unsqueeze(0).to(q.dtype), False
        o = _attend(qp, kp.unsqueeze(0), vp.unsqueeze(0), mask, causal, scale, softcap, gqa,
                    None if sinks is None else sinks.view(-1, 1, 1))
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                      meta: AttentionMetadata, scale: float,
                      alibi_slopes: torch.Tensor | None, kv_scale: float,
                      kv_stored: bool, window: int | None,
                      softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The Triton backend: store the new K/V (unless the RoPE kernel did), then one decode
    launch and one prefill launch that read the paged cache in place (no gathers)."""
    from ksana_llm import kernels  # imports triton: only when this backend was chosen

    k_cache, v_cache = kv_cache
    batch = meta.kernel_batch
    if not kv_stored:
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale=kv_scale)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    slopes = None if alibi_slopes is None else alibi_slopes.float()
    d = meta.num_decodes
    if d:
        kernels.paged_decode_attention(
            q[:d], k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
            sliding_window=window, alibi_slopes=slopes, softcap=softcap, kv_scale=kv_scale,
            sinks=sinks, out=out[:d], order=batch.decode_order)
    if q.shape[0] > d:
        kernels.paged_prefill_attention(
            q[d:], k_cache, v_cache, batch.prefill_block_tables, batch.prefill_query_start_loc,
            batch.prefill_seq_lens, scale, sliding_window=window,
            alibi_slopes=slopes, softcap=softcap, kv_scale=kv_scale, sinks=sinks, out=out[d:])
    return out
