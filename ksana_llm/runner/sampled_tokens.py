"""What a sampling step chose (`SamplerOutput`: token ids, and log-probs when asked, on the
device) and its copy on the way to the host (`HostSamples`), packed so that one transfer and
one sync carry it all."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ksana_llm.runner.host_copy import HostCopy, start_host_copy


# Up to this many top columns, every row's are made Python numbers at once (quicker than a
# conversion per row); beyond it, each row converts only the columns it asked for.
_CONVERT_WHOLE_TOP = 64


@dataclass
class SamplerOutput:
    """The chosen tokens of one step, and their log-probs when some row asked for them."""

    token_ids: torch.Tensor  # [B] int64
    # [B] float32: the chosen token's log-prob, by default under the raw distribution (what the
    # values are: `Sampler.logprobs_mode`; the top ones are of the same kind)
    logprobs: torch.Tensor | None = None
    # [B] int64, with `logprobs`: the chosen token's rank among them (`chosen_ranks`)
    ranks: torch.Tensor | None = None
    # (values [B, k_max] float32, ids [B, k_max] int64); k_max is the largest k asked in the
    # batch, so a row that asked for fewer should keep only its first `config.logprobs` columns.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None

    def to_lists(self) -> SampledLists:
        """Everything as Python lists, with one host sync."""
        return self.to_host().to_lists()

    def to_host(self) -> HostSamples:
        """Start copying everything to the host, without waiting for the device.

        Everything is packed into one tensor first: token ids alone when nothing else was asked,
        else float64, in which token ids are exact (< 2**53) and float32 log-probs widen exactly.
        On CUDA the copy lands in pinned memory behind an event, so work queued after it (the
        next step's forward) does not delay reading it.
        """
        top_k = None if self.top_logprobs is None else self.top_logprobs[0].shape[1]
        if self.logprobs is None and self.top_logprobs is None:
            packed = self.token_ids
        else:
            parts = [self.token_ids.to(torch.float64).unsqueeze(1)]
            if self.logprobs is not None:
                if self.ranks is None:
                    raise ValueError("a SamplerOutput with logprobs carries their ranks too")
                parts.append(self.logprobs.to(torch.float64).unsqueeze(1))
                parts.append(self.ranks.to(torch.float64).unsqueeze(1))
            if self.top_logprobs is not None:
                parts.extend(t.to(torch.float64) for t in self.top_logprobs)
            packed = torch.cat(parts, dim=1)
        return HostSamples(start_host_copy(packed), self.logprobs is not None, top_k)


@dataclass(frozen=True)
class HostSamples:
    """A step's chosen tokens (and log-probs) on their way to the host (`SamplerOutput.to_host`)."""

    packed: HostCopy  # [B] int64 token ids, or [B, 1 (+2) (+2k)] float64
    has_logprobs: bool  # ... with the log-prob and rank columns
    top_k: int | None  # top log-prob columns (values, then ids); None: none asked

    def to_lists(self, row_top: list[int] | None = None) -> SampledLists:
        """Everything as Python lists; waits for the copy. `row_top[i]`: how many of the top
        columns row i keeps (default: all): the batch's columns are as many as its largest ask
        (the whole vocabulary for logprobs=-1), and making Python numbers of all of them for
        every row costs the engine thread milliseconds per row."""
        packed = self.packed.wait()
        if packed.dim() == 1:
            return SampledLists(packed.tolist())  # the common case: token ids only
        out = SampledLists(packed[:, 0].to(torch.int64).tolist())
        col = 1
        if self.has_logprobs:
            out.logprobs = packed[:, 1].tolist()
            out.ranks = packed[:, 2].to(torch.int64).tolist()
            col = 3
        k = self.top_k
        if k is not None:
            values, ids = packed[:, col:col + k], packed[:, col + k:col + 2 * k].to(torch.int64)
            if row_top is None or k <= _CONVERT_WHOLE_TOP:
                out.top = (values.tolist(), ids.tolist())
                if row_top is not None:
                    out.top = ([v[:n] for v, n in zip(out.top[0], row_top)],
                               [t[:n] for t, n in zip(out.top[1], row_top)])
            else:
                out.top = ([values[i, :n].tolist() for i, n in enumerate(row_top)],
                           [ids[i, :n].tolist() for i, n in enumerate(row_top)])
        return out


@dataclass
class SampledLists:
    """A step's chosen tokens on the host: with log-probs, each row's chosen log-prob and its
    rank, and its top k (values, ids)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top: tuple[list[list[float]], list[list[int]]] | None = None
