"""The HTTP server: OpenAI-compatible routes over an `Engine` (see `build_app`, `run_server`)."""

from ksana_llm.server.app import build_app, run_server

__all__ = ["build_app", "run_server"]
