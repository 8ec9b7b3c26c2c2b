"""Output consistency between benchmark runs (KsanaLLM's `--enable_diff_check`).

The same prompts sent twice should give the same answers when sampling is greedy; where they do
not, the engine is not reproducible under load (batch composition, preemption, a race). Each
answer of a later run is compared with the first run's answer to the same request by:

- ROUGE-W F1 (Lin, 2004): a longest common subsequence over words in which consecutive matches
  weigh more (f(k) = k^1.2), so a reordered answer scores below a locally edited one; 1.0 when
  the words are the same. Words are runs of letters/digits, single punctuation marks and single
  CJK characters, so Chinese text is compared character by character.
- Levenshtein ratio: 1 - (character edit distance) / (length of the longer text).
- First mismatch: the 1-based character position where the texts first differ (None if equal).

A pair is reported in detail when its ROUGE-W is below the threshold or, with a mismatch
threshold, its first mismatch is at or before that position. Standalone, on two CSV files with
one text per row (first column by default; `--column 1 --header` reads `--output_csv` files):

    python -m ksana_llm.bench.diff_check baseline.csv other.csv --rouge-threshold 0.5 \\
        --first-mismatch-threshold 10 --output comparison_results.txt
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROUGE_W_WEIGHT = 1.2  # Lin's f(k) = k^1.2
_WORD = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|[^\W\u3400-\u9fff\uf900-\ufaff]+|[^\w\s]",
                   re.UNICODE)


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def rouge_w_f1(reference: str, candidate: str, weight: float = ROUGE_W_WEIGHT) -> float:
    """ROUGE-W F1 of `candidate` against `reference` (symmetric in practice: F1 of R and P)."""
    ref, cand = words(reference), words(candidate)
    if ref == cand:
        return 1.0
    if not ref or not cand:
        return 0.0
    wlcs = _weighted_lcs(ref, cand, weight)
    recall = (wlcs / len(ref) ** weight) ** (1 / weight)
    precision = (wlcs / len(cand) ** weight) ** (1 / weight)
    if recall + precision == 0:
        return 0.0
    return 2 * recall * precision / (recall + precision)


def _weighted_lcs(x: list[str], y: list[str], weight: float) -> float:
    """Lin's WLCS, one row of the table at a time with numpy. A matching cell extends the run
    on its diagonal (c = c_diag + f(k+1) - f(k)); any other cell takes the best of its upper
    and left neighbours, the left one being a running maximum that restarts at each match."""
    vocab: dict[str, int] = {}
    xs = np.array([vocab.setdefault(w, len(vocab)) for w in x])
    ys = np.array([vocab.setdefault(w, len(vocab)) for w in y])
    n = len(ys)
    c_prev = np.zeros(n + 1)
    run_prev = np.zeros(n + 1, dtype=np.int64)
    positions = np.arange(n + 1)
    for token in xs:
        match = np.zeros(n + 1, dtype=bool)
        match[1:] = ys == token
        run = np.zeros(n + 1, dtype=np.int64)
        run[1:] = np.where(match[1:], run_prev[:-1] + 1, 0)
        gain = run.astype(np.float64) ** weight - (run - 1).clip(min=0).astype(np.float64) ** weight
        base = np.where(match, np.concatenate(([0.0], c_prev[:-1])) + gain, c_prev)
        # Running max from the left that restarts at each match: lift each segment (a match and
        # the non-matches after it) above everything before it, accumulate, and lower it back.
        segment = np.maximum.accumulate(np.where(match, positions, 0))
        lift = segment * (base.max() + 1.0)
        c_prev = np.maximum.accumulate(base + lift) - lift
        run_prev = run
    return float(c_prev[-1])


def levenshtein_ratio(a: str, b: str) -> float:
    if a == b:
        return 1.0
    return 1.0 - levenshtein(a, b) / max(len(a), len(b))


def levenshtein(a: str, b: str) -> int:
    """Character edit distance; each row's insertions resolved by one running minimum."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    bs = np.array([ord(ch) for ch in b])
    positions = np.arange(len(b) + 1)
    row = positions.copy()
    for i, ch in enumerate(a, start=1):
        best = np.empty_like(row)
        best[0] = i
        best[1:] = np.minimum(row[1:] + 1, row[:-1] + (bs != ord(ch)))
        row = np.minimum.accumulate(best - positions) + positions
    return int(row[-1])


def first_mismatch(a: str, b: str) -> int | None:
    """1-based position of the first differing character; None when the texts are equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i + 1
    return min(len(a), len(b)) + 1


@dataclass(frozen=True)
class PairDiff:
    index: int
    baseline: str
    other: str
    rouge_w: float
    levenshtein_ratio: float
    first_mismatch: int | None

    @property
    def identical(self) -> bool:
        return self.first_mismatch is None

    def flagged(self, rouge_threshold: float, mismatch_threshold: int | None) -> list[str]:
        """Why this pair is reported in detail (empty: it is not)."""
        reasons = []
        if self.rouge_w < rouge_threshold:
            reasons.append(f"ROUGE-W {self.rouge_w:.4f} < {rouge_threshold:g}")
        if mismatch_threshold is not None and self.first_mismatch is not None \
                and self.first_mismatch <= mismatch_threshold:
            reasons.append(f"first mismatch at {self.first_mismatch} <= {mismatch_threshold}")
        return reasons


def compare(baseline: Sequence[str], other: Sequence[str],
            indices: Sequence[int] | None = None) -> list[PairDiff]:
    if len(baseline) != len(other):
        raise ValueError(f"cannot compare {len(baseline)} texts with {len(other)}")
    indices = range(len(baseline)) if indices is None else indices
    return [PairDiff(i, a, b, rouge_w_f1(a, b), levenshtein_ratio(a, b), first_mismatch(a, b))
            for i, a, b in zip(indices, baseline, other)]


def summary(diffs: Sequence[PairDiff], rouge_threshold: float,
            mismatch_threshold: int | None) -> str:
    if not diffs:
        return "no pair of successful answers to compare"
    flagged = sum(bool(d.flagged(rouge_threshold, mismatch_threshold)) for d in diffs)
    identical = sum(d.identical for d in diffs)
    return (f"{identical}/{len(diffs)} answers identical, {flagged} flagged; "
            f"mean ROUGE-W {sum(d.rouge_w for d in diffs) / len(diffs):.4f}, mean Levenshtein "
            f"ratio {sum(d.levenshtein_ratio for d in diffs) / len(diffs):.4f}")


def report(diffs: Sequence[PairDiff], rouge_threshold: float, mismatch_threshold: int | None,
           title: str = "") -> str:
    """The flagged pairs side by side, then the statistics and the conditions used."""
    lines = [f"==== {title} ====" if title else "===="]
    for d in diffs:
        reasons = d.flagged(rouge_threshold, mismatch_threshold)
        if not reasons:
            continue
        lines += [f"--- request {d.index}: {'; '.join(reasons)} (Levenshtein ratio "
                  f"{d.levenshtein_ratio:.4f})", "[baseline]", d.baseline, "[other]", d.other, ""]
    lines.append(summary(diffs, rouge_threshold, mismatch_threshold))
    condition = f"ROUGE-W < {rouge_threshold:g}"
    if mismatch_threshold is not None:
        condition += f" or first mismatch <= {mismatch_threshold}"
    lines += [f"flagged when: {condition}", ""]
    return "\n".join(lines)


def _read_texts(path: str, column: int, header: bool) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[1 if header else 0:]
    for number, row in enumerate(rows, start=2 if header else 1):
        if len(row) <= column:
            raise ValueError(f"{path}: row {number} has no column {column}")
    return [row[column] for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ksana_llm.bench.diff_check",
                                description="Compare two CSV files of texts (first column).")
    p.add_argument("csv_file1", help="baseline texts")
    p.add_argument("csv_file2", help="texts to compare with them")
    p.add_argument("--rouge-threshold", type=float, default=0.5)
    p.add_argument("--first-mismatch-threshold", type=int, default=None)
    p.add_argument("--output", "-o", default="comparison_results.txt")
    p.add_argument("--column", type=int, default=0, help="the column holding the texts")
    p.add_argument("--header", action="store_true", help="skip each file's first row")
    args = p.parse_args(argv)
    try:
        first = _read_texts(args.csv_file1, args.column, args.header)
        second = _read_texts(args.csv_file2, args.column, args.header)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    if len(first) != len(second):
        p.error(f"{args.csv_file1} has {len(first)} texts, {args.csv_file2} {len(second)}")
    diffs = compare(first, second)
    text = report(diffs, args.rouge_threshold, args.first_mismatch_threshold,
                  f"{args.csv_file1} vs {args.csv_file2}")
    Path(args.output).write_text(text, encoding="utf-8")
    print("diff check: " + summary(diffs, args.rouge_threshold, args.first_mismatch_threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
