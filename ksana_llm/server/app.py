"""The FastAPI application (`build_app`) and the `ksana-llm serve` entry point (`run_server`).

Everything a request needs lives in `app.state.server` (a `ServerState`), so several apps (e.g.
tests, or one per engine) can live in one process without sharing module-level state.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import ksana_llm
from ksana_llm.api.engine import Engine
from ksana_llm.config import KV_ROLES
from ksana_llm.distributed.launch import run_worker_node
from ksana_llm.distributed.runtime import multi_node_env
from ksana_llm.server import forward, kv_transfer, metrics, native
from ksana_llm.server.chat import ChatTemplate, load_chat_template
from ksana_llm.server.engine_args import (ENGINE_FLAGS, configs_from_args,  # noqa: F401
                                          default_served_model_name, kv_transfer_from_args,
                                          model_from_args)
from ksana_llm.server.errors import install_error_handlers
from ksana_llm.server.listen import (AnnouncingServer, listening_socket, uvicorn_config,
                                     uvicorn_tls_options)
from ksana_llm.server.logprobs import TokenIdTexts, TokenTexts
from ksana_llm.server.middleware import (DEFAULT_MAX_BODY_BYTES, ApiKeyMiddleware,
                                         BodyLimitMiddleware, CorsSettings,
                                         DisconnectWatchMiddleware, LoadTrackingMiddleware,
                                         RequestIdMiddleware, add_cors, add_user_middlewares,
                                         cors_from_args, user_middlewares)
from ksana_llm.server.model_tasks import check_model_task_args
from ksana_llm.server.params import ModelLimits
from ksana_llm.server.reasoning_parsers import get_reasoning_parser
from ksana_llm.server.request_log import RequestLog
from ksana_llm.server.responses_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from ksana_llm.server.sampling_defaults import SamplingDefaults
from ksana_llm.server.serve_options import (OutputParsing, check_sampling_defaults_args,
                                            check_tokenizer, output_parsing_from_args,
                                            request_options_from_args, sampling_defaults_from_args)
from ksana_llm.server.state import ServerState
from ksana_llm.server.stats_log import DEFAULT_INTERVAL_S as DEFAULT_STATS_INTERVAL_S
from ksana_llm.server.stats_log import StatsLogThread

logger = logging.getLogger("ksana_llm.server")


def _mount_extensions(app: FastAPI, engine: Engine, state: ServerState,
                      metrics_prefix: str) -> None:
    """GET /metrics (and the per-request series), KsanaLLM's POST /generate and POST /forward."""
    state.metrics = metrics.ServerMetrics(engine, model_name=state.served_model_name,
                                          prefix=metrics_prefix)
    metrics.mount(app, engine, state.metrics)
    native.mount(app, engine)
    forward.mount(app)


def build_app(engine: Engine, *, served_model_name: str | Sequence[str],
              api_key: str | None = None,
              chat_template: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              mount_extensions: bool = True, parsing: OutputParsing | None = None,
              kv_role: str | None = None, kv_transfer_ttl_s: float | None = None,
              kv_prefill_urls: list[str] | None = None,
              allow_runtime_lora_updating: bool = False, enable_weight_updates: bool = False,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              sampling_defaults: SamplingDefaults | None = None,
              cors: CorsSettings | None = None, enable_prompt_embeds: bool = False,
              request_log: RequestLog | None = None,
              default_chat_template_kwargs: Mapping[str, Any] | None = None,
              force_include_usage: bool = False, enable_docs: bool = True,
              exclude_tools_when_tool_choice_none: bool = False,
              enable_tokenizer_info_endpoint: bool = False,
              chat_template_content_format: str = "auto",
              response_role: str = "assistant", middleware: Sequence[Any] = (),
              metrics_prefix: str = metrics.DEFAULT_PREFIX) -> FastAPI:
    """An OpenAI-compatible app over a running engine. The app shuts the engine down on exit.

    `served_model_name`: the name requests give as `model` (several: aliases of the first).
    `chat_template` is template text (not a path); None uses the tokenizer's own. `kv_role`
    ("prefill", "decode", "both"): the server's part in disaggregated serving (`server.kv_transfer`);
    `kv_prefill_urls`: the prefill servers a decode server may fetch KV from (None: any).
    `allow_runtime_lora_updating` mounts /v1/load_lora_adapter and /v1/unload_lora_adapter,
    `enable_weight_updates` /update_weights_from_disk. An engine with `enable_sleep_mode`
    gets /sleep, /wake_up and /is_sleeping.
    `max_stored_responses`: how many `/v1/responses` answers are kept for retrieval and
    `previous_response_id` (least recently used dropped first; 0 keeps none).
    `sampling_defaults`: what requests that leave sampling parameters out get (`serve` reads
    them from the model's generation_config.json; None: OpenAI's defaults). `cors`: which
    browser origins may call (None: no CORS headers; `serve` allows any origin, as vLLM).
    `enable_prompt_embeds`: completions take `prompt_embeds` (server/prompt_embeds.py).
    `request_log`: log every engine request as it is submitted (--enable-log-requests).
    `default_chat_template_kwargs`: chat template arguments every chat request gets under its
    own `chat_template_kwargs`. `force_include_usage`: every stream ends with a usage chunk.
    `exclude_tools_when_tool_choice_none`: a chat request with `tool_choice: "none"` shows the
    template no tools (vLLM's flag; by default they are shown, and no call is extracted).
    `enable_tokenizer_info_endpoint` mounts GET /tokenizer_info (server/tokenizer_info.py).
    `enable_docs` False: no /docs, /redoc or /openapi.json.
    `chat_template_content_format` ("auto", "string", "openai"): message content as one string,
    or as a list of OpenAI text parts; "auto" reads the template to choose. `response_role`: the
    role a chat answer has when the request asked for a generation prompt. `middleware`: the
    user's own ASGI middleware classes or `async (request, call_next)` functions (or their
    import paths), in order, inside the request-id middleware and outside everything else.
    `metrics_prefix`: the /metrics series are named `<prefix>:<name>` ("vllm": vLLM's names).
    """
    user_middleware = user_middlewares(middleware)
    parsing = parsing or OutputParsing()
    parsing.check()
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (omit it to disable authentication)")
    check_tokenizer(engine, parsing, chat_template)
    reasoning_parser = (get_reasoning_parser(parsing.reasoning_parser)
                        if parsing.reasoning_parser is not None else None)
    derived = reasoning_parser.reasoning_config() if reasoning_parser is not None else None
    if derived is not None and engine.config.reasoning_config is None:
        # `serve` gives the engine these at start; an engine built without them gets them here.
        engine.set_reasoning_config(derived)
    if not isinstance(response_role, str) or not response_role.strip():
        raise ValueError(f"response_role must be a non-empty string, got {response_role!r}")
    metrics.check_prefix(metrics_prefix)
    template = ChatTemplate.resolve(chat_template, chat_template_content_format, engine.tokenizer)
    transfer = _kv_transfer(engine, kv_role, kv_transfer_ttl_s, api_key, kv_prefill_urls)
    names = (served_model_name,) if isinstance(served_model_name, str) \
        else tuple(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("served_model_name: give one or more non-empty names")
    for name in names:
        if name in engine.lora_adapters:
            raise ValueError(f"LoRA adapter name {name!r} is a served model name")

    state = ServerState(
        engine=engine, served_model_name=names[0], model_aliases=names[1:],
        chat_template=template, response_role=response_role,
        limits=ModelLimits(max_model_len=engine.max_model_len, vocab_size=engine.model.vocab_size),
        # Without a tokenizer, logprob entries name tokens by id (vLLM's
        # return_tokens_as_token_ids form), for every request and route.
        token_texts=TokenTexts(engine.tokenizer) if engine.tokenizer is not None
        else TokenIdTexts(),
        tool_parser=parsing.tool_parser(),
        enable_auto_tool_choice=parsing.enable_auto_tool_choice,
        reasoning_parser=reasoning_parser,
        max_logprobs=engine.config.max_logprobs if parsing.max_logprobs is None
        else parsing.max_logprobs, kv_transfer=transfer,
        return_tokens_as_token_ids=parsing.return_tokens_as_token_ids,
        responses=ResponseStore(max_stored_responses),
        sampling_defaults=sampling_defaults or SamplingDefaults(),
        enable_prompt_embeds=enable_prompt_embeds, request_log=request_log,
        default_chat_template_kwargs=dict(default_chat_template_kwargs or {}),
        force_include_usage=force_include_usage,
        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # From here on /health says 503, so a load balancer stops sending work while we stop.
        state.shutting_down = True
        engine.shutdown()

    docs: dict[str, Any] = {} if enable_docs else {"docs_url": None, "redoc_url": None,
                                                   "openapi_url": None}
    app = FastAPI(title="ksana-llm", version=ksana_llm.__version__, lifespan=lifespan, **docs)
    app.state.server = state
    install_error_handlers(app)

    from ksana_llm.server.classification import router as classification_router
    from ksana_llm.server.pooling import router as pooling_router
    from ksana_llm.server.embeddings import router as embeddings_router
    from ksana_llm.server.invocations import router as invocations_router
    from ksana_llm.server.misc_routes import router as misc_router
    from ksana_llm.server.openai_routes import router as openai_router
    from ksana_llm.server.responses import router as responses_router
    from ksana_llm.server.scores import router as scores_router

    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(misc_router)
    app.include_router(embeddings_router)
    app.include_router(scores_router)
    app.include_router(classification_router)
    app.include_router(pooling_router)
    app.include_router(invocations_router)
    if allow_runtime_lora_updating:
        from ksana_llm.server.lora_routes import router as lora_router

        app.include_router(lora_router)
    if enable_weight_updates:
        from ksana_llm.server.weight_routes import router as weight_router

        app.include_router(weight_router)
    if enable_tokenizer_info_endpoint:
        from ksana_llm.server.tokenizer_info import router as tokenizer_info_router

        app.include_router(tokenizer_info_router)
    if engine.config.enable_sleep_mode:
        from ksana_llm.server.sleep_routes import router as sleep_router

        app.include_router(sleep_router)
    if engine.config.profiler_config is not None:
        from ksana_llm.server.profile_routes import router as profile_router

        app.include_router(profile_router)
    if transfer is not None and transfer.exports:
        kv_transfer.mount(app)  # GET /kv_transfer/{id}

    # ---- extension point: metrics (/metrics) and the native API (/generate, /forward) ----------
    if mount_extensions:
        _mount_extensions(app, engine, state, metrics_prefix)

    # Added last = outermost: the key is checked before the body is even read.
    app.add_middleware(LoadTrackingMiddleware, load=state.load)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if cors is not None:
        add_cors(app, cors)
    add_user_middlewares(app, user_middleware)
    app.add_middleware(RequestIdMiddleware)  # every answer carries its id
    app.add_middleware(DisconnectWatchMiddleware)  # outermost: sees the client leave first
    return app


def _kv_transfer(engine: Engine, role: str | None, ttl_s: float | None, api_key: str | None,
                 prefill_urls: list[str] | None) -> kv_transfer.KvTransfer | None:
    if role is None:
        if ttl_s is not None or prefill_urls:
            raise ValueError("--kv-transfer-ttl and --kv-prefill-url need --kv-role")
        return None
    check_kv_role(role, engine.config.tensor_parallel_size, engine.config.pipeline_parallel_size)
    store = kv_transfer.KvTransferStore()
    if ttl_s is not None:
        if ttl_s <= 0:
            raise ValueError(f"--kv-transfer-ttl must be > 0, got {ttl_s}")
        store.ttl_s = ttl_s
    layout = engine.kv_layout
    if layout is None:  # (a parallel engine: check_kv_role refused it already)
        raise ValueError("--kv-role needs a single-rank engine")
    # The largest payload a decode server accepts: a whole context's KV, and room for the header.
    max_payload = layout.bytes_per_token * engine.max_model_len + 2**20
    return kv_transfer.KvTransfer(role, lambda: engine.kv_layout, max_payload, store=store,
                                  api_key=api_key,
                                  prefill_urls=tuple(u.rstrip("/") for u in prefill_urls or ()))


def check_kv_role(role: str | None, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """ValueError for a `--kv-role` this server cannot take (run before the model loads)."""
    if role is None:
        return
    if role not in KV_ROLES:
        raise ValueError(f"--kv-role must be one of {', '.join(KV_ROLES)}, got {role!r}")
    if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
        raise ValueError("--kv-role needs a single-rank engine (tensor_parallel_size=1 and "
                         "pipeline_parallel_size=1): a parallel engine's KV is split over ranks")


def run_server(args: argparse.Namespace) -> int:
    parsing = output_parsing_from_args(args)
    parsing.check()  # before the model loads: a misspelt parser name fails at once
    tls = uvicorn_tls_options(args.ssl_certfile, args.ssl_keyfile,
                              args.ssl_keyfile_password)  # so does a bad certificate
    middleware = user_middlewares(getattr(args, "middleware", None))  # and a bad --middleware
    check_sampling_defaults_args(args)  # and a bad --generation-config
    config, settings = configs_from_args(args)
    if getattr(args, "data_parallel_size", 1) > 1:
        from ksana_llm.server.data_parallel import run_data_parallel

        return run_data_parallel(args, config)
    kv_role, kv_ttl = kv_transfer_from_args(args, settings)
    check_kv_role(kv_role, config.tensor_parallel_size, config.pipeline_parallel_size)
    node = multi_node_env()
    if node is not None and node.node_rank != 0:
        return run_worker_node(worker_spec(config), node)  # no HTTP here: the master serves
    chat_template = load_chat_template(args.chat_template)
    sock = listening_socket(args.host, args.port)
    try:
        engine = Engine(config.model, config=config)
        try:
            check_model_task_args(args, engine.model)
            defaults = sampling_defaults_from_args(args, engine.model.path)
        except ValueError:
            engine.shutdown()
            raise
    except BaseException:
        sock.close()
        raise
    app = build_app(engine, served_model_name=args.served_model_name
                    or default_served_model_name(config.model),
                    api_key=args.api_key, chat_template=chat_template,
                    max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES, parsing=parsing,
                    kv_role=kv_role, kv_transfer_ttl_s=kv_ttl,
                    kv_prefill_urls=getattr(args, "kv_prefill_url", None),
                    allow_runtime_lora_updating=bool(getattr(args, "allow_runtime_lora_updating",
                                                             False)),
                    enable_weight_updates=bool(getattr(args, "enable_weight_updates", False)),
                    max_stored_responses=DEFAULT_MAX_STORED_RESPONSES
                    if getattr(args, "max_stored_responses", None) is None
                    else args.max_stored_responses,
                    sampling_defaults=defaults, cors=cors_from_args(args),
                    enable_docs=not getattr(args, "disable_fastapi_docs", False),
                    enable_tokenizer_info_endpoint=bool(
                        getattr(args, "enable_tokenizer_info_endpoint", False)),
                    middleware=middleware, **request_options_from_args(args))
    server = AnnouncingServer(uvicorn_config(
        app, args, tls, timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S),
        f"serving {app.state.server.served_model_name!r} (OpenAI API under /v1)")
    stats_log = None if getattr(args, "disable_log_stats", False) else StatsLogThread(
        engine, getattr(args, "log_stats_interval", None) or DEFAULT_STATS_INTERVAL_S).start()
    died = threading.Event()
    threading.Thread(target=_watch_engine_and_shutdown,
                     args=(engine, server, app.state.server, args.shutdown_timeout, died),
                     name="ksana-llm-engine-watch", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if stats_log is not None:
            stats_log.stop()
        engine.shutdown()
    return 1 if died.is_set() else 0


# What uvicorn's graceful shutdown waits past --shutdown-timeout: time for the requests failed
# then to send their errors before it cancels whatever is left.
SHUTDOWN_MARGIN_S = 5.0


def _watch_engine_and_shutdown(engine: Engine, server: Any, state: ServerState,
                               shutdown_timeout: float | None, died: threading.Event) -> None:
    """A dead engine (e.g. a worker rank of a parallel run died) cannot serve again: /health is
    already 503; stop the server too and exit non-zero, so a supervisor restarts the process.

    On SIGTERM / SIGINT, in-flight requests get `shutdown_timeout` seconds to finish. Then the
    engine is shut down, which fails what still runs with EngineDeadError: a 503 with an OpenAI
    error body, or an error event and [DONE] on a stream. (uvicorn's own deadline, a margin
    later, cancels the tasks: clients got a bare 500 or a stream cut mid-chunk from that.)"""
    while not server.should_exit:
        if server.started and not engine.is_running:
            died.set()
            logger.error("the engine stopped (%s); shutting the server down", engine.failure)
            server.should_exit = True
            return
        time.sleep(0.1)
    state.shutting_down = True  # /health says 503 to anyone still connected
    if shutdown_timeout is None:
        return
    time.sleep(shutdown_timeout)
    if engine.is_running:
        logger.warning("shutdown: failing the requests still running after %g s",
                       shutdown_timeout)
        engine.shutdown()


def worker_spec(config: Any) -> Any:
    """The launch spec of a non-master node, from the same settings the master was given."""
    from ksana_llm.api.model import resolve_device, resolve_dtype
    from ksana_llm.distributed.runtime import LaunchSpec
    from ksana_llm.loader import resolve_model_dir

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    folder = resolve_model_dir(config.model, revision=config.revision,
                               download_dir=config.download_dir)
    return LaunchSpec(str(folder), str(dtype).removeprefix("torch."),
                      device.type, tp_size=config.tensor_parallel_size,
                      pp_size=config.pipeline_parallel_size, quantization=config.quantization,
                      hf_overrides=config.hf_overrides, load_format=config.load_format)
