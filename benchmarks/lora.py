"""LoRA adapters: what serving through adapters costs against the base model, and how the engine
compares with PEFT on transformers (the way most people run an adapter), in one run.

Workload
    `--num-requests` requests submitted at once, each a prompt of random token ids of a length
    drawn from [--min-len, --max-len], `--output-len` new tokens, greedy, EOS ignored. The
    adapters are random PEFT adapters (`--num-adapters`, rank `--rank`, every projection)
    written to a temporary folder.

Rows
    ours, no LoRA          an engine without adapter slots (the baseline)
    ours, LoRA on, base    the same requests on an engine with adapters loaded, none used
    ours, 1 adapter        every request on adapter 0
    ours, N adapters       request i on adapter i % N: every step mixes N adapters
    ours, N on S slots     the same on an engine with S < N slots (`--slots`): adapters take
                           turns, each copied into a slot when its requests get one
    PEFT generate, ...     the peer: PEFT's model, `generate` over the whole batch (left-padded),
                           one adapter, then N adapters through PEFT's mixed-batch `adapter_names`
Each row prints output tokens/s and its ratio to ours without LoRA; the PEFT rows also the ratio
of ours to them, and how many of ours' greedy tokens equal PEFT's for the same requests (the
turn-taking row: its tokens against PEFT's mixed batch, and how many times an adapter was copied
into a slot over all its runs).

Run
    python benchmarks/lora.py                       # CPU, fp32, SmolLM2-135M-Instruct
    python benchmarks/lora.py --device cuda --dtype bfloat16 --num-requests 64 --model DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ksana_llm as kt

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapters(hf_model: torch.nn.Module, folder: Path, count: int, rank: int):
    """Random PEFT adapters saved under folder/adapter{i}; the PEFT model holding them all."""
    from peft import LoraConfig, PeftModel, get_peft_model

    paths = []
    for i in range(count):
        torch.manual_seed(100 + i)
        peft = get_peft_model(hf_model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                   target_modules=TARGETS,
                                                   init_lora_weights=False))
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        paths.append(folder / f"adapter{i}")
        peft.save_pretrained(paths[-1])
        hf_model = peft.unload()  # back to the plain model for the next adapter
    peft = PeftModel.from_pretrained(hf_model, paths[0], adapter_name="adapter0").eval()
    for i, path in enumerate(paths[1:], start=1):
        peft.load_adapter(path, adapter_name=f"adapter{i}")
    return paths, peft


def _workload(vocab: int, args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
    return [rng.integers(3, vocab, int(n)).tolist() for n in lengths]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ours(engine: kt.Engine, prompts: list[list[int]], loras: list[str | None],
          output_len: int, repeats: int) -> tuple[float, list[list[int]]]:
    """The best of `repeats` timed runs, after a warm-up request (the engines run without a
    prefix cache, so every run computes its prompts)."""
    config = kt.GenerationConfig(max_new_tokens=output_len, ignore_eos=True)
    engine.submit(kt.Request(prompts[0], {"max_new_tokens": 2}, lora=loras[0])).result()
    best = float("inf")
    for _ in range(repeats):
        _sync(engine.model.device)
        start = time.perf_counter()
        tokens = [o.token_ids for o in engine.generate_outputs(prompts, config, use_tqdm=False,
                                                               lora=loras)]
        _sync(engine.model.device)
        best = min(best, time.perf_counter() - start)
    return best, tokens


def _peft(peft, prompts: list[list[int]], names: list[str], output_len: int,
          device: torch.device, repeats: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    if len(set(names)) > 1:
        kwargs["adapter_names"] = names
    else:
        peft.set_adapter(names[0])
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = peft.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                **kwargs)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best, [row[width:].tolist() for row in out.cpu()]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=None,
                        help="slots of the turn-taking row (default: half the adapters)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per row; the best "
                                                               "counts")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model = kt.Model.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                     progress=False)
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).to(model.device)
    prompts = _workload(model.vocab_size, args)
    n = args.num_adapters
    names = [f"adapter{i}" for i in range(n)]
    mixed = [names[i % n] for i in range(len(prompts))]
    total_tokens = len(prompts) * args.output_len
    rows: list[dict] = []

    with tempfile.TemporaryDirectory() as tmp:
        paths, peft = _adapters(hf, Path(tmp), n, args.rank)
        modules = {name: str(path) for name, path in zip(names, paths)}
        # No prefix cache: a repeated run would otherwise skip its prompts' prefill.
        settings = dict(enable_prefix_caching=False)
        r = args.repeats
        with kt.Engine(model, **settings) as engine:
            seconds, base_tokens = _ours(engine, prompts, [None] * len(prompts), args.output_len,
                                         r)
            rows.append({"run": "ours, no LoRA", "seconds": seconds})
        with kt.Engine(model, lora_modules=modules, max_lora_rank=args.rank,
                       **settings) as engine:
            seconds, tokens = _ours(engine, prompts, [None] * len(prompts), args.output_len, r)
            rows.append({"run": "ours, LoRA on, base", "seconds": seconds,
                         "same_tokens_as_no_lora": _agreement(tokens, base_tokens)})
            seconds, one_tokens = _ours(engine, prompts, [names[0]] * len(prompts),
                                        args.output_len, r)
            rows.append({"run": "ours, 1 adapter", "seconds": seconds})
            seconds, mixed_tokens = _ours(engine, prompts, mixed, args.output_len, r)
            rows.append({"run": f"ours, {n} adapters", "seconds": seconds})
        slots = args.slots or max(1, n // 2)
        with kt.Engine(model, lora_modules=modules, max_lora_rank=args.rank, max_loras=slots,
                       **settings) as engine:
            seconds, turns_tokens = _ours(engine, prompts, mixed, args.output_len, r)
            rows.append({"run": f"ours, {n} adapters, {slots} slots", "seconds": seconds,
                         "slot_loads": engine.stats().num_lora_slot_loads})
        seconds, peft_one = _peft(peft, prompts, [names[0]] * len(prompts), args.output_len,
                                  model.device, r)
        rows.append({"run": "PEFT generate, 1 adapter", "seconds": seconds,
                     "ours_same_tokens": _agreement(one_tokens, peft_one)})
        seconds, peft_mixed = _peft(peft, prompts, mixed, args.output_len, model.device, r)
        rows.append({"run": f"PEFT generate, {n} adapters", "seconds": seconds,
                     "ours_same_tokens": _agreement(mixed_tokens, peft_mixed)})
        rows[4]["same_tokens_as_peft"] = _agreement(turns_tokens, peft_mixed)

    baseline = total_tokens / rows[0]["seconds"]
    ours_by_peer = {"PEFT generate, 1 adapter": rows[2], f"PEFT generate, {n} adapters": rows[3]}
    # (rows[4], the turn-taking engine, counts its adapters' copies into slots over all runs.)
    print(f"{len(prompts)} requests, prompts {args.min_len}-{args.max_len} tokens, "
          f"{args.output_len} new tokens each; {n} adapters of rank {args.rank}; "
          f"{model.device}, {model.dtype}")
    print(f"{'run':<30}{'tok/s':>9}{'vs no LoRA':>12}{'ours vs it':>12}{'same tokens':>13}")
    for row in rows:
        row["output_tokens_per_s"] = total_tokens / row["seconds"]
        row["vs_no_lora"] = row["output_tokens_per_s"] / baseline
        ours = ours_by_peer.get(row["run"])
        if ours is not None:
            row["ours_speedup"] = ours["seconds"] and row["seconds"] / ours["seconds"]
        same = row.get("ours_same_tokens", row.get("same_tokens_as_no_lora",
                                                   row.get("same_tokens_as_peft")))
        print(f"{row['run']:<30}{row['output_tokens_per_s']:>9.1f}{row['vs_no_lora']:>11.2f}x"
              + (f"{row['ours_speedup']:>11.2f}x" if "ours_speedup" in row else " " * 12)
              + (f"{same:>12.0%}" if same is not None else "")
              + (f"   ({row['slot_loads']} slot loads)" if "slot_loads" in row else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
