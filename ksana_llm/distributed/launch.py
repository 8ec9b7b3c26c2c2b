"""Starting the ranks of a parallel run: rank 0 with this node's workers, or a non-master node."""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from ksana_llm.distributed.runtime import LaunchSpec, MultiNodeEnv, Runtime, init_runtime
from ksana_llm.distributed.worker import worker_main

logger = logging.getLogger("ksana_llm.distributed")


def spawn_workers(spec: LaunchSpec, ranks: list[int]) -> list[Any]:
    """One spawned process per rank (spawn, not fork: CUDA and threads do not survive a fork).
    Daemonic, so they never outlive this process."""
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in ranks:
        process = context.Process(target=worker_main, args=(rank, spec),
                                  name=f"ksana-llm-rank{rank}", daemon=True)
        process.start()
        workers.append(process)
    return workers


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
