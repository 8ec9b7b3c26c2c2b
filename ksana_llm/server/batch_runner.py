"""`ksana-llm run-batch`: a file of OpenAI requests through the server's own routes, in one
process and without a port (vLLM's `run-batch`, OpenAI's Batch API file format).

Input: JSONL, one request a line:
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
with `url` one of /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses,
/v1/score (or /score), /v1/rerank (or /rerank, /v2/rerank). Output:
one line per input line, in input order (written as answers come, so a long batch's finished
lines are on disk while the rest run):
    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
A request a route refuses keeps its status code and OpenAI error body, as the server would send
them; a line that is not a request at all (bad JSON, another URL or method, `stream: true`, a
`background` response, whose answer would outlive the batch) gets `"response": null` and an
`error` saying why (so does a repeated `custom_id`). Every response carries a `request_id`: its
body's `id` (chatcmpl-..., as the server's logs name it), else (embeddings, errors) the route's
X-Request-Id. Requests go in
together (up to `--max-concurrency` at a time, default `--max-num-seqs`), so they batch as a
server's would; a full queue (429) is retried after its Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ksana_llm.server.json_body import load_json
from ksana_llm.server.middleware import REQUEST_ID_HEADER

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
              "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank")


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_line(line: str, seen: set[str]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the request, None) or (None, the output line saying why it is not one). `seen`: the
    custom ids of the lines before (each must be unique, as OpenAI requires)."""
    try:
        request = load_json(line)
    except ValueError as exc:
        return None, _line_error(None, "invalid_json", f"Line is not valid JSON: {exc}")
    if not isinstance(request, dict):
        return None, _line_error(None, "invalid_request", "Line must be a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _line_error(custom_id, "invalid_request", "`custom_id` must be a string.")
    if custom_id in seen:
        return None, _line_error(custom_id, "duplicate_custom_id",
                                 "`custom_id` repeats an earlier line's.")
    seen.add(custom_id)
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
    if body.get("background"):
        return None, _line_error(custom_id, "invalid_request",
                                 "`background` is not supported in a batch file: the answer "
                                 "would come after the batch ends.")
    return request, None


def _request_id(body: Any, response: Any) -> str | None:
    own = body.get("id") if isinstance(body, dict) else None
    return own if isinstance(own, str) else response.headers.get(REQUEST_ID_HEADER)


# A full queue (429) is retried after the server's Retry-After; a batch is not in a hurry.
MAX_QUEUE_FULL_RETRIES = 1000


async def run_requests(app: Any, lines: list[str], max_concurrency: int,
                       write: Callable[[dict[str, Any]], None],
                       progress: Any = None) -> None:
    """Answer every line through the routes of `app` (served in process); `write` gets each
    line's output, in input order, as soon as it and every line before it are done."""
    import httpx

    gate = asyncio.Semaphore(max_concurrency)
    # A route that fails with an exception answers 500 (its handler), not a crashed batch.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    done: dict[int, dict[str, Any]] = {}
    next_to_write = 0
    seen: set[str] = set()
    parsed = [parse_line(line, seen) for line in lines]
    async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                 timeout=None) as client:

        async def answer(request: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                for _ in range(MAX_QUEUE_FULL_RETRIES):
                    response = await client.post(request["url"], json=request["body"])
                    if response.status_code != 429:
                        break
                    await asyncio.sleep(float(response.headers.get("retry-after", 1)))
            try:
                body = response.json()
            except ValueError:
                body = {"error": {"message": response.text, "type": "internal_error"}}
            return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request["custom_id"],
                    "response": {"status_code": response.status_code,
                                 "request_id": _request_id(body, response),
                                 "body": body},
                    "error": None}

        async def one(index: int) -> None:
            nonlocal next_to_write
            request, output = parsed[index]
            if request is not None:
                try:
                    output = await answer(request)
                except Exception as exc:  # noqa: BLE001 - this line's failure, not the batch's
                    output = _line_error(request["custom_id"], "internal_error",
                                         f"{type(exc).__name__}: {exc}")
            done[index] = output
            while next_to_write in done:
                write(done.pop(next_to_write))
                next_to_write += 1
            if progress is not None:
                progress.update(1)

        await asyncio.gather(*(one(i) for i in range(len(lines))))


def run_batch(args: argparse.Namespace) -> int:
    """The `run-batch` command: read, answer, write as answers come. 0 once every line has its
    output line (requests the routes refused included: their errors are in the file); 1 when
    the engine died on the way (the rest of the lines then say so)."""
    from tqdm import tqdm

    from ksana_llm.api.engine import Engine
    from ksana_llm.server.app import build_app, configs_from_args, default_served_model_name
    from ksana_llm.server.model_tasks import check_model_task_args
    from ksana_llm.server.serve_options import (check_sampling_defaults_args,
                                                output_parsing_from_args,
                                                request_options_from_args,
                                                sampling_defaults_from_args)
    from ksana_llm.server.chat import load_chat_template

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    check_sampling_defaults_args(args)
    for flag, path in (("--input-file", args.input_file), ("--output-file", args.output_file)):
        if not path:
            raise ValueError(f"{flag} is required (on the command line or in --config)")
        if path == "-" or "://" in path:
            raise ValueError(f"{flag} must be a local file path, got {path!r}")
    if Path(args.output_file).resolve() == Path(args.input_file).resolve():
        raise ValueError(f"--output-file {args.output_file} is the input file: it would be "
                         "emptied before the run, and the requests lost if the run stops")
    # JSON lines end at "\n" only: str.splitlines would also cut at U+2028 inside a string.
    # utf-8-sig: a file saved with a byte-order mark (Windows editors) reads like any other.
    text = Path(args.input_file).read_text(encoding="utf-8-sig")
    lines = [line for line in text.split("\n") if line.strip()]
    parsing = output_parsing_from_args(args)
    parsing.check()
    config, _ = configs_from_args(args)
    chat_template = load_chat_template(args.chat_template)
    with open(args.output_file, "w", encoding="utf-8") as out:  # a bad path fails before loading
        engine = Engine(config.model, config=config)
        try:
            check_model_task_args(args, engine.model)
            app = build_app(engine, served_model_name=args.served_model_name
                            or default_served_model_name(config.model),
                            chat_template=chat_template, parsing=parsing,
                            mount_extensions=False,
                            sampling_defaults=sampling_defaults_from_args(args, engine.model.path),
                            **request_options_from_args(args))

            def write(output: dict[str, Any]) -> None:
                out.write(json.dumps(output, ensure_ascii=False) + "\n")
                out.flush()

            concurrency = args.max_concurrency or config.max_num_seqs
            with tqdm(total=len(lines), desc="requests", unit="req",
                      disable=args.no_progress) as bar:
                asyncio.run(run_requests(app, lines, concurrency, write, bar))
            died = not engine.is_running
        finally:
            engine.shutdown()
    return 1 if died else 0
