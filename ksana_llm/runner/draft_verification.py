"""Verifying draft tokens against the main model (speculative decoding), on the device.

A sequence with k drafts d_1..d_k gets k + 1 rows of logits from the main model: row j is the
distribution of the token after d_j (row 0: after its last known token). Each row is processed
and warped exactly as the sampler does for one token (`process_logits`, `warp_logits`), then:

- greedy rows accept d_{j+1} when it is row j's argmax; the token emitted at the first refusal
  (or after the last draft: the bonus token) is that row's argmax, so the output is the greedy
  output token for token;
- sampling rows draw their token x_j from p_j as the sampler would (`Sampler.sample_rows`) and
  accept d_{j+1} when x_j is d_{j+1}; the token emitted at the first refusal is that row's x_j
  (after the last draft: x_k). Drafts are the draft model's argmax (a one-hot proposal), for
  which this is the speculative sampling rule: a draft stands with probability p_j(d_{j+1}),
  and a refused one leaves x_j distributed as p_j without d_{j+1} (renormalised), so every
  emitted token follows the same distribution as without drafts.

Log-probs (when asked) are what the sampler reports (by default the raw model distribution's;
see `runner.logprobs_mode`) at each row: of the row's draft, of the token it would emit, and the
row's top ones.

Rows only mix settings the sampler would accept for one token at a time; the engine drafts only
for sequences whose processors do not depend on the tokens between rows (no penalties read the
history, no grammar, no pending min_new_tokens: see `SpeculativeSteps._drafts_allowed`).

Seeded rows draw each position's noise from (seed, position) alone (`SeededDraws`): row j of a
sequence decides its output position len(output) + j with the noise the sampler would use
there, so a seeded request's tokens are those without drafts, however many drafts each step
verified (which depends on the batch, the budget and free blocks).
"""

from __future__ import annotations

import torch

from ksana_llm.runner.logits_processing import process_logits, to_device
from ksana_llm.runner.logprobs_mode import chosen_ranks, reported_values
from ksana_llm.runner.sampler import Sampler, SamplingRow, warp_logits

# Marks a row's draft id when it has none (the last row of each sequence: its bonus token).
NO_DRAFT = -1

# Columns of `verify_drafts`' result.
ACCEPTED, TOKEN = 0, 1  # whether the row accepts its draft; the token emitted if it stops there
# With log-probs: the draft's and the token's values and ranks, then k top values and k ids.
DRAFT_LOGPROB, TOKEN_LOGPROB, DRAFT_RANK, TOKEN_RANK, TOP_LOGPROBS = 2, 3, 4, 5, 6


def verify_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                  draft_ids: list[int], num_top_logprobs: int | None = None) -> torch.Tensor:
    """[R, 2] int64 on the logits' device: (whether row r accepts its draft, the token emitted
    if row r is where its sequence stops accepting). `rows[r]` is row r's sequence's settings;
    `draft_ids[r]` the draft row r judges, or NO_DRAFT.

    With `num_top_logprobs` (k, may be 0): [R, 6 + 2k] float64 instead (token ids are exact in
    it), the columns followed by the reported log-probs of the draft and of the token, their
    ranks, then the row's top-k log-prob values and ids."""
    if logits.dim() != 2 or not logits.shape[0] == len(rows) == len(draft_ids):
        raise ValueError(f"expected logits [len(rows)={len(rows)}, V] and one draft id per row, "
                         f"got {tuple(logits.shape)} and {len(draft_ids)}")
    device = logits.device
    needs_processing = any(row.has_processors for row in rows)
    processed = (process_logits(logits, rows, None, sampler.logits_processors) if needs_processing
                 else logits.float())
    has_draft = to_device([d != NO_DRAFT for d in draft_ids], torch.bool, device)
    drafts = to_device([max(d, 0) for d in draft_ids], torch.long, device).unsqueeze(1)
    greedy_ids = processed.argmax(dim=-1)
    greedy_accept = greedy_ids == drafts.squeeze(1)
    final = processed  # what each row's token is chosen from (sampled rows: warped)
    if all(row.config.greedy for row in rows):
        accepted, tokens = greedy_accept, greedy_ids
    else:
        final = warp_logits(processed, rows)
        sampled = sampler.sample_rows(final, rows, _positions_ahead(draft_ids))
        sampled_accept = sampled == drafts.squeeze(1)
        greedy = to_device([row.config.greedy for row in rows], torch.bool, device)
        accepted = torch.where(greedy, greedy_accept, sampled_accept)
        tokens = torch.where(greedy, greedy_ids, sampled)
    verdict = torch.stack((accepted & has_draft, tokens), dim=1).long()
    if num_top_logprobs is None:
        return verdict
    raw = reported_values(sampler.logprobs_mode, logits, final)
    chosen = torch.cat((raw.gather(1, drafts), raw.gather(1, tokens.unsqueeze(1))), dim=1)
    ranks = torch.stack((chosen_ranks(raw, chosen[:, 0]), chosen_ranks(raw, chosen[:, 1])), dim=1)
    values, ids = torch.topk(raw, min(num_top_logprobs, raw.shape[1]), dim=-1)
    return torch.cat((verdict.double(), chosen.double(), ranks.double(), values.double(),
                      ids.double()), dim=1)


def _positions_ahead(draft_ids: list[int]) -> list[int]:
    """For each row, how many rows of its sequence come before it: row j of a sequence decides
    output position len(output) + j. A sequence's rows end with its NO_DRAFT row."""
    ahead, count = [], 0
    for draft in draft_ids:
        ahead.append(count)
        count = 0 if draft == NO_DRAFT else count + 1
    return ahead
