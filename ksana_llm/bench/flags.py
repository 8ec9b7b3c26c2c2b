"""`ksana-llm bench`'s command line: KsanaLLM's `benchmark_throughput.py` flags (what they do is
in `ksana_llm.bench.client`), the settings they make (`BenchConfig`) and the prompts they name."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ksana_llm.bench.results import read_prompts
from ksana_llm.cli_types import number

log = logging.getLogger(__name__)

DONE = "[DONE]"
BACKENDS = ("ksana", "openai", "vllm")
OPENAI_BACKENDS = ("openai", "vllm")
# KsanaLLM's client speaks these too; this one does not.
OTHER_KSANA_BACKENDS = ("ksana-server", "vllm-server", "trt-llm", "evart", "mindie-service",
                        "sglang", "triton-grpc")
# KsanaLLM's prompt affixes (/generate's `model_type`; ksana_llm.server.prompt_affixes).
MODEL_TYPES = ("llama", "llama-3", "baichuan", "qwen", "vicuna", "yi", "chatglm", "empty",
               "deepseek_v2", "deepseek_v3", "deepseek_r1", "hunyuan_large", "kimi_k2",
               "arc_hunyuan_video")
# KsanaLLM's client stops these model types on their chat end tokens unless --stop_token_ids.
DEFAULT_STOP_TOKEN_IDS = MappingProxyType({"llama-3": (128001, 128009),
                                          "qwen": (151643, 151644, 151645), "yi": (2, 6, 7, 8)})
DATASETS = ("customize", "sharegpt500", "longbenchV2withCtx", "longbenchV2noCtx")


# ---- configuration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs, built from the command line (see `config_from_args`)."""

    host: str = "localhost"
    port: int = 8080
    backend: str = "ksana"  # "ksana" | "openai" | "vllm"
    mode: str = "async"  # "async" | "sync"
    stream: bool = False
    request_rate: float = math.inf
    poisson: bool = False  # --random
    concurrency: int = 1  # async: requests started together; sync: workers
    max_concurrency: int | None = None  # cap on requests in flight
    seed: int = 0
    warmup_num_iters: int = 0
    repeat_num_iters: int = 1
    clear_cache: bool = False  # empty the server's prefix cache before each measured pass
    request_rate_step: float = 1.0
    request_rate_num_iters: int = 1
    max_avg_latency: float = math.inf
    max_first_token_latency: float = math.inf
    model: str | None = None
    api_key: str | None = None
    model_type: str | None = None  # sent to /generate
    prompt_affix: tuple[str, str] = ("", "")  # put around text prompts on /v1/completions
    chat_template: bool = False
    # sampling (KsanaLLM's names and defaults: greedy, topk 1)
    max_new_tokens: int = 1024
    temperature: float = 0.0
    topk: int = 1
    topp: float = 1.0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    decoder_no_repeat_ngram_size: int = 0
    logprobs: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    structured_output_regex: str = ""
    # reporting
    percentiles: tuple[float, ...] = (99.0,)
    show_decode_token_throughput: bool = False
    client_timeout: float = 3 * 3600.0
    # Per-request output lengths (the offline benchmark's workload); None: max_new_tokens for all.
    output_lens: tuple[int, ...] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


# ---- requests ----------------------------------------------------------------------------------

# ---- command line ------------------------------------------------------------------------------

def _percentile_item(text: str) -> tuple[float, ...]:
    """One --percentiles word: a number, or comma-separated numbers ("50,90,99")."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers, got {text!r}") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text!r}")
    return value


def _backend(text: str) -> str:
    if text in BACKENDS:
        return text
    if text in OTHER_KSANA_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a backend of KsanaLLM's client that this one does not speak; use "
            "ksana (/generate), or openai / vllm (/v1/completions)")
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(BACKENDS)})")


def _default_input_csv() -> str:
    """The sample prompts installed with the package (21 short questions)."""
    return str(Path(__file__).with_name("sample_prompts.csv"))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    io = p.add_argument_group("server and prompts")
    io.add_argument("--host", default="localhost")
    io.add_argument("--port", type=number(int, 1, True, 65535), default=8080)
    io.add_argument("--input_csv", "--dataset_path", dest="input_csv", default=_default_input_csv(),
                    help="CSV with a header row; prompts in column --col_idx (default: the "
                         "package's sample prompts)")
    io.add_argument("--dataset_name", default="customize", choices=DATASETS,
                    help="customize: --input_csv; KsanaLLM's bundled data sets are not shipped "
                         "here (sharegpt500: pass its CSV as --input_csv)")
    io.add_argument("--col_idx", type=int, default=0)
    io.add_argument("--prompt_num", type=int, default=0,
                    help="0 = every prompt once; fewer: the first ones; more cycles")
    io.add_argument("--shuffle", action="store_true",
                    help="shuffle the prompts (with --seed) before --prompt_num applies")
    io.add_argument("--random_input_len", type=int, default=0, metavar="N",
                    help="instead of the text prompts: as many prompts (--prompt_num, else the "
                         "CSV's count) of N random non-special token ids of --tokenizer_path's "
                         "tokenizer (--seed)")
    io.add_argument("--random_workload", type=int, default=0, metavar="N",
                    help="instead of --input_csv: the offline benchmark's workload of N requests "
                         "(random non-special token ids, input and output lengths uniform in "
                         "[--random_min_len, --random_max_len], --seed), EOS ignored")
    io.add_argument("--random_min_len", type=int, default=32)
    io.add_argument("--random_max_len", type=int, default=256)
    io.add_argument("--tokenizer", "--tokenizer_path", dest="tokenizer", default=None,
                    help="model or tokenizer folder for the random token ids (default: the "
                         "embedded default model)")

    load = p.add_argument_group("load shape")
    load.add_argument("--mode", choices=("async", "sync"), default="async",
                      help="async: open loop (arrival times); sync: --concurrency workers, each "
                           "sending its next request when the last returns")
    load.add_argument("--request_rate", type=_rate, default=math.inf,
                      help="average requests/s; inf = all at once")
    load.add_argument("--random", dest="poisson", action="store_true",
                      help="Poisson arrivals (exponential gaps) instead of evenly spaced ones")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the arrival times, --shuffle and random token ids")
    load.add_argument("--concurrency", type=int, default=1,
                      help="async: requests sent together at each arrival (the rate stays "
                           "--request_rate); sync: workers")
    load.add_argument("--max_concurrency", "--max-concurrency", dest="max_concurrency", type=int,
                      default=None, help="most requests in flight at once (default: no cap)")
    load.add_argument("--stream", action="store_true")
    load.add_argument("--warmup_num_iters", type=int, default=0,
                      help="unmeasured runs of the whole workload first")
    load.add_argument("--repeat_num_iters", type=int, default=1,
                      help="measured runs of the workload, reported together")
    load.add_argument("--request_rate_num_iters", type=int, default=1,
                      help="request rates to run, each --request_rate_step above the last")
    load.add_argument("--request_rate_step", type=float, default=1.0)
    load.add_argument("--max_avg_latency", type=float, default=math.inf,
                      help="after the rates above, search the highest rate with an average "
                           "latency (s) within this")
    load.add_argument("--max_first_token_latency", type=float, default=math.inf,
                      help="as --max_avg_latency, for the average TTFT (s; needs --stream)")
    load.add_argument("--client_timeout", type=float, default=3 * 3600.0,
                      help="seconds per request")
    load.add_argument("--clear_cache", action="store_true",
                      help="empty the server's prefix cache before each measured pass "
                           "(POST /reset_prefix_cache), so no pass finds the last one's prompts "
                           "cached")

    server = p.add_argument_group("backend")
    server.add_argument("--backend", type=_backend, default="ksana", metavar="{ksana,openai,vllm}",
                        help="ksana: POST /generate; openai / vllm: POST /v1/completions")
    server.add_argument("--model", default=None,
                        help="served model name (openai, vllm); default: the first of /v1/models")
    server.add_argument("--api-key", "--api_key", dest="api_key", default=None)
    server.add_argument("--model_type", default=None, choices=MODEL_TYPES,
                        help="the model family's one-turn chat affix around each prompt: ksana "
                             "sends it as `model_type` (the server wraps), openai / vllm wrap "
                             "text prompts here; llama-3, qwen, yi also stop on their chat end "
                             "ids unless --stop_token_ids (default: no affix, not sent)")
    server.add_argument("--chat_template", action="store_true",
                        help="ksana: send use_chat_template (a prompt that is no JSON message "
                             "list goes as one user message)")
    server.add_argument("--triton_model_name", default=None,
                        help="KsanaLLM's triton-grpc backend only; no effect here")

    sampling = p.add_argument_group("sampling (KsanaLLM's names)")
    sampling.add_argument("--max_new_tokens", type=int, default=1024)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--topk", type=int, default=1, help="1 = greedy (openai: top_k)")
    sampling.add_argument("--topp", type=float, default=1.0, help="openai: top_p")
    sampling.add_argument("--repetition_penalty", type=float, default=1.0)
    sampling.add_argument("--num_beams", type=int, default=1,
                          help="beam search (openai: this server's num_beams; not vllm)")
    sampling.add_argument("--length_penalty", type=float, default=1.0, help="beam search only")
    sampling.add_argument("--num_return_sequences", type=int, default=1,
                          help="only 1: this client measures one sequence per request")
    sampling.add_argument("--no_repeat_ngram_size", type=int, default=0, help="not vllm")
    sampling.add_argument("--encoder_no_repeat_ngram_size", type=int, default=0,
                          help="ksana only")
    sampling.add_argument("--decoder_no_repeat_ngram_size", type=int, default=0,
                          help="ksana only")
    sampling.add_argument("--logprobs", type=int, default=0,
                          help="top log-probs per token (0 = none)")
    sampling.add_argument("--stop_token_ids", type=int, nargs="*", default=None)
    sampling.add_argument("--stop_strings", nargs="*", default=None, help="openai: stop")
    sampling.add_argument("--ignore_eos", action="store_true")
    sampling.add_argument("--structured_output_regex", default="",
                          help="constrain the output (openai: guided_regex)")
    sampling.add_argument("--structured_output_file", default=None,
                          help="a file holding --structured_output_regex")

    out = p.add_argument_group("output")
    out.add_argument("--percentiles", type=_percentile_item, nargs="+", default=None,
                     help="e.g. 50 90 99 (or 50,90,99); default 99")
    out.add_argument("--show_decode_token_throughput", action="store_true",
                     help="'Token throughput' counts only the tokens after each request's first "
                          "(always in 'Decode token throughput')")
    out.add_argument("--output_csv", default=None, help="per-request outputs of the last run")
    out.add_argument("--perf_csv", default=None, help="the summary, one row per request rate")

    diff = p.add_argument_group("output consistency between runs (ksana_llm.bench.diff_check)")
    diff.add_argument("--enable_diff_check", action="store_true",
                      help="compare each later run's answers with the first run's (makes "
                           "--repeat_num_iters at least 2)")
    diff.add_argument("--diff_rouge_threshold", type=float, default=0.5,
                      help="report a pair in detail when its ROUGE-W is below this")
    diff.add_argument("--diff_mismatch_threshold", type=int, default=None,
                      help="also when its first differing character is at or before this "
                           "position (default: not used)")
    diff.add_argument("--diff_output_file", default="comparison_results.txt",
                      help="where the detailed comparison goes")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's config; a ValueError names what cannot be done (main turns it into a usage
    error), a logged warning what is accepted but has no effect here."""
    checks = [("--concurrency", args.concurrency, 1), ("--max_new_tokens", args.max_new_tokens, 1),
              ("--warmup_num_iters", args.warmup_num_iters, 0),
              ("--repeat_num_iters", args.repeat_num_iters, 1),
              ("--request_rate_num_iters", args.request_rate_num_iters, 1),
              ("--num_beams", args.num_beams, 1), ("--logprobs", args.logprobs, 0),
              ("--random_input_len", args.random_input_len, 0)]
    if args.max_concurrency is not None:
        checks.append(("--max_concurrency", args.max_concurrency, 1))
    for flag, value, low in checks:
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.dataset_name != "customize":
        hint = ("pass its CSV as --input_csv" if args.dataset_name == "sharegpt500"
                else "LongBench v2 is not supported")
        raise ValueError(f"--dataset_name {args.dataset_name}: KsanaLLM's bundled data sets are "
                         f"not shipped here ({hint})")
    if args.num_return_sequences != 1:
        raise ValueError("--num_return_sequences must be 1: this client measures one sequence "
                         "per request")
    if not args.stream and not math.isinf(args.max_first_token_latency):
        raise ValueError("--max_first_token_latency needs --stream (TTFT is measured on streams)")
    openai = args.backend in OPENAI_BACKENDS
    if openai:
        refused = [("--encoder_no_repeat_ngram_size", args.encoder_no_repeat_ngram_size != 0),
                   ("--decoder_no_repeat_ngram_size", args.decoder_no_repeat_ngram_size != 0),
                   ("--chat_template", args.chat_template)]
        if args.backend == "vllm":
            refused += [("--num_beams > 1", args.num_beams > 1),
                        ("--length_penalty", args.length_penalty != 1.0),
                        ("--no_repeat_ngram_size", args.no_repeat_ngram_size != 0)]
        named = [flag for flag, used in refused if used]
        if named:
            raise ValueError(f"--backend {args.backend} cannot express {', '.join(named)} "
                             "(use --backend ksana" + (" or openai" if args.backend == "vllm"
                                                       else "") + ")")
    if args.enable_diff_check:
        if not 0.0 <= args.diff_rouge_threshold <= 1.0:
            raise ValueError(f"--diff_rouge_threshold must be within [0, 1], got "
                             f"{args.diff_rouge_threshold}")
        if args.diff_mismatch_threshold is not None and args.diff_mismatch_threshold < 1:
            raise ValueError(f"--diff_mismatch_threshold must be >= 1, got "
                             f"{args.diff_mismatch_threshold}")
        if args.repeat_num_iters < 2:
            log.info("--enable_diff_check: --repeat_num_iters %d -> 2 (two runs to compare)",
                     args.repeat_num_iters)
    # Output files are written after the whole run: a folder that is not there must fail
    # before it, not throw the measurements away.
    outputs = [("--output_csv", args.output_csv), ("--perf_csv", args.perf_csv)]
    if args.enable_diff_check:
        outputs.append(("--diff_output_file", args.diff_output_file))
    for flag, path in outputs:
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: its folder does not exist")
    if args.triton_model_name is not None:
        log.warning("--triton_model_name has no effect: the triton-grpc backend is not supported")
    regex = args.structured_output_regex
    if args.structured_output_file is not None:
        regex = Path(args.structured_output_file).read_text(encoding="utf-8")
    stop_ids = args.stop_token_ids
    if not stop_ids and args.model_type in DEFAULT_STOP_TOKEN_IDS:
        stop_ids = DEFAULT_STOP_TOKEN_IDS[args.model_type]
    percentiles = tuple(p for item in (args.percentiles or [(99.0,)]) for p in item)
    return BenchConfig(
        host=args.host, port=args.port, backend=args.backend, mode=args.mode, stream=args.stream,
        request_rate=args.request_rate, poisson=args.poisson, concurrency=args.concurrency,
        max_concurrency=args.max_concurrency, seed=args.seed,
        warmup_num_iters=args.warmup_num_iters,
        repeat_num_iters=max(args.repeat_num_iters, 2 if args.enable_diff_check else 1),
        request_rate_step=args.request_rate_step,
        request_rate_num_iters=args.request_rate_num_iters,
        max_avg_latency=args.max_avg_latency, max_first_token_latency=args.max_first_token_latency,
        model=args.model, api_key=args.api_key,
        model_type=args.model_type if not openai else None,
        prompt_affix=_prompt_affix(args) if openai else ("", ""), chat_template=args.chat_template,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, topk=args.topk,
        topp=args.topp, repetition_penalty=args.repetition_penalty, num_beams=args.num_beams,
        length_penalty=args.length_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
        encoder_no_repeat_ngram_size=args.encoder_no_repeat_ngram_size,
        decoder_no_repeat_ngram_size=args.decoder_no_repeat_ngram_size, logprobs=args.logprobs,
        stop_token_ids=tuple(stop_ids or ()), stop_strings=tuple(args.stop_strings or ()),
        ignore_eos=args.ignore_eos, structured_output_regex=regex, percentiles=percentiles,
        show_decode_token_throughput=args.show_decode_token_throughput,
        client_timeout=args.client_timeout, clear_cache=args.clear_cache)


def _prompt_affix(args: argparse.Namespace) -> tuple[str, str]:
    """What /generate would put around a prompt for --model_type (the server's own table)."""
    if args.model_type is None:
        return ("", "")
    from ksana_llm.server.prompt_affixes import PROMPT_AFFIXES

    if args.model_type not in PROMPT_AFFIXES:
        log.warning("--model_type %s has no prompt affix here; prompts are sent as they are",
                    args.model_type)
        return ("", "")
    if args.random_input_len or args.random_workload:
        log.warning("--model_type: token-id prompts are sent as they are (no affix)")
    return PROMPT_AFFIXES[args.model_type]


def _allowed_ids(tokenizer_path: str | None):
    from transformers import AutoTokenizer

    from ksana_llm.bench.workload import allowed_token_ids
    from ksana_llm.loader import resolve_model_dir

    try:
        folder = resolve_model_dir(tokenizer_path)
    except FileNotFoundError:
        if tokenizer_path is None:
            raise
        folder = tokenizer_path  # a tokenizer-only folder (no config.json)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return allowed_token_ids(tokenizer, len(tokenizer))


def random_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The exact requests `benchmarks/offline_throughput.py` sends, so server and offline
    throughput can be compared on one workload."""
    from ksana_llm.bench.workload import build_workload

    workload = build_workload(args.random_workload, args.random_min_len, args.random_max_len,
                              args.seed, _allowed_ids(args.tokenizer))
    return workload.prompts, workload.output_lens


def load_prompts(args: argparse.Namespace, cfg: BenchConfig
                 ) -> tuple[list[str] | list[list[int]], BenchConfig]:
    """The workload the flags describe, and the config that goes with it."""
    if args.random_workload:
        prompts, output_lens = random_workload(args)
        return prompts, dataclasses.replace(cfg, output_lens=tuple(output_lens), ignore_eos=True)
    if args.random_input_len:
        from ksana_llm.bench.workload import fixed_length_prompts

        count = args.prompt_num
        if count <= 0:  # as many requests as the CSV has prompts
            count = len(read_prompts(args.input_csv, args.col_idx))
        return fixed_length_prompts(count, args.random_input_len, args.seed,
                                    _allowed_ids(args.tokenizer)), cfg
    shuffle = random.Random(args.seed) if args.shuffle else None
    return read_prompts(args.input_csv, args.col_idx, args.prompt_num, shuffle), cfg
