"""The command line's flags, shared by its commands: the model and sampling flags of `generate`
and `chat`, the server's (`serve`, `run-batch`), where and how a server listens (`serve`,
`router`), CORS, and the router's."""

from __future__ import annotations

import argparse
import os

from ksana_llm import cli_types
from ksana_llm.cli_vllm_flags import (add_model_task_args, add_vllm_flags_without_effect,
                                      compilation_config)
from ksana_llm.config import (KV_CACHE_DTYPES, KV_ROLES, LOAD_FORMATS, LOGPROBS_MODES,
                              SPECULATIVE_METHODS, WEIGHT_QUANTIZATIONS)

_SPECULATIVE_METHOD_HELP = ("where drafts come from: mtp = the model's MTP layer (DeepSeek V3/R1 "
                            "with MTP weights); ngram = the sequence's own history (prompt "
                            "lookup, any model)")
_QUANTIZATION_HELP = ("fp8: keep the projections' weights as FP8 with per-row scales (half the "
                      "memory of 16-bit weights); w8a8_int8: as int8 with per-row scales, "
                      "their inputs quantized to int8 per token (int8 matmuls on a CPU); "
                      "quantized checkpoints load as they are without it")
_KV_CACHE_DTYPE_HELP = ("KV cache storage: auto = the model's dtype; fp8_e5m2 / fp8_e4m3 (= fp8) "
                        "hold twice the tokens of a 16-bit cache, K/V rounded to FP8")


def add_tokenizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", "--tokenizer_path", "--tokenizer-path", "--tokenizer_dir",
                        "--tokenizer-dir", dest="tokenizer", default=None, metavar="DIR",
                        help="tokenizer folder to use instead of the model's own (vLLM's "
                             "--tokenizer, KsanaLLM's --tokenizer_path)")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    add_tokenizer_arg(parser)
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
    add_vllm_flags_without_effect(parser, serve=False)


def add_serve_args(parser: argparse.ArgumentParser, *, listen: bool = True) -> None:
    """The server's flags; `listen` False leaves out where and how it listens (run-batch opens
    no port)."""
    parser.add_argument("--config_file", "--config-file", dest="config_file", default=None,
                        help="KsanaLLM YAML config; the flags below override it")
    parser.add_argument("--config", dest="flags_file", default=None, metavar="YAML",
                        help="vLLM's: a YAML file of this command's flags by their long names "
                             "(max-model-len: 4096); flags on the command line win")
    parser.add_argument("--model", default=None,
                        help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    add_tokenizer_arg(parser)
    parser.add_argument("--skip-tokenizer-init", action="store_true", default=None,
                        help="vLLM's: load no tokenizer. Prompts are token ids (completions, "
                             "/generate input_tokens, /forward, embeddings); outputs carry token "
                             "ids (return_token_ids) and empty text; routes that need text "
                             "(chat, responses, tokenize, text prompts, stop strings) answer 400")
    add_vllm_flags_without_effect(parser, serve=True)
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the name clients pass as `model` (default: the model folder's "
                             "name); more names are aliases, the first is the one reported")
    add_model_task_args(parser)
    if listen:
        add_listen_args(parser)
        parser.add_argument("--data-parallel-size", "-dp", type=cli_types.positive_int,
                            default=1, help="vLLM's: replicas of the model, each a server of "
                                            "its own (its own GPUs), behind this one endpoint")
        # (run-batch shows a progress bar instead)
        parser.add_argument("--disable-log-stats", action="store_true",
                            help="no periodic stats line (throughput, queue, KV cache use; "
                                 "vLLM's flag)")
        parser.add_argument("--log-stats-interval", type=cli_types.positive_float,
                            default=None, metavar="SECONDS",
                            help="seconds between stats lines (default: 10)")
        parser.add_argument("--metrics-prefix", default="ksana_llm", metavar="NAME",
                            help="/metrics series are named NAME:<series> (default ksana_llm; "
                                 "vllm gives vLLM's names, for its dashboards and autoscalers)")
        parser.add_argument("--disable-fastapi-docs", action="store_true",
                            help="no /docs, /redoc or /openapi.json (vLLM's flag)")
    # An empty $KLLM_API_KEY means no key, as vLLM reads an empty $VLLM_API_KEY; an empty
    # --api-key is refused at once, before the model loads.
    parser.add_argument("--api-key", type=cli_types.non_empty_str,
                        default=os.environ.get("KLLM_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "and /ping (default: $KLLM_API_KEY, else no key)")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template file (default: the tokenizer's)")
    parser.add_argument("--chat-template-content-format", default="auto",
                        choices=("auto", "string", "openai"),
                        help="message content as the template gets it: one string, or a list "
                             "of {'type': 'text', 'text': ...} parts (openai); auto reads the "
                             "template for a loop over content (vLLM's flag)")
    parser.add_argument("--response-role", type=cli_types.non_empty_str, default="assistant",
                        help="the role of a chat answer when the request adds a generation "
                             "prompt (otherwise: the last message's role)")
    parser.add_argument("--max-body-bytes", type=cli_types.positive_int, default=None,
                        help="largest request body accepted, else 413 (default: 2 MiB)")
    parser.add_argument("--shutdown-timeout", type=cli_types.non_negative_float, default=5.0,
                        help="seconds to let in-flight requests finish on SIGTERM; then they fail with 503")
    # Output parsing (names are checked at start-up, before the model loads).
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); '
                             "needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help="how tool calls are read from model text: hermes, qwen3, qwen3_coder, "
                             "qwen3_xml, llama3_json, llama4_json, pythonic, llama4_pythonic, mistral, "
                             "deepseek_v3, deepseek_v31, deepseek_v32, kimi_k2, internlm, "
                             "granite, glm45, glm47, seed_oss, longcat, jamba, minimax, minimax_m2, "
                             "phi4_mini_json, hunyuan_a13b, ernie45, olmo3, xlam, step3, "
                             "openai (GPT-OSS)")
    parser.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                        help="a Python file defining tool-call parsers of one's own "
                             "(ksana_llm.server.tool_parsers.ToolParser subclasses with a "
                             "`name`), which --tool-call-parser can then name")
    parser.add_argument("--reasoning-parser", default=None,
                        help="fill reasoning_content from <think>...</think>: deepseek_r1, "
                             "qwen3, deepseek_v3, glm45, seed_oss (<seed:think>), hunyuan_a13b "
                             "(and its <answer>), step3, minimax_m2, ernie45 (and its "
                             "<response>), olmo3, mistral ([THINK]); granite (\"Here is my "
                             "thought process:\"); minimax_m2_append_think (no split: <think> "
                             "+ the output as content); from GPT-OSS's "
                             "analysis channel: openai_gptoss")
    parser.add_argument("--reasoning-config", type=cli_types.json_object, default=None,
                        metavar="JSON",
                        help="vLLM's: the text that opens and ends the thinking block, for "
                             "requests' thinking_token_budget and structured output after the "
                             "thinking, e.g. '{\"reasoning_start_str\": \"<think>\", "
                             "\"reasoning_end_str\": \"Time to answer.</think>\"}' (the end "
                             "string is what a spent budget forces; default: --reasoning-parser's "
                             "tags)")
    parser.add_argument("--profiler-config", type=cli_types.json_object, default=None,
                        metavar="JSON",
                        help="vLLM's: mount POST /start_profile and /stop_profile, which trace "
                             "the engine's steps with torch.profiler, e.g. '{\"profiler\": "
                             "\"torch\", \"torch_profiler_dir\": \"./traces\"}' (also "
                             "torch_profiler_with_stack, _record_shapes, _with_memory, "
                             "_with_flops, _use_gzip; default: VLLM_TORCH_PROFILER_DIR when set)")
    parser.add_argument("--max-logprobs", type=int, default=None,
                        help="largest logprobs / top_logprobs / prompt_logprobs a request may "
                             "ask for (default: 20; -1: no cap, a request may ask for the whole "
                             "vocabulary with -1)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's prompt, token ids and settings (vLLM's flag)")
    parser.add_argument("--enable-log-outputs", action="store_true",
                        help="log each finished request's text, token ids and finish reason "
                             "(vLLM's flag)")
    parser.add_argument("--max-log-len", type=cli_types.non_negative_int, default=None,
                        help="--enable-log-requests / --enable-log-outputs show at most this "
                             "many characters and token ids of each (default: all)")
    parser.add_argument("--middleware", action="append", default=None, metavar="MODULE:NAME",
                        help="vLLM's: an ASGI middleware class, or an async (request, "
                             "call_next) function, by import path; repeat for several (the "
                             "last given is the outermost)")
    parser.add_argument("--enable-prompt-embeds", action="store_true",
                        help="let completions take prompt_embeds (base64 torch.save'd tensors, "
                             "as vLLM; off by default: they are unpickled, tensors only; raise "
                             "--max-body-bytes for long prompts)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="name every logprob token token_id:<id> (as each request may ask)")
    parser.add_argument("--default-chat-template-kwargs", type=cli_types.json_object,
                        default=None, metavar="JSON",
                        help="chat template arguments for every chat request, under its own "
                             "chat_template_kwargs, e.g. '{\"enable_thinking\": false}'")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="every streamed completion and chat ends with a usage chunk, as "
                             "with stream_options.include_usage")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="vLLM's: GET /tokenizer_info gives the tokenizer's configuration "
                             "and chat template")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help="vLLM's: a chat request with tool_choice \"none\" shows the chat "
                             "template no tools (by default they are shown; no call is "
                             "extracted either way)")
    add_cors_args(parser)
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
    parser.add_argument("--kv-transfer-config", type=cli_types.json_object, default=None,
                        metavar="JSON",
                        help="vLLM's: '{\"kv_connector\": ..., \"kv_role\": \"kv_producer\" | "
                             "\"kv_consumer\" | \"kv_both\"}' is --kv-role prefill | decode | "
                             "both; the KV moves over this server's own HTTP transfer, whatever "
                             "the connector")
    parser.add_argument("--kv-transfer-ttl", type=cli_types.positive_float, default=None,
                        help="seconds a prefill server keeps KV nobody fetched (default: 300)")
    parser.add_argument("--kv-prefill-url", action="append", default=None, metavar="URL",
                        help="a decode server fetches KV only from these prefill servers "
                             "(repeat for several; default: any URL a request names)")
    # Engine settings (EngineConfig fields); only those given override the config file.
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--num-device-blocks", "--num-gpu-blocks-override", type=int,
                        default=None, dest="num_device_blocks", help="KV cache blocks")
    parser.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=cli_types.byte_size,
                        default=None, dest="kv_cache_memory_bytes", metavar="BYTES",
                        help="vLLM's: the KV cache's size per device in bytes (1e9, 8GiB, "
                             "4G ...), instead of a share of free memory")
    parser.add_argument("--block-token-num", "--block-size", type=int, default=None,
                        dest="block_token_num", help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    parser.add_argument("--max-step-tokens", "--max-num-batched-tokens", type=int, default=None,
                        dest="max_step_tokens", help="token budget per step")
    parser.add_argument("--split-fuse-token-num", "--long-prefill-token-threshold", type=int,
                        default=None, dest="split_fuse_token_num",
                        help="most prompt tokens of one sequence per step (0: the budget only; "
                             "vLLM's --long-prefill-token-threshold)")
    parser.add_argument("--gpu-memory-utilization", "--block-device-memory-ratio", type=float,
                        default=None, dest="block_device_memory_ratio",
                        help="CUDA: share of device memory for weights, activations and KV "
                             "blocks (default 0.9); CPU: share of free RAM for KV blocks (0.1)")
    parser.add_argument("--reserved-device-memory-ratio", type=float, default=None,
                        help="share of device memory kept free of KV blocks (default 0.01)")
    parser.add_argument("--block-host-memory-factor", type=float, default=None,
                        help="host swap pool, as a multiple of the device blocks (default: the "
                             "device pool's size on CPU, 4 GiB per rank on CUDA)")
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
    parser.add_argument("--logits-processors", nargs="+", default=None,
                        metavar="MODULE:CLASS",
                        help="vLLM's: engine-wide logits processors, ksana_llm.LogitsProcessor "
                             "subclasses by import path (on PYTHONPATH), run in this order; "
                             "requests set theirs with `vllm_xargs`")
    parser.add_argument("--logprobs-mode", default=None,
                        choices=LOGPROBS_MODES,
                        help="vLLM's: what requested log-probs report (default raw_logprobs: "
                             "the model's distribution; processed_*: after the processors "
                             "and sampling settings; *_logits: logits, not log-probs)")
    parser.add_argument("--max-queue-size", type=int, default=None,
                        help="waiting requests before 429")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--disable-sliding-window", action="store_true", default=None,
                        help="vLLM's: cap sequences at the model's sliding window, within "
                             "which attention is full (no effect without a window)")
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
    parser.add_argument("--cuda-graph-max-batch-size", "--max-cudagraph-capture-size",
                        dest="cuda_graph_max_batch_size", type=int, default=None,
                        help="largest decode batch replayed from a graph (default: max-num-seqs)")
    parser.add_argument("--cuda-graph-sizes", type=cli_types.positive_int, nargs="+",
                        default=None, metavar="N",
                        help="decode batch sizes captured (vLLM's flag): one value is the "
                             "largest (= --cuda-graph-max-batch-size), several are the sizes")
    parser.add_argument("--compilation-config", "-O", type=compilation_config, default=None,
                        metavar="JSON|LEVEL",
                        help="vLLM's: its cudagraph_mode (NONE: no graphs; any other: the "
                             "decode-step graphs), use_cudagraph, cudagraph_capture_sizes (as "
                             "--cuda-graph-sizes) and max_cudagraph_capture_size set the CUDA "
                             "graphs; torch.compile's keys and the level (-O0..-O3) change "
                             "nothing (with a warning): this engine compiles nothing")
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
    parser.add_argument("--speculative-config", type=cli_types.speculative_config, default=None,
                        metavar="JSON",
                        help="vLLM's form of the speculative flags, e.g. '{\"method\": "
                             "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": "
                             "4}' (methods: ngram, deepseek_mtp; keys: num_speculative_tokens, "
                             "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                        help=_KV_CACHE_DTYPE_HELP)
    parser.add_argument("--quantization", "-q", default=None, choices=WEIGHT_QUANTIZATIONS,
                        help=_QUANTIZATION_HELP)
    parser.add_argument("--revision", default=None,
                        help="vLLM's: the branch, tag or commit of a Hugging Face hub model id "
                             "(default main)")
    parser.add_argument("--tokenizer-revision", default=None,
                        help="vLLM's: the branch, tag or commit of a hub tokenizer (--tokenizer, "
                             "else the hub model's own)")
    parser.add_argument("--hf-token", nargs="?", const=True, default=None, metavar="TOKEN",
                        help="vLLM's: the Hugging Face token hub downloads use (without a "
                             "value, or by default: huggingface_hub's own, HF_TOKEN or the "
                             "stored login)")
    parser.add_argument("--download-dir", default=None,
                        help="vLLM's: the Hugging Face cache a hub model id is read from and "
                             "downloaded into (default HF_HUB_CACHE / HF_HOME's; "
                             "HF_HUB_OFFLINE=1 reads it only)")
    parser.add_argument("--load-format", default=None,
                        choices=LOAD_FORMATS,
                        help="vLLM's: where the weights come from (default auto: safetensors, "
                             "else .bin; dummy: made-up weights of the config's shapes, for "
                             "profiling)")
    parser.add_argument("--hf-overrides", type=cli_types.json_object, default=None,
                        metavar="JSON",
                        help="config.json values to change before the model is built (vLLM's), "
                             "e.g. '{\"max_position_embeddings\": 65536}'")
    # LoRA adapters (vLLM's flags); a request picks one with its `model` field.
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH|JSON",
                        type=cli_types.lora_module,
                        help="PEFT LoRA adapters to serve, each under its name: NAME=PATH or "
                             "vLLM's JSON {\"name\": ..., \"path\": ...}")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="adapter slots on the device: the most adapters in one step; "
                             "more adapters take turns (default: the number of --lora-modules, "
                             "at most 4; 1 with --allow-runtime-lora-updating alone)")
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
    parser.add_argument("--enable-sleep-mode", action="store_true", default=None,
                        help="mount /sleep, /wake_up and /is_sleeping (vLLM's): the engine frees "
                             "its KV cache and weights' device memory while idle, on request")
    parser.add_argument("--enable-weight-updates", action="store_true",
                        help="mount /update_weights_from_disk: new weights for the served model "
                             "from a checkpoint folder a client names, while serving")


def add_listen_args(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                        help="no access log (the default; vLLM's flag)")
    parser.add_argument("--endpoint", default="python", choices=["python"],
                        help="KsanaLLM's endpoint type: python, this HTTP server (its RPC "
                             "endpoint plugins such as trpc are not served)")
    parser.add_argument("--root-path", "--root_path", dest="root_path", default="",
                        metavar="PREFIX", help="the path prefix a proxy serves this server "
                                               "under (ASGI root_path), e.g. /llm")


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-origins", type=cli_types.json_strings, default=None, metavar="JSON",
                        help='browser origins allowed to call (CORS), e.g. \'["https://a.b"]\' '
                             '(default: any, as vLLM)')
    parser.add_argument("--allowed-methods", type=cli_types.json_strings, default=None, metavar="JSON",
                        help="CORS methods (default: any)")
    parser.add_argument("--allowed-headers", type=cli_types.json_strings, default=None, metavar="JSON",
                        help="CORS request headers (default: any)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send cookies / credentials")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill server (serve --kv-role prefill); repeat for several")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode server (serve --kv-role decode); repeat for several")
    parser.add_argument("--prefill-timeout", type=cli_types.positive_float, default=120.0, metavar="S",
                        help="seconds a prefill server may take for a prompt before the decode "
                             "server computes it instead; one that times out or cannot be "
                             "reached rests for 30 s (default: 120)")
    add_listen_args(parser)
    parser.add_argument("--api-key", type=cli_types.non_empty_str, default=None,
                        help="required of clients, and sent to the servers (which share it)")
    add_cors_args(parser)

