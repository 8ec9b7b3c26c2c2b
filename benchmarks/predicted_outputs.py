"""Predicted Outputs (OpenAI's `prediction`) under ngram speculative decoding: how much a good,
a half-good and a wrong prediction speed up answers that do not copy their prompt.

Workload: chat requests for short poems and stories (nothing in the prompt to copy, so prompt
lookup alone finds little), greedy, up to `--new-tokens` tokens. The "right" prediction is the
answer itself (computed here by transformers), as when an application regenerates an answer it
showed before; "half" is its first half; "wrong" is unrelated text. One run, the same requests
for each row, at batch 1 (one request after another):
    HF generate             transformers' `generate` (the peer, and the reference tokens)
    k = 0                   our engine without drafts
    ngram k = 6             prompt lookup only
    ngram k = 6 + right / half / wrong prediction
It prints output tokens/s, engine steps, drafts accepted / verified, and the ratios; every engine
row must give transformers' tokens (checked).

Run
    python benchmarks/predicted_outputs.py                  # CPU, fp32, SmolLM2-135M-Instruct
    python benchmarks/predicted_outputs.py --device cuda --dtype bfloat16 --model DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file, or with -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ksana_llm as kt  # noqa: E402
from benchmarks.engine_steps import count_steps  # noqa: E402
from benchmarks.accuracy import device_sync as _sync  # noqa: E402
from benchmarks.ngram_speculation import hf_greedy  # noqa: E402

TASKS = ["Write a short poem about the sea.", "Tell me a short story about a brave mouse.",
         "Describe a sunrise over the mountains.", "Write a limerick about a cat who cooks.",
         "Explain why the sky is blue to a child.", "Write a haiku sequence about autumn."]
WRONG = "The quarterly report shows revenue grew by eight percent while costs fell. " * 4


def run(model: kt.Model, prompts: list[list[int]], predictions: list | None, k: int,
        new_tokens: int) -> tuple[float, list[list[int]], int, int, int]:
    """(seconds, tokens, steps, drafts verified, drafts accepted), one request at a time."""
    config = kt.GenerationConfig(max_new_tokens=new_tokens)
    settings = dict(speculative_method="ngram", num_speculative_tokens=k) if k else {}
    with kt.Engine(model, num_device_blocks=1024, **settings) as engine:
        engine.generate_outputs([prompts[0]], config, use_tqdm=False)  # warm-up
        base = engine.stats()
        counter = count_steps(engine)
        start = time.perf_counter()
        tokens = []
        for i, prompt in enumerate(prompts):
            request = kt.Request(prompt, config,
                                 prediction=predictions[i] if predictions else None)
            tokens.append(engine.submit(request).result(timeout=600).token_ids)
        _sync(model.device)
        seconds = time.perf_counter() - start
        stats = engine.stats()
    return (seconds, tokens, counter["steps"], stats.num_draft_tokens - base.num_draft_tokens,
            stats.num_accepted_draft_tokens - base.num_accepted_draft_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--drafts", type=int, default=6)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model = kt.Model.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                     progress=False)
    tok = model.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).to(model.device)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for t in TASKS]
    hf_seconds, expected = hf_greedy(hf, prompts, args.new_tokens, model.device)
    total = sum(len(t) for t in expected)
    rows = [("k = 0", 0, None), (f"ngram k = {args.drafts}", args.drafts, None),
            ("+ right prediction", args.drafts, [tok.decode(e) for e in expected]),
            ("+ half prediction", args.drafts, [tok.decode(e[:len(e) // 2]) for e in expected]),
            ("+ wrong prediction", args.drafts, [WRONG] * len(prompts))]
    print(f"{len(prompts)} requests one at a time, {total} output tokens ({model.device}, "
          f"{model.dtype})")
    print(f"{'':20}{'tok/s':>9}{'steps':>7}{'accepted':>14}{'vs k=0':>8}{'vs HF':>8}")
    print(f"{'HF generate':20}{total / hf_seconds:9.1f}{'':>7}{'':>14}{'':>8}{1.0:8.2f}")
    results, baseline = [], None
    for name, k, predictions in rows:
        seconds, tokens, steps, drafts, accepted = run(model, prompts, predictions, k,
                                                       args.new_tokens)
        if tokens != expected:
            raise SystemExit(f"{name}: tokens differ from transformers' greedy output")
        baseline = baseline or seconds
        rate = f"{accepted}/{drafts}" if drafts else "-"
        print(f"{name:20}{total / seconds:9.1f}{steps:7d}{rate:>14}{baseline / seconds:8.2f}"
              f"{hf_seconds / seconds:8.2f}")
        results.append({"row": name, "device": str(model.device), "tokens_per_s": total / seconds,
                        "steps": steps, "drafts": drafts, "accepted": accepted,
                        "speedup_vs_k0": baseline / seconds, "speedup_vs_hf": hf_seconds / seconds})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
