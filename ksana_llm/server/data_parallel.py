"""`serve --data-parallel-size N` (vLLM's): N replicas of the model behind one endpoint.

Each replica is a `serve` process of its own, listening on 127.0.0.1 at a free port, with the
user's command line (without the TLS and root-path settings, which are the front end's). On
CUDA, replica i sees its own devices: the i-th group of tensor x pipeline parallel size among
the visible ones. On CPU the replicas share the cores (each gets its share as its thread
count, unless OMP_NUM_THREADS is set). The front end is the router (`ksana_llm.server.router`)
with the replicas as its servers, taken in turn; it answers on --host / --port with the API
key, TLS and CORS settings given. A replica that dies stops the whole server (exit 1), as a
dead engine stops `serve`, so a supervisor restarts it; stopping the server stops the replicas.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

logger = logging.getLogger("ksana_llm.server")

# Flags only the front end uses: a replica talks plain HTTP to the router.
_FRONT_END_FLAGS = ("--ssl-certfile", "--ssl-keyfile", "--ssl-keyfile-password", "--root-path")
HEALTH_POLL_S = 0.5


@dataclass
class Replica:
    rank: int
    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def replica_command(command_line: Sequence[str], port: int) -> list[str]:
    """A replica's `ksana-llm` command line: the user's without the front end's flags, one
    replica, listening on 127.0.0.1:`port` (later flags win in argparse)."""
    kept: list[str] = []
    skip = False
    for arg in command_line:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _FRONT_END_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return [sys.executable, "-m", "ksana_llm.cli", *kept, "--data-parallel-size", "1",
            "--host", "127.0.0.1", "--port", str(port)]


def replica_environments(size: int, ranks_per_replica: int, device: str | None
                         ) -> list[dict[str, str]]:
    """Each replica's environment: its CUDA devices, or on CPU its share of the threads."""
    import torch

    base = dict(os.environ)
    on_cuda = device != "cpu" and torch.cuda.is_available()
    if not on_cuda:
        threads = str(max(1, (os.cpu_count() or 1) // size))
        return [{**base, "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", threads)}
                for _ in range(size)]
    visible = [d for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] \
        or [str(i) for i in range(torch.cuda.device_count())]
    if size * ranks_per_replica > len(visible):
        raise ValueError(f"--data-parallel-size {size} replicas of {ranks_per_replica} GPU(s) "
                         f"each need {size * ranks_per_replica} GPUs; {len(visible)} visible")
    return [{**base, "CUDA_VISIBLE_DEVICES": ",".join(
        visible[i * ranks_per_replica:(i + 1) * ranks_per_replica])} for i in range(size)]


def check_data_parallel(args: argparse.Namespace, tensor_parallel_size: int) -> None:
    """ValueError for settings a data-parallel server cannot take."""
    if getattr(args, "kv_role", None) or getattr(args, "kv_transfer_config", None):
        raise ValueError("--data-parallel-size with --kv-role / --kv-transfer-config: start the "
                         "prefill and decode servers yourself behind `ksana-llm router`")
    if tensor_parallel_size == 0:
        raise ValueError("--data-parallel-size needs an explicit --tensor-parallel-size (0 "
                         "means every visible GPU, which the replicas would share)")
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise ValueError("--data-parallel-size runs on one node; WORLD_SIZE says several")


def run_data_parallel(args: argparse.Namespace, config: object) -> int:
    """Start the replicas, wait until each is healthy, and route to them until stopped."""
    from ksana_llm.distributed.runtime import free_port
    from ksana_llm.server.listen import AnnouncingServer, uvicorn_config, uvicorn_tls_options
    from ksana_llm.server.middleware import DEFAULT_MAX_BODY_BYTES, cors_from_args
    from ksana_llm.server.router import RouterConfig, build_router_app

    size = args.data_parallel_size
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    check_data_parallel(args, tp)
    tls = uvicorn_tls_options(args.ssl_certfile, args.ssl_keyfile, args.ssl_keyfile_password)
    environments = replica_environments(size, tp * pp, config.device)
    replicas: list[Replica] = []
    try:
        for rank, env in enumerate(environments):
            port = free_port()
            replicas.append(Replica(rank, port, subprocess.Popen(
                replica_command(args.command_line, port), env=env,
                preexec_fn=_die_with_parent)))
            logger.warning("data-parallel replica %d: %s (pid %d)", rank, replicas[-1].url,
                           replicas[-1].process.pid)
        _wait_healthy(replicas)
        app = build_router_app(RouterConfig([], [r.url for r in replicas], api_key=args.api_key),
                               max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                               cors=cors_from_args(args))
        server = AnnouncingServer(uvicorn_config(app, args, tls),
                                  f"serving {size} data-parallel replicas")
        died = threading.Event()
        threading.Thread(target=_watch_replicas, args=(replicas, server, died),
                         name="ksana-llm-replica-watch", daemon=True).start()
        # uvicorn re-raises the SIGTERM it shut down for once it is done, with the handler it
        # found: this one ends the process through the `finally` below, which stops the replicas.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        server.run()
        return 1 if died.is_set() else 0
    finally:
        _stop(replicas, args.shutdown_timeout)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _die_with_parent() -> None:
    """In the replica, before it starts: SIGTERM when the launcher dies, however it dies
    (Linux; elsewhere the launcher's own shutdown stops the replicas)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_healthy(replicas: list[Replica]) -> None:
    """Until every replica's /health answers 200; a replica that exits first is an error."""
    waiting = list(replicas)
    while waiting:
        for replica in list(waiting):
            code = replica.process.poll()
            if code is not None:
                raise RuntimeError(f"data-parallel replica {replica.rank} exited with {code} "
                                   "while starting (its log is above)")
            try:
                if httpx.get(replica.url + "/health", timeout=2).status_code == 200:
                    waiting.remove(replica)
            except httpx.HTTPError:
                pass
        if waiting:
            time.sleep(HEALTH_POLL_S)


def _watch_replicas(replicas: list[Replica], server: object, died: threading.Event) -> None:
    """A replica that exits while serving stops the front end (and so the others)."""
    while not server.should_exit:
        for replica in replicas:
            if replica.process.poll() is not None:
                logger.error("data-parallel replica %d exited with %s; shutting down",
                             replica.rank, replica.process.returncode)
                died.set()
                server.should_exit = True
                return
        time.sleep(HEALTH_POLL_S)


def _stop(replicas: list[Replica], shutdown_timeout: float | None) -> None:
    """SIGTERM every replica (each finishes what it runs, within --shutdown-timeout), then kill
    what is left."""
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.terminate()
    deadline = time.monotonic() + (shutdown_timeout or 0) + 30
    for replica in replicas:
        try:
            replica.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()
