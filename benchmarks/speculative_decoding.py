"""Speculative decoding with DeepSeek's MTP layer: tokens per step, acceptance and speed.

No trained DeepSeek checkpoint fits here, so the model is a small random DeepSeek-V3 (MLA, MoE,
one MTP layer) whose MTP head is fitted to the main model's own greedy continuations of the
benchmark prompts (tests/deepseek_checkpoint.py `fit_draft_head`, on the first
`--fit-tokens` tokens of each): a stand-in for trained MTP weights, whose acceptance rate this
script reports next to the speed it buys. A real DeepSeek-V3 MTP layer is reported to be accepted
85-90% of the time (DeepSeek-V3 technical report, section 5.4.3).

One run, the same prompts and greedy settings (EOS ignored) for each row:
    HF generate    transformers' `generate`, one prompt at a time (the peer)
    k = 0          our engine without drafts
    k = 1, 2, 3    our engine with `num_speculative_tokens` = k
It prints output tokens/s, engine steps, drafts accepted / verified, and the speed-up over k = 0;
every engine row must give transformers' tokens (checked).

Run
    python benchmarks/speculative_decoding.py                     # batch 1, then batch 8
    python benchmarks/speculative_decoding.py --batch-sizes 1 --new-tokens 128 --json-out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` helpers

import ksana_llm as kt  # noqa: E402
from benchmarks.engine_steps import count_steps  # noqa: E402
from ksana_llm import GenerationConfig, Model  # noqa: E402
from tests.deepseek_checkpoint import (  # noqa: E402
    deepseek_config,
    fit_draft_head,
    greedy_continuations,
    hf_mtp_layer,
    mtp_embedding,
    randomize,
    save_with_mtp,
)


def build(root: Path, args: argparse.Namespace) -> tuple[torch.nn.Module, Path, list[list[int]]]:
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = deepseek_config(vocab_size=args.vocab, hidden_size=args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=8,
                             num_key_value_heads=8, max_position_embeddings=1024)
    hf = DeepseekV3ForCausalLM(config).eval()
    randomize(hf)
    layer = hf_mtp_layer(config)
    embed = mtp_embedding(hf)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, args.vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 48, (max(args.batch_sizes),), generator=gen)]
    fit_on = greedy_continuations(hf, prompts, args.fit_tokens)
    head = fit_draft_head(hf, layer, embed, [p + c for p, c in zip(prompts, fit_on)], steps=400)
    return hf, save_with_mtp(hf, layer, embed, head, root / "deepseek_mtp"), prompts


def run_engine(model: Model, prompts: list[list[int]], k: int, new_tokens: int
               ) -> tuple[float, list[list[int]], int, int, int]:
    """(seconds, tokens, steps, drafts verified, drafts accepted)."""
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    with kt.Engine(model, generation_config=config, num_speculative_tokens=k,
                   num_device_blocks=2048, block_token_num=16) as engine:
        engine.generate_outputs([prompts[0]])  # warm-up
        base = engine.stats()
        # Count the engine thread's steps (a benchmark-only peek at the core).
        counter = count_steps(engine)
        start = time.perf_counter()
        outputs = engine.generate_outputs(prompts)
        seconds = time.perf_counter() - start
        stats = engine.stats()
    return (seconds, [o.token_ids for o in outputs], counter["steps"],
            stats.num_draft_tokens - base.num_draft_tokens,
            stats.num_accepted_draft_tokens - base.num_accepted_draft_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--fit-tokens", type=int, default=48,
                        help="continuation tokens the MTP head is fitted to")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda (the MTP head is fitted on the CPU either way)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, folder, all_prompts = build(Path(tmp), args)
        model = Model.from_pretrained(folder, device=args.device, dtype="float32",
                                      progress=False)
        hf.to(args.device)  # the peer runs where the engine does
        for batch in args.batch_sizes:
            prompts = all_prompts[:batch]
            start = time.perf_counter()
            expected = greedy_continuations(hf, prompts, args.new_tokens)
            hf_seconds = time.perf_counter() - start
            total = batch * args.new_tokens
            print(f"\nbatch {batch}, {args.new_tokens} new tokens each "
                  f"(DeepSeek-V3 shape: hidden {args.hidden}, {args.layers} layers, "
                  f"vocab {args.vocab}, float32, {args.device})")
            print(f"{'':14}{'tok/s':>9}{'steps':>7}{'accepted':>14}{'vs k=0':>8}{'vs HF':>8}")
            print(f"{'HF generate':14}{total / hf_seconds:9.1f}{'':>7}{'':>14}{'':>8}{1.0:8.2f}")
            baseline = None
            for k in (0, 1, 2, 3):
                seconds, tokens, steps, drafts, accepted = run_engine(model, prompts, k,
                                                                      args.new_tokens)
                if tokens != expected:
                    raise SystemExit(f"k={k}: tokens differ from transformers' greedy output")
                baseline = baseline or seconds
                rate = f"{accepted}/{drafts}" if drafts else "-"
                print(f"{f'k = {k}':14}{total / seconds:9.1f}{steps:7d}{rate:>14}"
                      f"{baseline / seconds:8.2f}{hf_seconds / seconds:8.2f}")
                results.append({"device": args.device, "batch": batch, "k": k,
                                "tokens_per_s": total / seconds,
                                "steps": steps, "drafts": drafts, "accepted": accepted,
                                "speedup_vs_k0": baseline / seconds,
                                "speedup_vs_hf": hf_seconds / seconds})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
