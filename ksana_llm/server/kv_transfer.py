"""Prefill/decode disaggregation on the server side: `kv_transfer_params` and `GET /kv_transfer`.

A server started with `--kv-role prefill` (or `both`) answers a request carrying
`kv_transfer_params: {"do_remote_decode": true}` as usual (the router asks for one token), and
keeps the prompt's KV for a while under a fresh transfer id, returned in the response's
`kv_transfer_params` (`{"do_remote_prefill": true, "transfer_id": ..., "num_tokens": ...}`).
A server started with `--kv-role decode` (or `both`) given those params plus `remote_url` (the
prefill server's base URL; `ksana-llm router` adds it) fetches the KV from
`{remote_url}/kv_transfer/{transfer_id}` (one use, then it is gone), and its engine computes only
what the KV lacks (at least the last prompt token). If the fetch fails (expired, server gone, a
payload too large or from another model) the decode server computes the prompt itself: slower,
never wrong, logged and counted. `--kv-prefill-url` limits where a decode server fetches from;
without it, any URL a request names (so only the router should reach such a server).

The names follow vLLM's `kv_transfer_params`. The payload format is `TransferredKv.to_bytes`.
Only single-rank engines transfer KV (a tensor-parallel cache is split over ranks).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ksana_llm.config import KV_ROLES
from ksana_llm.runner.kv_transfer import KvLayout, TransferredKv
from ksana_llm.server.errors import APIError, bad_request

logger = logging.getLogger("ksana_llm.server")

KvRole = Literal["prefill", "decode", "both"]
__all__ = ["KV_ROLES", "KvTransfer", "KvTransferStore", "mount", "request_fields",
           "response_params"]

# KsanaLLM's connector.task_expire_sec: how long a prefill server keeps KV nobody fetched.
DEFAULT_TTL_S = 300.0


class KvTransferParams(BaseModel):
    """The request's `kv_transfer_params` (vLLM's field name)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    do_remote_decode: bool = False  # prefill server: keep this prompt's KV for a decode server
    do_remote_prefill: bool = False  # decode server: start from KV a prefill server keeps
    remote_url: str | None = None  # that prefill server's base URL, e.g. http://10.0.0.2:8090
    transfer_id: str | None = None
    num_tokens: int | None = None  # informational (what the prefill server returned)
    # Prefill server: the completion budget the decode server will be asked for (the router
    # sends the client's max_tokens): a prompt with no room for it is refused before it is
    # computed, as the decode server would refuse it after.
    decode_max_tokens: int | None = Field(None, gt=0)


@dataclass
class KvTransferStore:
    """Exported KV waiting to be fetched: each entry once, until `ttl_s` passes; past
    `max_bytes` in all, the oldest entries go first. Used from the event loop only."""

    ttl_s: float = DEFAULT_TTL_S
    max_bytes: int = 4 * 2**30
    _entries: OrderedDict[str, tuple[TransferredKv, float, int]] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def put(self, kv: TransferredKv) -> str:
        self._expire()
        size = sum(t.numel() * t.element_size() for t in kv.tensors)
        while self._entries and self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        transfer_id = uuid.uuid4().hex
        self._entries[transfer_id] = (kv, time.monotonic() + self.ttl_s, size)
        self._bytes += size
        return transfer_id

    def take(self, transfer_id: str) -> TransferredKv | None:
        self._expire()
        entry = self._entries.get(transfer_id)
        if entry is None:
            return None
        self._drop(transfer_id)
        return entry[0]

    def discard(self, transfer_id: str) -> bool:
        """Drop the KV kept under `transfer_id` unfetched (its request failed on the decode
        side); whether there was any."""
        self._expire()
        if transfer_id not in self._entries:
            return False
        self._drop(transfer_id)
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer_id in [k for k, (_, deadline, _) in self._entries.items() if deadline < now]:
            self._drop(transfer_id)

    def _drop(self, transfer_id: str) -> None:
        _, _, size = self._entries.pop(transfer_id)
        self._bytes -= size


@dataclass
class KvTransfer:
    """A server's part in disaggregated serving: its role, the KV it keeps for decode servers,
    and how it fetches KV from prefill servers (with its own API key: the servers of one
    deployment share one).

    `layout`: the engine's KV rows as they are now (fetched KV must match; its weights
    fingerprint changes with `update_weights`); `max_payload_bytes`: the largest
    payload fetched (a whole context's KV, plus room for the header); `prefill_urls`: the only
    base URLs fetched from (empty: any)."""

    role: KvRole
    layout: Callable[[], KvLayout]
    max_payload_bytes: int
    store: KvTransferStore = field(default_factory=KvTransferStore)
    api_key: str | None = None
    prefill_urls: tuple[str, ...] = ()
    fetch_timeout_s: float = 60.0
    num_fetched: int = 0
    num_fetch_failures: int = 0

    def may_fetch_from(self, url: str) -> bool:
        """Whether `url` names one of `prefill_urls`, however spelled: scheme and host in any
        case, the default port written or not, and localhost / 127.x / ::1 alike (a decode
        server listing http://localhost:8090 behind a router given http://127.0.0.1:8090)."""
        return _server_key(url) in {_server_key(u) for u in self.prefill_urls}

    @property
    def exports(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def imports(self) -> bool:
        return self.role in ("decode", "both")

    def stats(self) -> dict[str, Any]:
        return {"role": self.role, "num_kept": len(self.store), "num_fetched": self.num_fetched,
                "num_fetch_failures": self.num_fetch_failures}

    async def fetch(self, params: KvTransferParams) -> TransferredKv | None:
        """The KV `params` point to, checked against this engine's layout, or None (logged and
        counted) when it cannot be had."""
        url = f"{params.remote_url.rstrip('/')}/kv_transfer/{params.transfer_id}"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=self.fetch_timeout_s) as client:
                payload = await self._download(client, url, headers)
            # Off the event loop: reading a long prompt's payload takes milliseconds per MB.
            kv = await asyncio.to_thread(TransferredKv.from_bytes, payload)
            self.layout().check(kv)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            self.num_fetch_failures += 1
            logger.warning("could not use KV from %s (%s); computing the prompt here", url, exc)
            return None
        self.num_fetched += 1
        return kv

    async def _download(self, client: httpx.AsyncClient, url: str,
                        headers: dict[str, str]) -> bytes:
        """The payload, refused (ValueError) as soon as it passes `max_payload_bytes`."""
        limit = self.max_payload_bytes
        async with client.stream("GET", url, headers=headers) as response:
            response.raise_for_status()
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise ValueError(f"the payload is over {limit} bytes (a whole context's KV)")
                chunks.append(chunk)
        return b"".join(chunks)


def parse_params(raw: dict[str, Any] | None) -> KvTransferParams | None:
    if raw is None:
        return None
    try:
        return KvTransferParams.model_validate(raw)
    except ValueError as exc:
        raise bad_request(f"Invalid kv_transfer_params: {exc}", param="kv_transfer_params") from exc


async def request_fields(raw: dict[str, Any] | None, transfer: KvTransfer | None, *,
                         num_sequences: int, stream: bool,
                         check_room: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The engine `Request` fields for the HTTP request's `kv_transfer_params` (400 for what this
    server cannot do): `export_kv=True`, or `imported_kv=...`, or nothing. `check_room(n)`:
    raises the client's 400 when the prompt leaves no room for n completion tokens
    (`decode_max_tokens`)."""
    params = parse_params(raw)
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return {}
    if transfer is None:
        raise bad_request("kv_transfer_params needs a server started with --kv-role.",
                          param="kv_transfer_params")
    if params.do_remote_decode and params.do_remote_prefill:
        raise bad_request("kv_transfer_params: give do_remote_decode or do_remote_prefill, not both.",
                          param="kv_transfer_params")
    if params.do_remote_decode:
        if not transfer.exports:
            raise bad_request(f"This server's --kv-role is {transfer.role}: it does not keep KV for "
                              "other servers (do_remote_decode).", param="kv_transfer_params")
        if stream or num_sequences != 1:
            raise bad_request("kv_transfer_params.do_remote_decode needs one prompt, one sequence "
                              "(n=1, no best_of, no beam search) and no streaming.",
                              param="kv_transfer_params")
        if params.decode_max_tokens is not None and check_room is not None:
            check_room(params.decode_max_tokens)
        return {"export_kv": True}
    if not transfer.imports:
        raise bad_request(f"This server's --kv-role is {transfer.role}: it does not take KV from "
                          "other servers (do_remote_prefill).", param="kv_transfer_params")
    if not params.remote_url or not params.transfer_id:
        raise bad_request("kv_transfer_params.do_remote_prefill needs remote_url and transfer_id.",
                          param="kv_transfer_params")
    if not _is_http_url(params.remote_url):
        raise bad_request("kv_transfer_params.remote_url must be an http(s) URL.",
                          param="kv_transfer_params")
    if transfer.prefill_urls and not transfer.may_fetch_from(params.remote_url):
        raise bad_request("kv_transfer_params.remote_url is not one of this server's "
                          "--kv-prefill-url servers.", param="kv_transfer_params")
    kv = await transfer.fetch(params)
    return {} if kv is None else {"imported_kv": kv}


def _server_key(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path) of a base URL, in the forms `may_fetch_from` treats as one."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return ("", url, None, "")
    host = parsed.host.lower()
    if host in ("localhost", "::1") or host.startswith("127."):
        host = "loopback"
    port = parsed.port or {"http": 80, "https": 443}.get(parsed.scheme)
    return (parsed.scheme, host, port, parsed.path.rstrip("/"))


def _is_http_url(url: str) -> bool:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.host)


def response_params(transfer: KvTransfer | None, output: Any) -> dict[str, Any] | None:
    """The response's `kv_transfer_params` for a finished request that exported its KV."""
    kv = getattr(output, "exported_kv", None)
    if transfer is None or kv is None:
        return None
    return {"do_remote_prefill": True, "transfer_id": transfer.store.put(kv),
            "num_tokens": kv.num_tokens}


router = APIRouter()


@router.get("/kv_transfer/{transfer_id}")
async def fetch_kv(transfer_id: str, request: Request) -> Response:
    """The KV kept under `transfer_id` (safetensors bytes), once; 404 when unknown or expired."""
    transfer: KvTransfer | None = request.app.state.server.kv_transfer
    kv = transfer.store.take(transfer_id) if transfer is not None and transfer.exports else None
    if kv is None:
        raise APIError(404, f"No KV is kept under transfer id {transfer_id!r} (unknown, already "
                       "fetched or expired).", type="not_found_error", code="kv_transfer_not_found")
    # Off the event loop: writing a long prompt's payload takes milliseconds per MB, which the
    # streams of other requests would wait for.
    return Response(await asyncio.to_thread(kv.to_bytes), media_type="application/octet-stream")


@router.delete("/kv_transfer/{transfer_id}")
async def discard_kv(transfer_id: str, request: Request) -> dict[str, bool]:
    """Drop the KV kept under `transfer_id` (the router's call when the decode server refused
    or never got the request): its host memory is not held until the TTL; 404 when unknown,
    already fetched or expired."""
    transfer: KvTransfer | None = request.app.state.server.kv_transfer
    if transfer is None or not transfer.exports or not transfer.store.discard(transfer_id):
        raise APIError(404, f"No KV is kept under transfer id {transfer_id!r} (unknown, already "
                       "fetched or expired).", type="not_found_error", code="kv_transfer_not_found")
    return {"discarded": True}


def mount(app: FastAPI) -> None:
    app.include_router(router)
