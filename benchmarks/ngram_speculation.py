"""Speculative decoding from the sequence itself (`speculative_method="ngram"`, prompt lookup) on
text that copies its prompt: tokens per step, acceptance and speed, on the real default model.

Workload: chat requests that ask the model to repeat or lightly fix a given paragraph (the kind
of task prompt lookup is for: edits, extraction, quoting), greedy, up to `--new-tokens` tokens.
One run, the same requests for each row:
    HF generate         transformers' `generate`, one request at a time (the peer)
    k = 0               our engine without drafts
    ngram k = 2, 4, 6   our engine drafting k tokens per step from each sequence's history
    k = 6, off>=4       the largest k with speculative_disable_by_batch_size=4 (drafting
                        pauses in steps of 4 sequences or more: large batches run as k = 0)
at batch 1 (requests one after another) and at batch 8 (all at once). It prints output tokens/s,
engine steps, drafts accepted / verified, and the speed-up over k = 0 and over HF; every engine
row must give transformers' tokens (checked).

Run
    python benchmarks/ngram_speculation.py                  # CPU, fp32, SmolLM2-135M-Instruct
    python benchmarks/ngram_speculation.py --device cuda --dtype bfloat16 --model DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file, or with -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ksana_llm as kt  # noqa: E402
from benchmarks.accuracy import device_sync as _sync  # noqa: E402
from benchmarks.engine_steps import count_steps  # noqa: E402

PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, "
    "a playground for small children, and benches along the river path.",
    "To reset the router, hold the power button for ten seconds, wait for the lights to blink "
    "twice, then connect to the network named HomeBase with the password on the label.",
    "Our quarterly report shows revenue grew by eight percent, costs fell by three percent, and "
    "the new product line sold more units than the previous two quarters combined.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, which contain the green pigment chlorophyll.",
]
TASKS = ["Repeat the following text exactly:\n\n{}", "Fix any mistakes in this text and return "
         "it in full:\n\n{}"]


def workload(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        task = TASKS[i % len(TASKS)].format(PARAGRAPHS[i % len(PARAGRAPHS)])
        text = tokenizer.apply_chat_template([{"role": "user", "content": task}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, device: torch.device
              ) -> tuple[float, list[list[int]]]:
    outputs = []
    _sync(device)
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=new_tokens, do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    _sync(device)
    return time.perf_counter() - start, outputs


def run_engine(model: kt.Model, prompts: list[list[int]], k: int, batch: int, new_tokens: int,
               disable_by_batch_size: int | None = None
               ) -> tuple[float, list[list[int]], int, int, int]:
    """(seconds, tokens, steps, drafts verified, drafts accepted)."""
    config = kt.GenerationConfig(max_new_tokens=new_tokens)
    settings = dict(speculative_method="ngram", num_speculative_tokens=k,
                    speculative_disable_by_batch_size=disable_by_batch_size) if k else {}
    with kt.Engine(model, generation_config=config, num_device_blocks=1024,
                   **settings) as engine:
        engine.generate_outputs([prompts[0]], use_tqdm=False)  # warm-up
        base = engine.stats()
        counter = count_steps(engine)
        _sync(model.device)
        start = time.perf_counter()
        outputs = []
        for first in range(0, len(prompts), batch):
            outputs.extend(engine.generate_outputs(prompts[first:first + batch], use_tqdm=False))
        _sync(model.device)
        seconds = time.perf_counter() - start
        stats = engine.stats()
    return (seconds, [o.token_ids for o in outputs], counter["steps"],
            stats.num_draft_tokens - base.num_draft_tokens,
            stats.num_accepted_draft_tokens - base.num_accepted_draft_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--disable-by-batch-size", type=int, default=4,
                        help="the extra row's speculative_disable_by_batch_size (0: no row)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model = kt.Model.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                     progress=False)
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).to(model.device)
    prompts = workload(model.tokenizer, args.requests)
    hf_seconds, expected = hf_greedy(hf, prompts, args.new_tokens, model.device)
    total = sum(len(t) for t in expected)
    results = []
    for batch in args.batch_sizes:
        print(f"\nbatch {batch}: {len(prompts)} requests, {total} output tokens in all "
              f"({model.device}, {model.dtype})")
        print(f"{'':16}{'tok/s':>9}{'steps':>7}{'accepted':>14}{'vs k=0':>8}{'vs HF':>8}")
        print(f"{'HF generate':16}{total / hf_seconds:9.1f}{'':>7}{'':>14}{'':>8}{1.0:8.2f}")
        baseline = None
        rows = [(k, None) for k in (0, *args.drafts)]
        if args.disable_by_batch_size:
            rows.append((max(args.drafts), args.disable_by_batch_size))
        for k, disable_by in rows:
            seconds, tokens, steps, drafts, accepted = run_engine(
                model, prompts, k, batch, args.new_tokens, disable_by)
            if tokens != expected:
                raise SystemExit(f"k={k}: tokens differ from transformers' greedy output")
            baseline = baseline or seconds
            rate = f"{accepted}/{drafts}" if drafts else "-"
            name = f"ngram k = {k}" if k else "k = 0"
            if disable_by:
                name = f"k = {k}, off>={disable_by}"
            print(f"{name:16}{total / seconds:9.1f}{steps:7d}{rate:>14}"
                  f"{baseline / seconds:8.2f}{hf_seconds / seconds:8.2f}")
            results.append({"device": str(model.device), "batch": batch, "k": k,
                            "disable_by_batch_size": disable_by,
                            "tokens_per_s": total / seconds, "steps": steps, "drafts": drafts,
                            "accepted": accepted, "speedup_vs_k0": baseline / seconds,
                            "speedup_vs_hf": hf_seconds / seconds})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
