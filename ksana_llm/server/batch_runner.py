"""`ksana-llm run-batch`: a file of OpenAI requests through the server's own routes, in one
process and without a port (vLLM's `run-batch`, OpenAI's Batch API file format).

Input: JSONL, one request a line:
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
with `url` one of /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses. Output:
one line per input line, in input order:
    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
A request a route refuses keeps its status code and OpenAI error body, as the server would send
them; a line that is not a request at all (bad JSON, another URL or method, `stream: true`) gets
`"response": null` and an `error` saying why. Requests go in together (up to
`--max-concurrency` at a time), so they batch as a server's would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_line(line: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the request, None) or (None, the output line saying why it is not one)."""
    try:
        request = json.loads(line)
    except ValueError as exc:
        return None, _line_error(None, "invalid_json", f"Line is not valid JSON: {exc}")
    if not isinstance(request, dict):
        return None, _line_error(None, "invalid_request", "Line must be a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _line_error(custom_id, "invalid_request", "`custom_id` must be a string.")
    if request.get("method", "POST") != "POST":
        return None, _line_error(custom_id, "invalid_request", "`method` must be POST.")
    if request.get("url") not in BATCH_URLS:
        return None, _line_error(custom_id, "invalid_url",
                                 f"`url` must be one of {', '.join(BATCH_URLS)}.")
    body = request.get("body")
    if not isinstance(body, dict):
        return None, _line_error(custom_id, "invalid_request", "`body` must be an object.")
    if body.get("stream"):
        return None, _line_error(custom_id, "invalid_request",
                                 "`stream` is not supported in a batch file.")
    return request, None


async def run_requests(app: Any, lines: list[str], max_concurrency: int,
                       progress: Any = None) -> list[dict[str, Any]]:
    """Every line's output line, in order, from the routes of `app` (served in process)."""
    import httpx

    gate = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                 timeout=None) as client:

        async def one(line: str) -> dict[str, Any]:
            try:
                return await answer(line)
            finally:
                if progress is not None:
                    progress.update(1)

        async def answer(line: str) -> dict[str, Any]:
            request, refused = parse_line(line)
            if refused is not None:
                return refused
            async with gate:
                response = await client.post(request["url"], json=request["body"])
            try:
                body = response.json()
            except ValueError:
                body = {"error": {"message": response.text, "type": "internal_error"}}
            return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request["custom_id"],
                    "response": {"status_code": response.status_code,
                                 "request_id": body.get("id") if isinstance(body, dict) else None,
                                 "body": body},
                    "error": None}

        return list(await asyncio.gather(*(one(line) for line in lines)))


def run_batch(args: argparse.Namespace) -> int:
    """The `run-batch` command: read, answer, write; 0 once every line has its output line
    (requests the routes refused included: their errors are in the file)."""
    from tqdm import tqdm

    from ksana_llm.api.engine import Engine
    from ksana_llm.server.app import (build_app, configs_from_args, default_served_model_name,
                                      output_parsing_from_args)
    from ksana_llm.server.chat import load_chat_template

    source = Path(args.input_file)
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    parsing = output_parsing_from_args(args)
    parsing.check()
    config, _ = configs_from_args(args)
    chat_template = load_chat_template(args.chat_template)
    engine = Engine(config.model, config=config)
    try:
        app = build_app(engine, served_model_name=args.served_model_name
                        or default_served_model_name(config.model),
                        chat_template=chat_template, parsing=parsing, mount_extensions=False)
        concurrency = args.max_concurrency or config.max_queue_size
        with tqdm(total=len(lines), desc="requests", unit="req", disable=args.no_progress) as bar:
            outputs = asyncio.run(run_requests(app, lines, concurrency, bar))
    finally:
        engine.shutdown()
    with open(args.output_file, "w", encoding="utf-8") as out:
        for output in outputs:
            out.write(json.dumps(output, ensure_ascii=False) + "\n")
    return 0
