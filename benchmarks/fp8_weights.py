"""Quantized weights: what `quantization="fp8"` and `"w8a8_int8"` save (weight memory) and cost
or gain (accuracy, and on a CPU, speed), against the model's own dtype and against
transformers, in one run.

For the model's dtype ("auto"), FP8 projection weights ("fp8"; per-row scales, quantized as they
load) and int8 ones with int8 activations ("w8a8_int8"; per-row weight scales, each projection's
input quantized per token) the script reports:
- weight memory: the projections' bytes and the whole model's (parameters and buffers);
- accuracy: perplexity of a fixed English text (one prefill through `/forward`) and how many of
  the throughput run's greedy tokens equal the model-dtype engine's; transformers' perplexity on
  the full-precision weights is the peer;
- speed: output tokens/s of `--num-requests` requests submitted at once (random-id prompts of
  [--min-len, --max-len] tokens, `--output-len` new tokens, EOS ignored), and batch-1 decode
  ms/token (one prompt, `--b1-new-tokens` tokens), with transformers' `generate` at batch 1 as
  the peer.
On a CPU the FP8 projections are dequantized to the compute dtype at every matmul (there is no
FP8 CPU matmul), so FP8 is a memory saving that costs time there; on a GPU decode batches take
the Triton W8A16 kernel, which reads half the bytes of a 16-bit weight
(`benchmarks/gpu/run.sh engine-qwen3-fp8w` measures it). W8A8 multiplies int8 codes by int8
codes on a CPU (`torch._int_mm`), a byte per weight read and no dequantization.

With `--checkpoints`, the model is also written as quantized checkpoints -- FP8 in the hub's
layout (64x64 block scales), llm-compressor's int4 W4A16, int8 W8A16 (groups of 64) and int8
W8A8 (per-row scales, int8 activations per token), written by the
compressed-tensors library, GPTQ int4 and int8 by AutoGPTQ (groups of 64, in order, and int4
in activation order) and AWQ int4 packed by AutoAWQ -- and each is read by our engine and by
transformers (for those it cannot read on a CPU: transformers holding the writing library's
own dequantization, and for W8A8 quantizing each projection's input with the library's own
functions): weight memory, batch-1 decode ms/token (ours) and both perplexities
(they should agree: the same numbers, read twice).

Run
    python benchmarks/fp8_weights.py [--checkpoints]   # CPU, fp32, SmolLM2-135M-Instruct
    python benchmarks/fp8_weights.py --device cuda --dtype bfloat16 --model /models/Qwen3-8B
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

import ksana_llm as kt
from ksana_llm.layers.linear import QuantizedStorage

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file, or with -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.accuracy import (TEXT, device_sync, perplexity_hf,  # noqa: E402
                                 perplexity_of, perplexity_ours, random_prompts)
from benchmarks.ngram_speculation import hf_greedy  # noqa: E402

WEIGHTS = ("auto", "fp8", "w8a8_int8")


def weight_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(the projections' weight + scale (+ zero point) bytes, every parameter's and buffer's
    bytes)."""
    def size(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    projections = sum(size(m.weight) + size(m.weight_scale) + size(m.weight_zero_point)
                      for m in module.modules() if isinstance(m, QuantizedStorage))
    total = sum(size(t) for t in (*module.parameters(), *module.buffers()))
    return projections, total


def batch1_ms_per_token(engine: kt.Engine, prompt: list[int], new_tokens: int,
                        device: torch.device) -> float:
    """Decode time per token at batch 1: the whole request minus a 1-token request's time
    (its prefill), over the tokens after the first."""
    def timed(n: int) -> float:
        config = kt.GenerationConfig(max_new_tokens=n, ignore_eos=True, temperature=0)
        device_sync(device)
        start = time.perf_counter()
        engine.generate_outputs([prompt], config, use_tqdm=False)
        device_sync(device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return (timed(new_tokens) - timed(1)) / (new_tokens - 1) * 1e3


def checkpoint_accuracy(source: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Perplexity of the model written as quantized checkpoints, ours and the peer's."""
    import tempfile

    from tests.quantized_checkpoints import (with_library_activation_quantization,
                                             write_compressed_tensors, write_fp8_checkpoint)

    from transformers import AutoModelForCausalLM

    from tests.gptq_awq_checkpoints import hold

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        fp8 = Path(root) / "fp8"
        write_fp8_checkpoint(source, fp8, (64, 64))
        results["fp8 checkpoint (64x64 blocks)"] = _read_twice(fp8, args, None)
        compressed = {  # transformers reads int4 W4A16 itself, not the int8 formats on a CPU
            "int4 W4A16 checkpoint (groups of 64)": ("int4", False),
            "int8 W8A16 checkpoint (groups of 64)": ("int8", True),
            "int8 W8A8 checkpoint (per row; int8 activations per token)": ("w8a8", True)}
        for name, (strategy, peer_holds) in compressed.items():
            folder = Path(root) / strategy
            held = write_compressed_tensors(source, folder, strategy, group_size=64)
            _copy_tokenizer(source, folder)
            peer = hold(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(),
                        held) if peer_holds else None
            if strategy == "w8a8":
                peer = with_library_activation_quantization(peer, folder)
            results[name] = _read_twice(folder, args, peer)
        results.update(packed_checkpoint_accuracy(source, Path(root), args))
    return results


def _copy_tokenizer(source: Path, folder: Path) -> None:
    for item in source.iterdir():
        if item.is_file() and not (folder / item.name).exists():
            shutil.copy(item, folder / item.name)


def packed_checkpoint_accuracy(source: Path, root: Path, args: argparse.Namespace
                               ) -> dict[str, dict]:
    """GPTQ checkpoints written by AutoGPTQ (its GPTQ algorithm, calibrated on
    ksana_llm/bench/sample_prompts.csv; groups of 64, in order and in activation order) and an AWQ
    one packed by AutoAWQ (round-to-nearest groups of 64). transformers cannot read them on a
    CPU, so the peer is transformers' model holding the library's own dequantization."""
    import csv

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.gptq_awq_checkpoints import hold, write_awq, write_gptq

    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts_csv = Path(__file__).parents[1] / "ksana_llm" / "bench" / "sample_prompts.csv"
    with open(prompts_csv, encoding="utf-8") as f:
        calibration = [tokenizer.encode(row[0]) for row in list(csv.reader(f))[1:]]
    writers = {
        "GPTQ int4 (AutoGPTQ, groups of 64)": lambda hf, folder: write_gptq(
            hf, source, folder, group_size=64, calibration=calibration),
        "GPTQ int4 activation order (AutoGPTQ, groups of 64)": lambda hf, folder: write_gptq(
            hf, source, folder, group_size=64, sym=False, desc_act=True,
            calibration=calibration),
        "GPTQ int8 (AutoGPTQ, groups of 64)": lambda hf, folder: write_gptq(
            hf, source, folder, bits=8, group_size=64, calibration=calibration),
        "AWQ int4 (AutoAWQ packing, groups of 64)": lambda hf, folder: write_awq(
            hf, source, folder, group_size=64),
    }
    results: dict[str, dict] = {}
    for index, (name, write) in enumerate(writers.items()):
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        folder = root / f"packed{index}"
        peer = hold(hf, write(hf, folder))
        _copy_tokenizer(source, folder)
        results[name] = _read_twice(folder, args, peer)
        del hf, peer
    return results


def _read_twice(folder: Path, args: argparse.Namespace, peer: torch.nn.Module | None) -> dict:
    """Weight memory, perplexity and batch-1 decode ms/token of a checkpoint read by our
    engine, and the peer's perplexity (transformers reading the folder, or the given model)."""
    model = kt.Model.from_pretrained(folder, device=args.device, dtype=args.dtype,
                                     progress=False)
    ids = model.tokenizer.encode(TEXT)
    b1_prompt = random_prompts(model.tokenizer, model.vocab_size, 1, args.b1_prompt_len,
                               args.b1_prompt_len, args.seed + 1)[0]
    with kt.Engine(model) as engine:
        ours = perplexity_ours(engine, ids)
        b1 = batch1_ms_per_token(engine, b1_prompt, args.b1_new_tokens, model.device)
    projections, total = weight_bytes(model.module)
    theirs = perplexity_hf(model, ids) if peer is None \
        else perplexity_of(peer.to(model.device), ids, model.device)
    return {"projection_mib": projections / 2**20, "model_mib": total / 2**20,
            "perplexity": ours, "hf_perplexity": theirs, "batch1_ms_per_token": b1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--b1-prompt-len", type=int, default=32)
    p.add_argument("--b1-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoints", action="store_true",
                   help="also write FP8, int4 and int8 checkpoints of the model and compare our "
                        "perplexity on them with transformers'")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    results: dict[str, dict] = {}
    baseline_tokens: list[list[int]] | None = None
    for weights in WEIGHTS:
        model = kt.Model.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                         progress=False,
                                         quantization=None if weights == "auto" else weights)
        prompts = random_prompts(model.tokenizer, model.vocab_size, args.num_requests,
                                 args.min_len, args.max_len, args.seed)
        b1_prompt = random_prompts(model.tokenizer, model.vocab_size, 1, args.b1_prompt_len,
                                   args.b1_prompt_len, args.seed + 1)[0]
        projections, total = weight_bytes(model.module)
        config = kt.GenerationConfig(max_new_tokens=args.output_len, ignore_eos=True,
                                     temperature=0)
        with kt.Engine(model, generation_config=config) as engine:
            engine.generate_outputs([prompts[0][:8]], use_tqdm=False)  # warm-up
            device_sync(model.device)
            start = time.perf_counter()
            outputs = engine.generate_outputs(prompts, use_tqdm=False)
            device_sync(model.device)
            wall = time.perf_counter() - start
            b1 = batch1_ms_per_token(engine, b1_prompt, args.b1_new_tokens, model.device)
            perplexity = perplexity_ours(engine, model.tokenizer.encode(TEXT))
        tokens = [o.token_ids for o in outputs]
        if baseline_tokens is None:
            baseline_tokens = tokens
        same = sum(a == b for out, ref in zip(tokens, baseline_tokens) for a, b in zip(out, ref))
        results[weights] = {
            "projection_mib": projections / 2**20, "model_mib": total / 2**20,
            "wall_s": wall, "output_tok_s": sum(map(len, tokens)) / wall,
            "batch1_ms_per_token": b1, "perplexity": perplexity,
            "tokens_equal_auto": same / sum(map(len, baseline_tokens)),
        }
        if weights == "auto":
            hf_ppl = perplexity_hf(model, model.tokenizer.encode(TEXT))
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype) \
                .to(model.device).eval()
            hf_greedy(hf, [b1_prompt], 2, model.device)  # warm-up
            hf_full = hf_greedy(hf, [b1_prompt], args.b1_new_tokens, model.device)[0]
            hf_one = hf_greedy(hf, [b1_prompt], 1, model.device)[0]
            hf_b1 = (hf_full - hf_one) / (args.b1_new_tokens - 1) * 1e3
            del hf
        source = model.path
        del model
    checkpoints = checkpoint_accuracy(source, args) if args.checkpoints else {}

    base = results["auto"]
    print(f"\n{args.num_requests} requests, prompts [{args.min_len}, {args.max_len}], "
          f"{args.output_len} output tokens; batch 1: {args.b1_prompt_len}-token prompt, "
          f"{args.b1_new_tokens} tokens; {args.model or 'SmolLM2-135M-Instruct'} {args.dtype} "
          f"on {args.device}\n")
    print("| weights | projections MiB | model MiB | output tok/s | vs auto | batch-1 ms/tok | "
          "perplexity | tokens = auto's |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['projection_mib']:.1f} | {r['model_mib']:.1f} | "
              f"{r['output_tok_s']:.1f} | {r['output_tok_s'] / base['output_tok_s']:.2f}x | "
              f"{r['batch1_ms_per_token']:.1f} | {r['perplexity']:.3f} | "
              f"{100 * r['tokens_equal_auto']:.0f}% |")
    print(f"| transformers (peer, {args.dtype}) | - | - | - | - | {hf_b1:.1f} | {hf_ppl:.3f} | - |")
    if checkpoints:
        print("\n| checkpoint | projections MiB | model MiB | batch-1 ms/tok | "
              "perplexity (ours) | perplexity (transformers) |")
        print("|---|---|---|---|---|---|")
        for name, r in checkpoints.items():
            print(f"| {name} | {r['projection_mib']:.1f} | {r['model_mib']:.1f} | "
                  f"{r['batch1_ms_per_token']:.1f} | {r['perplexity']:.3f} | "
                  f"{r['hf_perplexity']:.3f} |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results, "hf_perplexity": hf_ppl,
                       "hf_batch1_ms_per_token": hf_b1, "checkpoints": checkpoints}, f,
                      indent=2)


if __name__ == "__main__":
    main()
