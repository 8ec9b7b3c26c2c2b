"""Starting the ranks of a parallel run: rank 0 with this node's workers, or a non-master node."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import sys
import time
from collections.abc import Iterator
from typing import Any

from ksana_llm.distributed.runtime import LaunchSpec, MultiNodeEnv, Runtime, init_runtime
from ksana_llm.distributed.worker import worker_main

logger = logging.getLogger("ksana_llm.distributed")


def spawn_workers(spec: LaunchSpec, ranks: list[int]) -> list[Any]:
    """One spawned process per rank (spawn, not fork: CUDA and threads do not survive a fork).
    Daemonic, so they never outlive this process. Returns once each is running our code: a
    worker that dies before that fails the run here (see `await_started`)."""
    context = multiprocessing.get_context("spawn")
    started = context.Queue()
    workers = []
    with _main_file_hidden_if_missing():
        for rank in ranks:
            process = context.Process(target=worker_main, args=(rank, spec, started),
                                      name=f"ksana-llm-rank{rank}", daemon=True)
            process.start()
            workers.append(process)
    try:
        await_started(dict(zip(ranks, workers)), started, spec.timeout_s)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def await_started(workers: dict[int, Any], started: Any, timeout_s: float) -> None:
    """Wait until every worker (rank -> process) has put its rank on `started`. One that exits
    first (an import error, a main module spawn cannot re-run) is reported at once, instead of
    the run waiting out the rendezvous timeout for a rank that will never join."""
    pending = dict(workers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for rank, process in pending.items():
            if process.exitcode is not None:
                raise RuntimeError(f"worker rank {rank} exited with code {process.exitcode} "
                                   "before it started (its error is printed above)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker ranks {sorted(pending)} did not start within "
                               f"{timeout_s:g} s")
        try:
            pending.pop(started.get(timeout=0.1), None)
        except queue.Empty:
            pass


@contextlib.contextmanager
def _main_file_hidden_if_missing() -> Iterator[None]:
    """spawn makes each child re-run the parent's main script from its `__file__`; a script read
    from stdin (`python - < script`) has `__file__ == "<stdin>"`, which no child can open, so
    every worker would die. The workers need nothing from the main script, so such a path is
    hidden while they start (as for `python -c`, which has none)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (main is None or path is None or getattr(main, "__spec__", None) is not None
            or os.path.isfile(path)):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def stop_workers(workers: list[Any]) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
        worker.join(timeout=10)


def node_spec(spec: LaunchSpec, node: MultiNodeEnv | None) -> LaunchSpec:
    """The run's spec: with KsanaLLM's multi-node variables the nodes are the pipeline stages and
    the master's address comes from the environment; otherwise a free local port."""
    if node is None:
        return spec.with_free_port()
    if spec.pp_size not in (1, node.world_size):
        raise ValueError(f"pipeline_parallel_size {spec.pp_size} differs from WORLD_SIZE "
                         f"{node.world_size}: across nodes, each node is one pipeline stage")
    return LaunchSpec(**{**spec.__dict__, "pp_size": node.world_size,
                         "master_host": node.master_host, "master_port": node.master_port})


def start_master(spec: LaunchSpec, node: MultiNodeEnv | None) -> tuple[Runtime, list[Any]]:
    """Rank 0: start this node's other ranks, then join the run (waits for every rank)."""
    if node is not None and node.node_rank != 0:
        raise ValueError(f"NODE_RANK {node.node_rank} is a worker node: run `ksana-llm serve` there "
                         "with the same settings and it joins the master as a worker")
    spec = node_spec(spec, node)
    # One node runs every rank; in a multi-node run, this node's ranks are its stage's TP group.
    last = spec.tp_size if node is not None else spec.world_size
    workers = spawn_workers(spec, list(range(1, last)))
    try:
        runtime = init_runtime(spec, 0)
    except BaseException:
        stop_workers(workers)
        raise
    logger.info("parallel run: tensor parallel %d x pipeline %d, master %s:%d", spec.tp_size,
                spec.pp_size, spec.master_host, spec.master_port)
    return runtime, workers


def run_worker_node(spec: LaunchSpec, node: MultiNodeEnv) -> int:
    """A non-master node: its ranks serve steps until the master stops them. Returns an exit
    code (non-zero when a rank failed)."""
    spec = node_spec(spec, node)
    first = node.node_rank * spec.tp_size
    workers = spawn_workers(spec, list(range(first + 1, first + spec.tp_size)))
    try:
        worker_main(first, spec)
    except SystemExit as exc:
        stop_workers(workers)
        return int(exc.code or 1)
    for worker in workers:
        worker.join()
    return max([0, *(w.exitcode or 0 for w in workers)])
