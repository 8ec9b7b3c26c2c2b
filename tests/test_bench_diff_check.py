"""The bench client's output-consistency measures (`ksana_llm.bench.diff_check`) against their
definitions: Lin (2004)'s worked ROUGE-W example and cell-by-cell reference tables, plus the
standalone two-file comparison. The end-to-end `--enable_diff_check` runs are in
tests/test_benchmark_client.py (stand-in server) and tests/test_server_native.py (real engine)."""

from __future__ import annotations

import random

import pytest

from ksana_llm.bench import diff_check


def _wlcs_reference(x: list[str], y: list[str], weight: float) -> float:
    """Lin's WLCS table filled cell by cell, as in the paper."""
    c = [[0.0] * (len(y) + 1) for _ in range(len(x) + 1)]
    w = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            if x[i - 1] == y[j - 1]:
                k = w[i - 1][j - 1]
                c[i][j] = c[i - 1][j - 1] + (k + 1) ** weight - k ** weight
                w[i][j] = k + 1
            else:
                c[i][j] = max(c[i - 1][j], c[i][j - 1])
    return c[-1][-1]


def _levenshtein_reference(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, start=1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def test_diff_metrics_match_their_definitions():
    # Lin (2004)'s example with f(k) = k^2: a run of four beats four scattered matches.
    x = "A B C D E F G"
    assert diff_check.rouge_w_f1(x, "A B C D H I K", weight=2) == pytest.approx(4 / 7)
    assert diff_check.rouge_w_f1(x, "A H B K C I D", weight=2) == pytest.approx(2 / 7)
    assert diff_check.rouge_w_f1(x, x) == 1.0 and diff_check.rouge_w_f1(x, "") == 0.0
    assert diff_check.words("Hi, 你好 x2") == ["Hi", ",", "你", "好", "x2"]
    rng = random.Random(0)
    for _ in range(30):
        a = [rng.choice("abcd") for _ in range(rng.randint(1, 40))]
        b = [rng.choice("abcd") for _ in range(rng.randint(1, 40))]
        wlcs = _wlcs_reference(a, b, 1.2)
        r, p = (wlcs / len(a) ** 1.2) ** (1 / 1.2), (wlcs / len(b) ** 1.2) ** (1 / 1.2)
        expected = 2 * r * p / (r + p) if r + p else 0.0
        assert diff_check.rouge_w_f1(" ".join(a), " ".join(b)) == pytest.approx(expected)
        s, t = "".join(a), "".join(b)
        assert diff_check.levenshtein(s, t) == _levenshtein_reference(s, t)
        assert diff_check.levenshtein_ratio(s, t) == pytest.approx(
            1 - _levenshtein_reference(s, t) / max(len(s), len(t)))
    assert diff_check.first_mismatch("abc", "abc") is None
    assert diff_check.first_mismatch("abc", "abd") == 3
    assert diff_check.first_mismatch("ab", "abc") == 3


def test_diff_check_standalone_reads_two_csv_files(tmp_path, capsys):
    first, second, out = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "r.txt"
    first.write_text("index,output\n0,same text\n1,one answer\n", encoding="utf-8")
    second.write_text("index,output\n0,same text\n1,another reply\n", encoding="utf-8")
    assert diff_check.main([str(first), str(second), "--column", "1", "--header",
                            "--output", str(out)]) == 0
    assert "1/2 answers identical, 1 flagged" in capsys.readouterr().out
    assert "--- request 1" in out.read_text(encoding="utf-8")
    with pytest.raises(SystemExit):
        diff_check.main([str(first), str(second), "--column", "5"])
