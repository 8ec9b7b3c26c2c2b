"""The FastAPI application (`build_app`) and the `ksana-llm serve` entry point (`run_server`).

Everything a request needs lives in `app.state.server` (a `ServerState`), so several apps (e.g.
tests, or one per engine) can live in one process without sharing module-level state.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

import ksana_llm
from ksana_llm.api.engine import Engine
from ksana_llm.server.chat import load_chat_template
from ksana_llm.server.errors import install_error_handlers
from ksana_llm.server.logprobs import TokenTexts
from ksana_llm.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from ksana_llm.server.params import ModelLimits
from ksana_llm.server.state import ServerState

logger = logging.getLogger("ksana_llm.server")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # as TGI's payload_limit: far above any sane prompt

# ---- extension point: sibling modules owned by other work streams ------------------------------
# `ksana_llm.server.metrics` (GET /metrics, per-request series) and `ksana_llm.server.native`
# (POST /generate, /forward) plug in here when present. A module that does not exist is skipped;
# one that exists but fails to import or mount is a real error and stops start-up.

def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def _mount_extensions(app: FastAPI, engine: Engine, state: ServerState) -> None:
    metrics_module = _optional_module("ksana_llm.server.metrics")
    if metrics_module is not None:
        state.metrics = metrics_module.ServerMetrics(engine, model_name=state.served_model_name)
        metrics_module.mount(app, engine, state.metrics)
    native_module = _optional_module("ksana_llm.server.native")
    if native_module is not None and callable(getattr(native_module, "mount", None)):
        native_module.mount(app, engine)
    forward_module = _optional_module("ksana_llm.server.forward")
    if forward_module is not None:
        forward_module.mount(app)  # POST /forward


def build_app(engine: Engine, *, served_model_name: str, api_key: str | None = None,
              chat_template: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              mount_extensions: bool = True) -> FastAPI:
    """An OpenAI-compatible app over a running engine. The app shuts the engine down on exit.

    `chat_template` is template text (not a path); None uses the tokenizer's own.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (omit it to disable authentication)")
    if engine.tokenizer is None:
        raise ValueError("the OpenAI server needs a tokenizer; this model folder has none")

    state = ServerState(
        engine=engine, served_model_name=served_model_name, chat_template=chat_template,
        limits=ModelLimits(max_model_len=engine.max_model_len, vocab_size=engine.model.vocab_size),
        token_texts=TokenTexts(engine.tokenizer))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # From here on /health says 503, so a load balancer stops sending work while we stop.
        state.shutting_down = True
        engine.shutdown()

    app = FastAPI(title="ksana-llm", version=ksana_llm.__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)

    from ksana_llm.server.misc_routes import router as misc_router
    from ksana_llm.server.openai_routes import router as openai_router

    app.include_router(openai_router)
    app.include_router(misc_router)

    # ---- extension point: metrics (/metrics) and the native API (/generate, /forward) ----------
    if mount_extensions:
        _mount_extensions(app, engine, state)

    # Added last = outermost: the key is checked before the body is even read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def default_served_model_name(model: str | None) -> str:
    if model is None:
        from ksana_llm.loader.default_model import DEFAULT_MODEL_FILENAME

        return DEFAULT_MODEL_FILENAME.split(".")[0]  # SmolLM2-135M-Instruct
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


# CLI flag -> EngineConfig field, applied only when given (so a YAML file keeps the rest).
ENGINE_FLAGS = ("device", "dtype", "num_device_blocks", "block_token_num", "max_num_seqs",
                "max_step_tokens", "max_queue_size", "max_model_len", "seed")


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """EngineConfig from --config_file (when given) with the engine flags given on top."""
    from ksana_llm.config import EngineConfig

    overrides: dict[str, Any] = {name: getattr(args, name, None) for name in ENGINE_FLAGS}
    overrides["model"] = args.model
    if args.config_file is not None:
        yaml_config = _optional_module("ksana_llm.yaml_config")
        if yaml_config is None:
            raise ValueError("--config_file is not supported yet")
        # Returns (EngineConfig, ServerSettings); everything the engine acts on (including
        # max_token_len and waiting_timeout_in_ms) is already in the EngineConfig.
        config, _server_settings = yaml_config.load_engine_config(args.config_file, overrides)
        return config
    return EngineConfig(**{k: v for k, v in overrides.items() if v is not None})


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    config = engine_config_from_args(args)
    chat_template = load_chat_template(args.chat_template)
    engine = Engine(config.model, config=config)
    app = build_app(engine, served_model_name=args.served_model_name
                    or default_served_model_name(config.model),
                    api_key=args.api_key, chat_template=chat_template,
                    max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    finally:
        engine.shutdown()
    return 0
