"""The logits processors every row goes through before warping and sampling, in `transformers`'
order: allowed token ids (vLLM's), logit bias, min_new_tokens stop suppression and bad words,
repetition penalty, no-repeat n-grams, then OpenAI presence/frequency penalties (the bans set
-inf, which the penalties keep, so their place among them does not matter). Batched over rows
with per-row parameter tensors; then the engine's own processors (`ksana_llm.LogitsProcessor`,
batched over the rows each applies to); last, a request's own `logits_processors` (Python
callables, as transformers runs custom processors after its own), one row at a time.

The penalties and n-gram bans read the rows' token ids from the sampler's `TokenHistories` (kept
on the device) when given, else from the rows' token lists (beam search, which reorders histories
between steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ksana_llm.logits_processor import LogitsProcessorError, result_problem

if TYPE_CHECKING:  # only for annotations: both modules import this one
    from ksana_llm.logits_processor import LogitsProcessor
    from ksana_llm.runner.sampler import SamplingRow
    from ksana_llm.runner.token_history import TokenHistories

__all__ = ["PenaltyIds", "process_logits", "to_device"]


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting for the device.

    A blocking copy (`.to(device)`, `torch.tensor(..., device=...)`) synchronizes the stream, so
    the host would sit until the already queued forward is done. The source is pageable memory,
    which CUDA stages before the call returns, so it may be freed at once.
    """
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass(frozen=True)
class PenaltyIds:
    """The token ids a penalty reads, one row per batch row: [B, W] int64, right-padded with
    `vocab_size` (a row with no ids is all padding). Ids past the logits are `vocab_size` too."""

    ids: torch.Tensor

    @classmethod
    def from_lists(cls, batch_size: int, members: list[int], token_lists: list[list[int]],
                   vocab_size: int, device: torch.device) -> PenaltyIds:
        """Rows `members` get `token_lists` (in order); the other rows none."""
        lists: list[list[int]] = [[] for _ in range(batch_size)]
        for i, tokens in zip(members, token_lists):
            lists[i] = tokens
        return cls(_right_padded(lists, vocab_size, device).clamp_(min=0, max=vocab_size))


def _right_padded(token_lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), longest list (at least 1)] int64 on `device`, right-padded with `pad`."""
    width = max(1, max(len(t) for t in token_lists))
    return to_device([t + [pad] * (width - len(t)) for t in token_lists], torch.int64, device)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow],
                   histories: TokenHistories | None = None,
                   engine_processors: tuple[LogitsProcessor, ...] = (),
                   greedy_skipping: tuple[LogitsProcessor, ...] = ()) -> torch.Tensor:
    """min_new_tokens suppression and penalties, for every row; returns a new float32 tensor.

    This is the part shared by greedy and sampled rows (HF applies its processors before the
    sampling warpers). The caller's tensor is never modified. With `histories`, the
    repetition, presence and frequency penalties and the n-gram bans read the rows' ids there
    (rows without a slot get one), not their token lists.

    The penalties gather the logits at a row's history ids and scatter the penalised values
    back (an id seen twice gets the same value twice): work in the history's length, not the
    vocabulary's. They run on a buffer with one spare column, where the padding lands.

    `engine_processors` (the engine's `ksana_llm.LogitsProcessor`s, in order) then get the rows
    that carry them, before each row's own processors; greedy rows skip those in
    `greedy_skipping` (the argmax-invariant ones: the sampler's rows; beams rank every token).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    vocab_size = logits.shape[1]
    device = logits.device
    # Our own copy, with the spare column: everything below may then work in place.
    padded_out = torch.empty((len(rows), vocab_size + 1), dtype=torch.float32, device=device)
    out = padded_out[:, :vocab_size]
    out.copy_(logits)

    # 0. Allowed token ids: everything else is -inf.
    allowed = [i for i, row in enumerate(rows) if row.config.allowed_token_ids is not None]
    if allowed:
        keep = torch.stack([_allowed_mask(rows[i], vocab_size, device) for i in allowed])
        index = to_device(allowed, torch.int64, device)
        out.index_copy_(0, index, out.index_select(0, index).masked_fill_(~keep, float("-inf")))

    # 0b. Logit bias (as HF's SequenceBiasLogitsProcessor). Ids past the logits never win.
    bias = [(i, token, value) for i, row in enumerate(rows)
            for token, value in row.config.logit_bias.items() if token < vocab_size]
    if bias:
        rows_t = to_device([b[0] for b in bias], torch.int64, device)
        tokens_t = to_device([b[1] for b in bias], torch.int64, device)
        values = to_device([float(b[2]) for b in bias], torch.float32, device)
        out.index_put_((rows_t, tokens_t), values, accumulate=True)

    # 1. min_new_tokens: stop tokens are -inf until enough tokens have been produced. HF runs
    # this after the repetition penalty; the penalties keep -inf at -inf, so the order is moot.
    # One-token bad words are -inf always.
    sup_rows: list[int] = []
    sup_tokens: list[int] = []
    for i, row in enumerate(rows):
        if row.suppresses_stop:
            for token in {*row.eos_token_ids, *row.config.stop_token_ids}:
                if 0 <= token < vocab_size:
                    sup_rows.append(i)
                    sup_tokens.append(token)
        for word in row.config.bad_words_ids:
            # As transformers, a bad word that is the end-of-sequence token bans nothing.
            if len(word) == 1 and word[0] < vocab_size and word[0] not in row.eos_token_ids:
                sup_rows.append(i)
                sup_tokens.append(word[0])
    if sup_rows:
        out[to_device(sup_rows, torch.int64, device), to_device(sup_tokens, torch.int64, device)] = (
            float("-inf"))

    # 2. Repetition penalty (HF): every token seen in prompt or output is scaled once,
    # multiplied when negative and divided when positive, so it always becomes less likely.
    rep = [i for i, row in enumerate(rows) if row.config.repetition_penalty != 1.0]
    if rep:
        if histories is not None:
            seen = histories.penalty_ids(len(rows), rep, histories.slots([rows[i] for i in rep]),
                                         prompt=True)
        else:
            seen = PenaltyIds.from_lists(len(rows), rep, [rows[i].prompt_token_ids
                                                          + rows[i].output_token_ids
                                                          for i in rep], vocab_size, device)
        penalty = to_device([row.config.repetition_penalty for row in rows], torch.float32,
                            device).unsqueeze(1)
        values = padded_out.gather(1, seen.ids)
        padded_out.scatter_(1, seen.ids, torch.where(values < 0, values * penalty,
                                                     values / penalty))

    # 2b. No repeated n-grams (HF, over prompt and output).
    for size in sorted({row.config.no_repeat_ngram_size for row in rows} - {0}):
        members = [i for i, row in enumerate(rows) if row.config.no_repeat_ngram_size == size]
        tokens, lengths = _token_histories(rows, members, histories, vocab_size, device)
        _ban_repeated_ngrams(padded_out, tokens, lengths, members, size)

    # 2c. Bad words of several tokens: the last one is -inf where the history ends with the rest.
    worded = [i for i, row in enumerate(rows) if any(len(w) > 1 for w in row.config.bad_words_ids)]
    if worded:
        tokens, lengths = _token_histories(rows, worded, histories, vocab_size, device)
        _ban_bad_words(padded_out, tokens, lengths, worded,
                       [rows[i].config.bad_words_ids for i in worded])

    # 3. Presence / frequency penalties (OpenAI): output tokens only, additive, count-based:
    # logit - (presence * (count > 0) + frequency * count), for the ids the row produced.
    pf = [i for i, row in enumerate(rows)
          if row.config.presence_penalty != 0.0 or row.config.frequency_penalty != 0.0]
    if pf:
        if histories is not None:
            produced = histories.penalty_ids(len(rows), pf,
                                             histories.slots([rows[i] for i in pf]), prompt=False)
        else:
            produced = PenaltyIds.from_lists(len(rows), pf, [rows[i].output_token_ids for i in pf],
                                             vocab_size, device)
        # Sorted, an id's count is the width of its run: two batched binary searches.
        ids = produced.ids.sort(dim=1).values
        counts = (torch.searchsorted(ids, ids, right=True)
                  - torch.searchsorted(ids, ids, right=False)).to(torch.float32)
        coeffs = to_device([[row.config.presence_penalty, row.config.frequency_penalty]
                            for row in rows], torch.float32, device)
        delta = coeffs[:, 0:1] * (counts > 0).to(torch.float32) + coeffs[:, 1:2] * counts
        padded_out.scatter_(1, ids, padded_out.gather(1, ids) - delta)

    # 4. The engine's processors, each on the rows it applies to.
    for processor in engine_processors:
        _run_engine_processor(out, rows, processor, processor in greedy_skipping)

    # 5. The requests' own processors.
    for i, row in enumerate(rows):
        if row.custom_processors and row.processor_error is None:
            _run_custom_processors(out, i, row)
    return out


def _run_engine_processor(out: torch.Tensor, rows: list[SamplingRow],
                          processor: LogitsProcessor, skips_greedy: bool) -> None:
    """The rows of `out` that `processor` applies to (not greedy ones if `skips_greedy`)
    through it, at once. If it raises, or returns anything but a tensor of their shape, each
    gets a `processor_error`, as does a row it `fail`ed: the engine fails those requests (their
    logits no longer matter), the batch goes on."""
    members = [i for i, row in enumerate(rows)
               if processor in row.engine_processors and row.processor_error is None
               and not (skips_greedy and row.config.greedy)]
    if not members:
        return
    whole = len(members) == len(rows)
    index = None if whole else to_device(members, torch.int64, out.device)
    # A contiguous tensor of its own rows (`out` is a view into a wider buffer), as a processor
    # may reshape or view what it is given.
    values = out.contiguous() if whole else out.index_select(0, index)
    views = [rows[i].view for i in members]
    name = type(processor).__name__
    try:
        result = processor.apply(values, views)
        problem = result_problem(result, tuple(values.shape))
        if problem is not None:
            raise ValueError(problem)
        if whole:
            out.copy_(result)
        else:
            out.index_copy_(0, index, result.to(device=out.device, dtype=out.dtype))
    # User code: its rows fail, the others go on; whatever it raises (SystemExit, a stray
    # CancelledError or KeyboardInterrupt too), so the engine thread lives on.
    except BaseException as exc:  # noqa: BLE001
        failed: BaseException | None = exc
    else:
        failed = None
    for i, view in zip(members, views):
        own = view.take_failure()  # taken either way: the view is the row's for its lifetime
        reason = own if failed is None else failed
        if reason is not None:
            rows[i].processor_error = LogitsProcessorError(
                f"logits processor {name} failed: {type(reason).__name__}: {reason}")


def _run_custom_processors(out: torch.Tensor, i: int, row: SamplingRow) -> None:
    """Row i of `out` through the row's callables, in order. A callable that raises, or returns
    anything but a [vocab] tensor, leaves the logits as they were and sets the row's
    `processor_error`: the engine fails that request, the batch goes on."""
    values = out[i]
    for k, (fn, takes_prompt) in enumerate(row.custom_processors):
        # Copies: a processor may keep what it is given without seeing it change later.
        args = ((list(row.prompt_token_ids),) if takes_prompt else ()) + (
            list(row.output_token_ids), values)
        try:
            result = fn(*args)
        # User code: any failure is that request's, whatever it raises, so the engine lives on.
        except BaseException as exc:  # noqa: BLE001
            row.processor_error = ValueError(
                f"logits_processors[{k}] raised {type(exc).__name__}: {exc}")
            return
        problem = result_problem(result, tuple(values.shape))
        if problem is not None:
            row.processor_error = ValueError(f"logits_processors[{k}] {problem}")
            return
        if result is not values:
            try:
                values.copy_(result)
            # E.g. a meta tensor: that request's fault, whatever it raises.
            except BaseException as exc:  # noqa: BLE001
                row.processor_error = ValueError(
                    f"logits_processors[{k}] returned a tensor that cannot be read ({exc})")
                return


def _token_histories(rows: list[SamplingRow], members: list[int],
                     histories: TokenHistories | None, vocab_size: int, device: torch.device
                     ) -> tuple[torch.Tensor, list[int]]:
    """Rows `members`' prompt + output ids, [len(members), W] right-padded, and their lengths:
    from the sampler's device table when given, else from the rows' token lists."""
    if histories is not None:
        return histories.history(histories.slots([rows[i] for i in members]))
    lists = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in members]
    return _right_padded(lists, vocab_size, device), [len(t) for t in lists]


def _allowed_mask(row: SamplingRow, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The row's allowed ids as a [vocab] bool mask on `device`, built once per row."""
    mask = row.allowed_mask
    if mask is None or mask.shape[0] != vocab_size or mask.device != device:
        ids = [t for t in row.config.allowed_token_ids if t < vocab_size]
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[to_device(ids, torch.int64, device)] = True
        row.allowed_mask = mask
    return mask


def _ban_bad_words(padded_out: torch.Tensor, tokens: torch.Tensor, lengths: list[int],
                   members: list[int], words: list[list[list[int]]]) -> None:
    """-inf (in place, rows `members` of `padded_out`, whose last column is spare) for the last
    token of each bad word of two or more tokens whose other tokens end the row's history, as
    HF's NoBadWordsLogitsProcessor. `tokens` [len(members), W] holds each member's history,
    right-padded; `lengths` their lengths. One comparison for every (row, word) at once."""
    vocab_size, device = padded_out.shape[1] - 1, padded_out.device
    pairs = [(k, w) for k, row_words in enumerate(words) for w in row_words
             if len(w) > 1 and lengths[k] >= len(w) - 1]
    if not pairs:
        return
    width = max(len(w) - 1 for _, w in pairs)
    # The word's prefix is right-aligned against the history's end; shorter prefixes are padded
    # on the left with positions that always match.
    positions, expected, used = [], [], []
    for k, w in pairs:
        pad = width - (len(w) - 1)
        start = lengths[k] - (len(w) - 1)
        positions.append([0] * pad + list(range(start, lengths[k])))
        expected.append([0] * pad + w[:-1])
        used.append([False] * pad + [True] * (len(w) - 1))
    history = tokens.index_select(0, to_device([k for k, _ in pairs], torch.int64, device))
    seen = history.gather(1, to_device(positions, torch.int64, device))
    match = ((seen == to_device(expected, torch.int64, device))
             | ~to_device(used, torch.bool, device)).all(dim=1)
    last = to_device([min(w[-1], vocab_size) for _, w in pairs], torch.int64, device)
    banned = torch.where(match, last, vocab_size)
    rows_t = to_device([members[k] for k, _ in pairs], torch.int64, device)
    padded_out.index_put_((rows_t, banned), padded_out.new_full((), float("-inf")))


def _ban_repeated_ngrams(padded_out: torch.Tensor, tokens: torch.Tensor, lengths: list[int],
                         members: list[int], size: int) -> None:
    """-inf (in place, rows `members` of `padded_out`, whose last column is spare) for every
    token that would complete an n-gram of `size` tokens already present, as HF's
    NoRepeatNGramLogitsProcessor: each window of the history whose first size-1 tokens equal the
    history's last size-1 tokens bans its last token. Batched over rows: `tokens`
    [len(members), W] holds each member's history, right-padded (the padding is never inside a
    window that counts), `lengths` their lengths."""
    keep = [k for k, n in enumerate(lengths) if n >= size]  # no complete n-gram yet: no ban
    if not keep:
        return
    vocab_size, device = padded_out.shape[1] - 1, padded_out.device
    width = max(lengths[k] for k in keep)
    if len(keep) < len(lengths):
        tokens = tokens.index_select(0, to_device(keep, torch.int64, device))
    tokens = tokens[:, :width]
    length = to_device([lengths[k] for k in keep], torch.int64, device)
    windows = tokens.unfold(1, size, 1)  # [R, W - size + 1, size]
    # The last size-1 tokens of each history.
    offsets = torch.arange(size - 1, device=device)
    prefix = tokens.gather(1, (length[:, None] - (size - 1) + offsets).clamp(min=0))
    matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)
    # Only windows lying inside the history (the one starting at the prefix is one token short).
    starts = torch.arange(windows.shape[1], device=device)
    matches &= starts[None, :] <= (length[:, None] - size)
    # Windows that ban nothing (and ids past the logits) land in the spare column.
    banned_ids = torch.where(matches, windows[..., -1].clamp(min=0, max=vocab_size), vocab_size)
    index = to_device([members[k] for k in keep], torch.int64, device)
    # The value made on the device: a host tensor would be a blocking copy, waiting for the
    # forward queued before it.
    padded_out.index_put_((index[:, None].expand_as(banned_ids), banned_ids),
                          padded_out.new_full((), float("-inf")))
