"""`ksana-llm generate "..."`, `ksana-llm chat` (interactive, streaming, with the chat template),
`ksana-llm serve`, `ksana-llm bench` (the load client: KsanaLLM's benchmark flags) and the other
commands listed by `ksana-llm --help`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ksana_llm import cli_args


def _generation_config(args: argparse.Namespace):
    from ksana_llm.generation_config import GenerationConfig

    # 0 is greedy (vLLM's rule); any other value is checked by GenerationConfig, so a negative
    # or NaN temperature is an error, not a quiet fall-back to greedy.
    sample = args.temperature is not None and args.temperature != 0
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=sample,
                            temperature=args.temperature if sample else 1.0, top_p=args.top_p,
                            top_k=args.top_k, repetition_penalty=args.repetition_penalty,
                            seed=args.seed)


def _engine(args: argparse.Namespace):
    from ksana_llm.api.engine import Engine

    return Engine(args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                  generation_config=_generation_config(args),
                  num_speculative_tokens=args.num_speculative_tokens,
                  speculative_method=args.speculative_method,
                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                  trust_remote_code=bool(args.trust_remote_code))


def _render_chat(engine, messages: list[dict[str, str]]) -> str | list[int]:
    if getattr(engine.tokenizer, "chat_template", None):
        return engine.render_chat(messages)  # token ids: the template holds the special tokens
    # No template: plain transcript, so base models still answer something sensible.
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def cmd_generate(args: argparse.Namespace) -> int:
    with _engine(args) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = _render_chat(engine, [{"role": "user", "content": prompt}])
        for delta in engine.generate(prompt, stream=True):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with _engine(args) as engine:
        messages: list[dict[str, str]] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        print("ksana-llm chat — empty line or Ctrl-D to quit, /reset to start over.", flush=True)
        while True:
            try:
                user = input("you> ").strip()
            except EOFError:
                print()
                break
            if not user:
                break
            if user == "/reset":
                messages = messages[:1] if args.system else []
                continue
            messages.append({"role": "user", "content": user})
            sys.stdout.write("assistant> ")
            answer = []
            for delta in engine.generate(_render_chat(engine, messages), stream=True):
                answer.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(answer)})
    return 0


def cmd_calibrate_kv_scales(args: argparse.Namespace) -> int:
    from ksana_llm.api.kv_calibration import calibrate_kv_scales, write_kv_cache_scales
    from ksana_llm.api.model import Model
    from ksana_llm.loader.kv_scales import KV_SCALES_FILENAME

    model = Model.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    out = Path(args.out) if args.out else model.path / KV_SCALES_FILENAME
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; pass --force to replace it")
    texts = [Path(f).read_text(encoding="utf-8") for f in args.text_file] or None
    scales = calibrate_kv_scales(model, texts)
    model_type = str(getattr(model.hf_config, "model_type", ""))
    print(f"wrote {write_kv_cache_scales(out, scales, model_type=model_type)}: "
          f"{len(scales)} layers, scales {min(scales):.4g} .. {max(scales):.4g}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ksana_llm.server.app import run_server

    return run_server(args)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from ksana_llm.server.batch_runner import run_batch

    return run_batch(args)


def cmd_bench(argv: Sequence[str]) -> int:
    from ksana_llm.bench.client import main as bench_main

    return bench_main(argv, prog="ksana-llm bench")


def cmd_router(args: argparse.Namespace) -> int:
    from ksana_llm.server.router import run_router

    return run_router(args)


def _with_flags_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     argv: list[str]) -> argparse.Namespace:
    """`args` parsed again over the values of `--config FILE` (vLLM's): the file's flags are
    the command's defaults, the command line's win."""
    from ksana_llm.cli_config import config_file_values

    command = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    given_model = bool(getattr(args, "model_tag", None) or getattr(args, "model", None))
    from_file = config_file_values(command, args.flags_file, given_model)
    # The subcommand's parser itself: the top-level one would parse it into a fresh namespace,
    # defaults over the file's values. (The command is argv's first word: the top level takes
    # no flags.)
    at = argv.index(args.command)
    parsed = command.parse_args(argv[at + 1:], namespace=from_file)
    parsed.command = args.command
    return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ksana-llm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    cli_args.add_model_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive streaming chat")
    chat.add_argument("--system", default=None, help="system prompt")
    cli_args.add_model_args(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # `ksana-llm serve MODEL`, as `vllm serve MODEL`; the same as --model.
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF model folder or .gguf file (as --model)")
    cli_args.add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    batch = sub.add_parser("run-batch", help="answer a JSONL file of OpenAI requests (OpenAI's "
                                             "batch format) in one process")
    # Required, but checked by run_batch: a --config file may give them (argparse's check
    # would come before the file is read).
    batch.add_argument("-i", "--input-file", default=None,
                       help="(required) JSONL: {custom_id, method, url, body} a line")
    batch.add_argument("-o", "--output-file", default=None,
                       help="(required) JSONL: {id, custom_id, response, error} a line, in input "
                            "order")
    batch.add_argument("--max-concurrency", type=int, default=None,
                       help="requests in flight at once (default: --max-num-seqs)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli_args.add_serve_args(batch, listen=False)
    batch.set_defaults(func=cmd_run_batch)
    calibrate = sub.add_parser(
        "calibrate-kv-scales", help="measure per-layer scales for an fp8_e4m3 KV cache and "
                                    "write kv_cache_scales.json")
    calibrate.add_argument("--model", default=None,
                           help="HF model folder or .gguf file (default: embedded SmolLM2)")
    calibrate.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    calibrate.add_argument("--dtype", default="auto",
                           choices=["auto", "float32", "float16", "bfloat16"])
    calibrate.add_argument("--text-file", action="append", default=[], metavar="FILE",
                           help="a calibration prompt (repeat; default: built-in prose, code, "
                                "numbers and Chinese)")
    calibrate.add_argument("--out", default=None,
                           help="where to write (default: kv_cache_scales.json in the model "
                                "folder, where the engine reads it)")
    calibrate.add_argument("--force", action="store_true", help="replace an existing file")
    calibrate.set_defaults(func=cmd_calibrate_kv_scales)
    route = sub.add_parser("router", help="one OpenAI endpoint over prefill and decode servers "
                                          "(prefill/decode disaggregation)")
    cli_args.add_router_args(route)
    route.set_defaults(func=cmd_router)
    # Listed for --help only: main() hands everything after `bench` to the load client's own
    # parser (its flags are KsanaLLM's benchmark_throughput.py flags; `bench --help` lists them).
    sub.add_parser("bench", add_help=False,
                   help="load-test a running server (KsanaLLM's benchmark_throughput.py flags; "
                        "`ksana-llm bench --help`)")
    return parser


# What KLLM_LOG_LEVEL may say (logging's names, any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: Sequence[str] | None = None) -> int:
    level = os.environ.get("KLLM_LOG_LEVEL", "WARNING").upper()
    if level not in LOG_LEVELS:
        print(f"ksana-llm: error: KLLM_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got "
              f"{os.environ['KLLM_LOG_LEVEL']!r}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "flags_file", None):
            args = _with_flags_file(parser, args, argv)
        args.command_line = argv  # as given (data-parallel replicas run it again)
        return args.func(args)
    except (ValueError, OSError) as exc:
        # Bad settings and unreadable files (missing, a folder, corrupt: the loaders name the
        # file): a one-line message, not a traceback.
        print(f"ksana-llm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
