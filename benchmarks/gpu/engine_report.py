"""The GPU engine benchmark's verdicts and table: each report's figures against its model's
targets (issue 5's: output tokens/s, the ratio to HF `generate_batch`, batch-1 ms/token), and
the markdown summary `bench_engine` prints at the end of a run."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.engine_models import ModelSpec


def check_targets(spec: ModelSpec, report: dict[str, Any]) -> dict[str, Any]:
    t = spec.targets
    ours = report["throughput"]["ksana_llm"] or {}
    b1 = report["batch1"]["graphs_on"] or {}
    checks: dict[str, Any] = {}
    if "tokens_per_s_min" in t:
        got = ours.get("output_tokens_per_s")
        checks["tokens_per_s"] = {"target": t["tokens_per_s_min"], "got": got,
                                  "met": got is not None and got >= t["tokens_per_s_min"]}
    if "ratio_vs_hf_min" in t and report["throughput"]["hf_generate_batch"] is not None:
        got = report["ratio_vs_hf_generate_batch"]
        checks["ratio_vs_hf"] = {"target": t["ratio_vs_hf_min"], "got": got,
                                 "met": got is not None and got >= t["ratio_vs_hf_min"]}
    if "batch1_ms_per_token_max" in t:
        got = b1.get("ms_per_token")
        checks["batch1_ms_per_token"] = {"target": t["batch1_ms_per_token_max"], "got": got,
                                         "met": got is not None
                                         and got <= t["batch1_ms_per_token_max"]}
    return checks


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def summary(reports: list[dict[str, Any]]) -> str:
    lines = ["", "| model | system | output tok/s | vs HF | batch-1 ms/tok | note |",
             "|---|---|---:|---:|---:|---|"]
    for r in reports:
        tp, b1 = r["throughput"], r["batch1"]
        graphs = r["cuda_graphs"]
        tag = f" ({r['tag']})" if r.get("tag") else ""
        rows = [(f"ksana_llm graphs on{tag}", tp["ksana_llm"], b1["graphs_on"],
                 (graphs["on"] or {}).get("status", "")),
                ("ksana_llm graphs off", tp["ksana_llm_graphs_off"], b1["graphs_off"], ""),
                ("HF generate_batch", tp["hf_generate_batch"], b1["hf_generate"],
                 "" if not tp["hf_generate_batch"] or tp["hf_generate_batch"]["complete"]
                 else f"capped: {tp['hf_generate_batch']['requests_finished']}/"
                      f"{tp['hf_generate_batch']['requests']} done")]
        for i, (name, t, b, note) in enumerate(rows):
            ratio = r["ratio_vs_hf_generate_batch"] if i == 0 else None
            lines.append(f"| {r['model'] if i == 0 else ''} | {name} "
                         f"| {_fmt(t and t['output_tokens_per_s'])} | {_fmt(ratio, '.2f')} "
                         f"| {_fmt(b and b['ms_per_token'], '.3f')} | {note[:60]} |")
        for key, check in r["targets"].items():
            if isinstance(check, dict):
                lines.append(f"|  | target {key} | | | | {check['got']} vs {check['target']}: "
                             f"{'MET' if check['met'] else 'MISSED'} |")
        if r["errors"]:
            lines.append(f"|  | errors | | | | {'; '.join(r['errors'])[:80]} |")
    return "\n".join(lines)
