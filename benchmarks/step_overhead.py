"""Host time of one decode step: what the Python step loop costs besides the model.

On a GPU the forward of a small model at batch 256 takes a few milliseconds, and every
millisecond the host spends scheduling, building the batch, sampling bookkeeping, detokenizing
and delivering outputs is a millisecond the device waits (issue 5: "a step loop that keeps the
GPU busy"). That host work is the same Python on a CPU, so it can be measured here: this script
serves `--num-seqs` requests that all decode together on a tiny random Llama (hidden 64, 2
layers) with the default model's tokenizer and vocabulary, and times each phase of every pure
decode step.

Phases (wall time per decode step, median over the steps where all sequences decode)
    schedule   `Scheduler.schedule`: admission, block allocation, preemption checks
    slices     `EngineCore._slice` for every scheduled sequence
    build      `ModelRunner.build`: token ids, positions, block tables, attention metadata
    forward    the model (tiny here: stands for device time)
    lm_head    `compute_logits` (vocabulary-wide: device time)
    sample     `Sampler.sample` + the device-to-host copy of the chosen tokens
    process    per-sequence bookkeeping: append, stop checks, detokenize, `StepOutput`s
    deferred   (--overlap on) the previous step's detokenizing and `StepOutput`s, done after
               this step's forward is launched
    resolve    (--async-scheduling on) reading back the previous step's tokens, appending and
               checking them, detokenizing, `StepOutput`s: after this step's launch
    dispatch   `Engine._dispatch`: handing outputs to the waiting requests (with --overlap on,
               mostly from inside the next step, after its launch)
    host       everything except forward, lm_head and sample: the step loop's own overhead
    idle       the part of `host` the device waits for: `host` less what runs after the launch
               (deferred work and in-step dispatch) -- on a GPU, hidden under the forward as
               long as that is longer. With --async-scheduling on every step is launched while
               the one before is still queued, so no part of `host` is serial: the device waits
               only for what `host` exceeds its step time by (not measurable here)

Run
    python benchmarks/step_overhead.py                  # 256 sequences, 64 decode steps
    python benchmarks/step_overhead.py --api async      # outputs read from asyncio, as the server does
    python benchmarks/step_overhead.py --overlap on     # output processing overlapped
    python benchmarks/step_overhead.py --overlap on --async-scheduling on   # the CUDA default
    python benchmarks/step_overhead.py --penalties on --prompt-tokens 1000   # penalised rows
    python benchmarks/step_overhead.py --num-seqs 64 --json-out /tmp/overhead.json

With --penalties on every request has repetition, presence and frequency penalties: the
sampler reads each row's ids from its device table (`runner/token_history.py`), so `sample`
grows with the rows' history lengths only through gathers on the device.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ksana_llm as kt

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gc_pauses import GcPauses  # noqa: E402

DEVICE_PHASES = ("forward", "lm_head", "sample")
# Host phases that, with overlapped output processing, run while the device computes the step.
OVERLAPPED_PHASES = ("deferred", "resolve", "dispatch_in_step")
VOCAB_SIZE = 8192


class PhaseClock:
    """Accumulates wall time per phase within one step; `close_step` files the step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[int, dict[str, float]]] = []  # (num decoding seqs, phases)
        self.in_step = False
        self.inner = 0.0  # time in timed phases during the current step call

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        """Time every call of `obj.name` (an instance attribute shadows the method)."""
        method = getattr(obj, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            in_step = self.in_step
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.current[f"{phase}_in_step" if in_step and phase == "dispatch" else phase] += spent
                if in_step:
                    self.inner += spent

        setattr(obj, name, timed)

    def close_step(self, num_decoding: int) -> None:
        """File the current step: "process" is the step's time not spent in a timed phase."""
        phases = dict(self.current)
        total = phases.pop("step", 0.0)
        phases["process"] = max(0.0, total - self.inner)
        self.steps.append((num_decoding, phases))
        self.current = defaultdict(float)
        self.inner = 0.0


def tiny_model_dir(folder: Path, with_tokenizer: bool = True) -> Path:
    """A random 2-layer Llama with the default model's tokenizer and the first `VOCAB_SIZE` ids of
    its vocabulary (ordinary BPE pieces): real detokenization work, while the LM head and the
    sampler (device work) stay small enough not to drown the host phases in timing noise.
    Without the tokenizer (`with_tokenizer` False) the engine makes no text, as on the GPU
    benchmark's random checkpoints, and the default model's package is not needed (a GPU
    machine has none)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ksana_llm.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)) if with_tokenizer \
        else None
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                         max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id if tokenizer else 1,
                         eos_token_id=tokenizer.eos_token_id if tokenizer else 2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def instrument(engine: kt.Engine, clock: PhaseClock) -> Callable[[], None]:
    """Time the phases of every step; returns the function that files the last step."""
    core, runner = engine._core, engine._core.runner
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core, "_slice", "slices")
    clock.wrap(runner, "build", "build")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner.model, "compute_logits", "lm_head")
    clock.wrap(core.sampler, "sample", "sample")
    clock.wrap(engine, "_dispatch", "dispatch")
    clock.wrap(core, "_drain_deferred", "deferred")
    clock.wrap(core, "_resolve_in_flight", "resolve")
    step = core.step
    pending: list[int] = []  # the decoding count of the step whose dispatch is still to come

    def close() -> None:
        if pending:
            clock.close_step(pending.pop())

    def timed_step(*args: Any, **kwargs: Any) -> list:
        close()  # the previous step's outputs have been dispatched by now
        decoding = sum(1 for s in core.scheduler.running
                       if s.num_computed_tokens >= s.num_tokens - 1)
        start = time.perf_counter()
        clock.in_step = True
        try:
            outputs = step(*args, **kwargs)
        finally:
            clock.in_step = False
        clock.current["step"] += time.perf_counter() - start
        pending.append(decoding)
        return outputs

    core.step = timed_step
    return close


async def generate_async(engine: kt.Engine, prompts: list[list[int]],
                         config: kt.GenerationConfig) -> None:
    await asyncio.gather(*(engine.generate_output_async(p, config) for p in prompts))


def summarize(clock: PhaseClock, num_seqs: int) -> dict[str, float]:
    full = [phases for n, phases in clock.steps if n == num_seqs and "build" in phases]
    if not full:
        raise SystemExit("no step decoded every sequence at once; raise --num-blocks")
    names = sorted({k for p in full for k in p})
    median = {k: statistics.median(p.get(k, 0.0) for p in full) * 1e3 for k in names}
    host = [sum(v for k, v in p.items() if k not in DEVICE_PHASES) for p in full]
    idle = [h - sum(p.get(k, 0.0) for k in OVERLAPPED_PHASES) for h, p in zip(host, full)]
    median["host"] = statistics.median(host) * 1e3
    median["idle"] = statistics.median(idle) * 1e3
    median["steps"] = len(full)
    return median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="new tokens per request")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--api", choices=("sync", "async"), default="sync",
                        help="collect outputs with blocking handles, or from an asyncio loop "
                             "(the server's path)")
    parser.add_argument("--overlap", choices=("on", "off"), default="off",
                        help="overlap output processing with the next step (the engine's default "
                             "on CUDA; off on a CPU, where nothing runs concurrently)")
    parser.add_argument("--async-scheduling", choices=("on", "off"), default="off",
                        help="launch each step before the previous step's tokens are read back "
                             "(the engine's default on CUDA)")
    parser.add_argument("--prompt-tokens", type=int, default=24, help="tokens per prompt")
    parser.add_argument("--penalties", choices=("on", "off"), default="off",
                        help="repetition, presence and frequency penalties on every request")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="a model folder without a tokenizer: no detokenizing, as in the GPU "
                             "benchmark's workload (run.sh host-overhead, on the GPU's host)")
    parser.add_argument("--freeze-gc-heap", choices=("on", "off"), default="on",
                        help="the engine's freeze_gc_heap (on by default): start-up objects "
                             "out of the garbage collector's full passes")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = kt.Model.from_pretrained(str(tiny_model_dir(Path(tmp), not args.no_tokenizer)),
                                         device="cpu", dtype="float32", progress=False,
                                         skip_tokenizer_init=args.no_tokenizer)
    engine = kt.Engine(model, max_num_seqs=args.num_seqs, max_batch_size=16384,
                       num_device_blocks=args.num_seqs * (
                           (args.prompt_tokens + args.steps) // 16 + 4),
                       max_model_len=args.prompt_tokens + args.steps + 16,
                       overlap_output_processing=args.overlap == "on",
                       async_scheduling=args.async_scheduling == "on",
                       freeze_gc_heap=args.freeze_gc_heap == "on")
    penalties = (dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3)
                 if args.penalties == "on" else {})
    config = kt.GenerationConfig(max_new_tokens=args.steps, ignore_eos=True, **penalties)
    # Token-id prompts (ordinary pieces) inside the tiny model's vocabulary.
    ids = torch.randint(256, VOCAB_SIZE, (args.num_seqs, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(0))
    prompts = ids.tolist()
    with engine:
        engine.generate(prompts[:4], config, use_tqdm=False)  # warm-up
        clock = PhaseClock()
        close_last_step = instrument(engine, clock)
        with GcPauses() as gc_pauses:
            start = time.perf_counter()
            if args.api == "sync":
                engine.generate(prompts, config, use_tqdm=False)
            else:
                asyncio.run(generate_async(engine, prompts, config))
            wall = time.perf_counter() - start
        close_last_step()
    result = summarize(clock, args.num_seqs)
    steps = int(result.pop("steps"))
    ahead = args.async_scheduling == "on"
    if ahead:
        result.pop("idle")  # nothing is serial: see the module docstring
    print(f"{args.num_seqs} sequences of {args.prompt_tokens} prompt tokens decoding together "
          f"({args.api} API, overlap {args.overlap}, async scheduling {args.async_scheduling}, "
          f"penalties {args.penalties}, {'no tokenizer' if args.no_tokenizer else 'detokenized'}, "
          f"GC heap {'frozen' if args.freeze_gc_heap == 'on' else 'not frozen'}), "
          f"{steps} decode steps, {wall:.2f} s in all; "
          "median ms per decode step:")
    notes = {name: " (device work on a GPU)" for name in DEVICE_PHASES}
    notes.update(deferred=" (after the launch)", resolve=" (after the launch)",
                 dispatch_in_step=" (after the launch)", idle=" (host time the device waits for)")
    for name in ("schedule", "slices", "build", "forward", "lm_head", "sample", "process",
                 "deferred", "resolve", "dispatch", "dispatch_in_step", "host", "idle"):
        if name in result or name != "idle":
            print(f"  {name:<16} {result.get(name, 0.0):8.2f}{notes.get(name, '')}")
    if ahead:
        print(f"  host per sequence: {1e3 * result['host'] / args.num_seqs:.1f} us, all of it "
              "while the step in flight computes: the device waits only when its step is shorter")
    else:
        print(f"  host per sequence: {1e3 * result['host'] / args.num_seqs:.1f} us, of which the "
              f"device waits for {1e3 * result['idle'] / args.num_seqs:.1f} us")
    pauses = gc_pauses.summary()
    print(f"  garbage collector: {gc_pauses.describe()} in the run; "
          f"{pauses['total_ms'] / max(steps, 1):.2f} ms per decode step on average (outside the "
          "medians above)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"num_seqs": args.num_seqs, "api": args.api,
                                             "overlap": args.overlap,
                                             "async_scheduling": args.async_scheduling,
                                             "prompt_tokens": args.prompt_tokens,
                                             "penalties": args.penalties,
                                             "tokenizer": not args.no_tokenizer,
                                             "freeze_gc_heap": args.freeze_gc_heap,
                                             "gc": pauses,
                                             "decode_steps": steps,
                                             "ms_per_step": result}, indent=2))


if __name__ == "__main__":
    main()
