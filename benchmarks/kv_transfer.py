"""Prefill/decode disaggregation: what a decode server pays to start from a prefill server's KV,
against computing the prompt itself.

For each prompt length, on the default model (SmolLM2-135M-Instruct) or `--model`:
    local ms       the decode engine computes the prompt and samples the first token
    transfer ms    the same engine given the prompt's KV (`Request(imported_kv=...)`): it writes
                   the rows into its blocks, computes the last prompt token and samples
    payload MB     the KV on the wire (`TransferredKv.to_bytes`), and the time to write and read
                   that payload (serialize ms, deserialize ms); the network is not counted
    HF prefill ms  the peer in the same run: transformers' forward over the prompt (what any
                   engine pays to prefill it)

Each figure is the median of `--repeats` runs after a warm-up. The engines have prefix caching
off, so every local run really computes the prompt.

Run
    python benchmarks/kv_transfer.py                          # 128 .. 2048 tokens, CPU fp32
    python benchmarks/kv_transfer.py --device cuda --dtype bfloat16 --lengths 1024 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import ksana_llm as kt
from ksana_llm.runner.kv_transfer import TransferredKv


def _median_ms(run: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    model = kt.Model.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                     progress=False)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    blocks = -(-max(args.lengths) // 16) + 8
    engine_kwargs = dict(num_device_blocks=blocks, block_token_num=16, enable_prefix_caching=False,
                         max_step_tokens=max(args.lengths) + 16)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).to(model.device).eval()
    one_token = kt.GenerationConfig(max_new_tokens=1, temperature=0)
    vocab = model.vocab_size
    rows = []
    with kt.Engine(model, **engine_kwargs) as prefill, kt.Engine(model, **engine_kwargs) as decode:
        for length in args.lengths:
            ids = torch.randint(100, vocab - 100, (length,),
                                generator=torch.Generator().manual_seed(length)).tolist()
            kv = prefill.submit(kt.Request(ids, generation_config=one_token,
                                           export_kv=True)).result().exported_kv
            payload = kv.to_bytes()
            local = _median_ms(lambda: decode.submit(kt.Request(
                ids, generation_config=one_token)).result(), args.repeats, sync)
            transfer = _median_ms(lambda: decode.submit(kt.Request(
                ids, generation_config=one_token, imported_kv=kv)).result(), args.repeats, sync)
            serialize = _median_ms(kv.to_bytes, args.repeats, sync)
            deserialize = _median_ms(lambda: TransferredKv.from_bytes(payload), args.repeats, sync)
            with torch.inference_mode():
                prompt = torch.tensor([ids], device=model.device)
                hf_prefill = _median_ms(lambda: hf(prompt), args.repeats, sync)
            row = {"prompt_tokens": length, "local_ms": local, "transfer_ms": transfer,
                   "speedup": local / transfer, "payload_mb": len(payload) / 2**20,
                   "serialize_ms": serialize, "deserialize_ms": deserialize,
                   "hf_prefill_ms": hf_prefill}
            rows.append(row)
            print(f"{length:6d} tokens: local {local:8.1f} ms | from KV {transfer:7.1f} ms "
                  f"({local / transfer:5.1f}x) | payload {row['payload_mb']:7.1f} MB, write "
                  f"{serialize:6.1f} ms, read {deserialize:6.1f} ms | HF prefill {hf_prefill:8.1f} ms",
                  flush=True)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"device": str(model.device), "dtype": str(model.dtype), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
