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

from ksana_llm import cli_types
from ksana_llm.config import KV_CACHE_DTYPES, KV_ROLES, SPECULATIVE_METHODS, WEIGHT_QUANTIZATIONS

_SPECULATIVE_METHOD_HELP = ("where drafts come from: mtp = the model's MTP layer (DeepSeek V3/R1 "
                            "with MTP weights); ngram = the sequence's own history (prompt "
                            "lookup, any model)")
_QUANTIZATION_HELP = ("fp8: keep the projections' weights as FP8 with per-row scales (half the "
                      "memory of 16-bit weights); w8a8_int8: as int8 with per-row scales, "
                      "their inputs quantized to int8 per token (int8 matmuls on a CPU); "
                      "quantized checkpoints load as they are without it")
_KV_CACHE_DTYPE_HELP = ("KV cache storage: auto = the model's dtype; fp8_e5m2 / fp8_e4m3 (= fp8) "
                        "hold twice the tokens of a 16-bit cache, K/V rounded to FP8")


def _add_tokenizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", "--tokenizer_path", "--tokenizer-path", "--tokenizer_dir",
                        "--tokenizer-dir", dest="tokenizer", default=None, metavar="DIR",
                        help="tokenizer folder to use instead of the model's own (vLLM's "
                             "--tokenizer, KsanaLLM's --tokenizer_path)")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    _add_tokenizer_arg(parser)
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--quantization", "-q", default=None, choices=WEIGHT_QUANTIZATIONS,
                        help=_QUANTIZATION_HELP)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None,
                        help="sample with this temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="speculative decoding: tokens drafted per step (0 = off)")
    parser.add_argument("--speculative-method", default="mtp", choices=SPECULATIVE_METHODS,
                        help=_SPECULATIVE_METHOD_HELP)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help=_KV_CACHE_DTYPE_HELP)


def _generation_config(args: argparse.Namespace):
    from ksana_llm.generation_config import GenerationConfig

    sample = args.temperature is not None and args.temperature > 0
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
                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)


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


def _add_serve_args(parser: argparse.ArgumentParser, *, listen: bool = True) -> None:
    """The server's flags; `listen` False leaves out where and how it listens (run-batch opens
    no port)."""
    parser.add_argument("--config_file", "--config-file", dest="config_file", default=None,
                        help="KsanaLLM YAML config; the flags below override it")
    parser.add_argument("--model", default=None,
                        help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    _add_tokenizer_arg(parser)
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the name clients pass as `model` (default: the model folder's "
                             "name); more names are aliases, the first is the one reported")
    if listen:
        _add_listen_args(parser)
    parser.add_argument("--api-key", default=os.environ.get("KLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $KLLM_API_KEY, else no key)")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template file (default: the tokenizer's)")
    parser.add_argument("--max-body-bytes", type=cli_types.positive_int, default=None,
                        help="largest request body accepted, else 413 (default: 2 MiB)")
    parser.add_argument("--shutdown-timeout", type=cli_types.non_negative_float, default=5.0,
                        help="seconds to let in-flight requests finish on SIGTERM; then they fail with 503")
    # Output parsing (names are checked at start-up, before the model loads).
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); '
                             "needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help="how tool calls are read from model text: hermes, qwen3, "
                             "llama3_json, deepseek_v3, deepseek_v31")
    parser.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                        help="a Python file defining tool-call parsers of one's own "
                             "(ksana_llm.server.tool_parsers.ToolParser subclasses with a "
                             "`name`), which --tool-call-parser can then name")
    parser.add_argument("--reasoning-parser", default=None,
                        help="fill reasoning_content from <think>...</think>: deepseek_r1, qwen3")
    parser.add_argument("--max-logprobs", type=int, default=None,
                        help="largest logprobs / top_logprobs / prompt_logprobs a request may "
                             "ask for (default: 20)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="name every logprob token token_id:<id> (as each request may ask)")
    _add_cors_args(parser)
    parser.add_argument("--generation-config", default="auto", metavar="SOURCE",
                        help="sampling defaults for requests that leave them out: 'auto' (the "
                             "model's generation_config.json), 'vllm' (none: OpenAI's), or a "
                             "folder holding a generation_config.json")
    parser.add_argument("--override-generation-config", type=cli_types.json_object, default=None,
                        metavar="JSON", help="defaults on top, e.g. '{\"temperature\": 0.5}' "
                                             "(transformers' key names)")
    parser.add_argument("--max-stored-responses", type=cli_types.non_negative_int, default=None,
                        help="/v1/responses answers kept (store=true) for GET /v1/responses/ID "
                             "and previous_response_id; least recently used dropped first "
                             "(default: 1024; 0: none)")
    # Prefill/decode disaggregation (see README "Prefill/decode disaggregation").
    parser.add_argument("--kv-role", default=None, choices=(*KV_ROLES, "none"),
                        help="take part in disaggregated serving: keep prompts' KV for decode "
                             "servers (prefill), start from a prefill server's KV (decode), or "
                             "both; none: not at all, whatever --config_file's group_role says")
    parser.add_argument("--kv-transfer-ttl", type=cli_types.positive_float, default=None,
                        help="seconds a prefill server keeps KV nobody fetched (default: 300)")
    parser.add_argument("--kv-prefill-url", action="append", default=None, metavar="URL",
                        help="a decode server fetches KV only from these prefill servers "
                             "(repeat for several; default: any URL a request names)")
    # Engine settings (EngineConfig fields); only those given override the config file.
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--num-device-blocks", type=int, default=None, help="KV cache blocks")
    parser.add_argument("--block-token-num", "--block-size", type=int, default=None,
                        dest="block_token_num", help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    parser.add_argument("--max-step-tokens", "--max-num-batched-tokens", type=int, default=None,
                        dest="max_step_tokens", help="token budget per step")
    parser.add_argument("--split-fuse-token-num", type=int, default=None,
                        help="most prompt tokens of one sequence per step (0: the budget only)")
    parser.add_argument("--gpu-memory-utilization", "--block-device-memory-ratio", type=float,
                        default=None, dest="block_device_memory_ratio",
                        help="CUDA: share of device memory for weights, activations and KV "
                             "blocks (default 0.9); CPU: share of free RAM for KV blocks (0.1)")
    parser.add_argument("--reserved-device-memory-ratio", type=float, default=None,
                        help="share of device memory kept free of KV blocks (default 0.01)")
    parser.add_argument("--block-host-memory-factor", type=float, default=None,
                        help="host swap pool, as a multiple of the device blocks (default 1)")
    parser.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                        help="host swap pool in GiB per rank, instead of "
                             "--block-host-memory-factor (vLLM's flag)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="reuse the KV of shared prompt prefixes (default on)")
    parser.add_argument("--preemption-mode", dest="preempt_mode", default=None,
                        type=cli_types.preemption_mode, choices=(0, 1), metavar="{swap,recompute}",
                        help="what a sequence pushed out of the KV cache does (default swap)")
    parser.add_argument("--waiting-timeout-ms", type=int, default=None,
                        help="a request never scheduled within this many ms fails (default: "
                             "no limit)")
    parser.add_argument("--scheduling-policy", dest="scheduler_policy", default=None,
                        type=cli_types.scheduling_policy,
                        metavar="{fifo,priority,MODULE:CLASS}",
                        help="fifo (vLLM's 'fcfs' too); priority: requests' `priority` field "
                             "(lower first) orders admission and preemption; or the import path "
                             "of a ksana_llm.SchedulingPolicy subclass (on PYTHONPATH)")
    parser.add_argument("--max-queue-size", type=int, default=None,
                        help="waiting requests before 429")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="seed of the shared sampling RNG")
    parser.add_argument("--tensor-parallel-size", "--tensor-para-size", type=int, default=None,
                        dest="tensor_parallel_size",
                        help="ranks the model is split across (0 = every visible GPU); YAML "
                             "setting.global.tensor_para_size")
    parser.add_argument("--pipeline-parallel-size", type=int, default=None,
                        dest="pipeline_parallel_size",
                        help="pipeline stages; with WORLD_SIZE > 1 each node is one stage")
    # The GPU step loop (defaults: on for CUDA; see README "Configuration").
    parser.add_argument("--enable-cuda-graphs", action=argparse.BooleanOptionalAction,
                        default=None, help="replay CUDA graphs for decode steps")
    parser.add_argument("--enforce-eager", dest="enable_cuda_graphs", action="store_const",
                        const=False, help="no CUDA graphs (vLLM's flag; = --no-enable-cuda-graphs)")
    parser.add_argument("--cuda-graph-max-batch-size", type=int, default=None,
                        help="largest decode batch replayed from a graph (default: max-num-seqs)")
    parser.add_argument("--attention-backend", default=None, choices=("auto", "torch", "triton"),
                        help="auto: Triton kernels on CUDA, torch SDPA otherwise")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="launch each step before the previous step's tokens are read back")
    parser.add_argument("--overlap-output-processing", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="detokenize and deliver a step's outputs during the next step")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="speculative decoding: tokens drafted per step (0 = off)")
    parser.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                        help=_SPECULATIVE_METHOD_HELP)
    parser.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                        help="speculative decoding pauses in steps of this many sequences or "
                             "more (default: never)")
    parser.add_argument("--prompt-lookup-min", type=int, default=None,
                        help="ngram method: the shortest run of last tokens looked up (default 1)")
    parser.add_argument("--prompt-lookup-max", type=int, default=None,
                        help="ngram method: the longest run of last tokens looked up (default 4)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                        help=_KV_CACHE_DTYPE_HELP)
    parser.add_argument("--quantization", "-q", default=None, choices=WEIGHT_QUANTIZATIONS,
                        help=_QUANTIZATION_HELP)
    # LoRA adapters (vLLM's flags); a request picks one with its `model` field.
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        type=cli_types.lora_module,
                        help="PEFT LoRA adapters to serve, each under its name")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="adapter slots on the device: the most adapters in one step; "
                             "more adapters take turns (default: the number of --lora-modules, "
                             "at most 4)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept in host memory (least recently used dropped and "
                             "read again from their folder; default: all)")
    parser.add_argument("--max-lora-rank", type=int, default=None,
                        help="the largest adapter rank a slot holds (default: 16)")
    parser.add_argument("--lora-max-wait-steps", type=int, default=None,
                        help="steps a request may wait for a LoRA slot before the held "
                             "adapter with the fewest requests stops taking newer ones "
                             "(default: 64; 0: at once)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="mount /v1/load_lora_adapter and /v1/unload_lora_adapter (clients "
                             "then name folders the server reads)")


def _add_listen_args(parser: argparse.ArgumentParser) -> None:
    """Where and how the HTTP server listens (vLLM's and KsanaLLM's spellings accepted too)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=cli_types.port, default=8080)
    parser.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--ssl-certfile", "--ssl_certfile", dest="ssl_certfile", default=None,
                        metavar="PEM", help="serve HTTPS with this certificate (chain); the key "
                                            "too when --ssl-keyfile is not given")
    parser.add_argument("--ssl-keyfile", "--ssl_keyfile", dest="ssl_keyfile", default=None,
                        metavar="PEM", help="the certificate's private key (needs --ssl-certfile)")
    parser.add_argument("--ssl-keyfile-password", default=None, metavar="PASSWORD",
                        help="the passphrase of an encrypted --ssl-keyfile")
    parser.add_argument("--access-log", "--access_log", dest="access_log", action="store_true",
                        help="log every HTTP request (uvicorn's access log), whatever --log-level")
    parser.add_argument("--root-path", "--root_path", dest="root_path", default="",
                        metavar="PREFIX", help="the path prefix a proxy serves this server "
                                               "under (ASGI root_path), e.g. /llm")


def _add_cors_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-origins", type=cli_types.json_strings, default=None, metavar="JSON",
                        help='browser origins allowed to call (CORS), e.g. \'["https://a.b"]\' '
                             '(default: any, as vLLM)')
    parser.add_argument("--allowed-methods", type=cli_types.json_strings, default=None, metavar="JSON",
                        help="CORS methods (default: any)")
    parser.add_argument("--allowed-headers", type=cli_types.json_strings, default=None, metavar="JSON",
                        help="CORS request headers (default: any)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send cookies / credentials")


def _add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill server (serve --kv-role prefill); repeat for several")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode server (serve --kv-role decode); repeat for several")
    _add_listen_args(parser)
    parser.add_argument("--api-key", default=None,
                        help="required of clients, and sent to the servers (which share it)")
    _add_cors_args(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ksana-llm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_model_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive streaming chat")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # `ksana-llm serve MODEL`, as `vllm serve MODEL`; the same as --model.
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF model folder or .gguf file (as --model)")
    _add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    batch = sub.add_parser("run-batch", help="answer a JSONL file of OpenAI requests (OpenAI's "
                                             "batch format) in one process")
    batch.add_argument("-i", "--input-file", required=True,
                       help="JSONL: {custom_id, method, url, body} a line")
    batch.add_argument("-o", "--output-file", required=True,
                       help="JSONL: {id, custom_id, response, error} a line, in input order")
    batch.add_argument("--max-concurrency", type=int, default=None,
                       help="requests in flight at once (default: --max-num-seqs)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_serve_args(batch, listen=False)
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
    _add_router_args(route)
    route.set_defaults(func=cmd_router)
    # Listed for --help only: main() hands everything after `bench` to the load client's own
    # parser (its flags are KsanaLLM's benchmark_throughput.py flags; `bench --help` lists them).
    sub.add_parser("bench", add_help=False,
                   help="load-test a running server (KsanaLLM's benchmark_throughput.py flags; "
                        "`ksana-llm bench --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("KLLM_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        # Bad settings and unreadable files (missing, a folder, corrupt: the loaders name the
        # file): a one-line message, not a traceback.
        print(f"ksana-llm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
