"""Starting the process groups of a parallel run, on one node or several.

KsanaLLM's environment names the run: WORLD_SIZE (nodes), NODE_RANK, MASTER_HOST, MASTER_PORT.
Each node runs `tensor_parallel_size` ranks; the nodes are the pipeline stages (KsanaLLM splits
layers between nodes), so global rank = node_rank * tp_size + local rank. Rank 0 runs the
scheduler (and the server); every other rank is a worker that runs each step's forward.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ksana_llm.distributed.context import ParallelContext


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a rank needs to join the run and load its shard (picklable: sent to spawned
    workers)."""

    model_dir: str
    dtype: str
    device_type: str  # "cpu" (gloo) or "cuda" (NCCL)
    tp_size: int = 1
    pp_size: int = 1
    master_host: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 300.0
    quantization: str | None = None  # EngineConfig.quantization
    hf_overrides: dict[str, Any] | None = None  # EngineConfig.hf_overrides (JSON values)
    load_format: str = "auto"  # EngineConfig.load_format

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def with_free_port(self) -> LaunchSpec:
        if self.master_port:
            return self
        return LaunchSpec(**{**self.__dict__, "master_port": free_port(self.master_host)})


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class MultiNodeEnv:
    world_size: int  # nodes
    node_rank: int
    master_host: str
    master_port: int


def multi_node_env(environ: dict[str, str] | None = None) -> MultiNodeEnv | None:
    """KsanaLLM's multi-node variables, or None for a single-node run (WORLD_SIZE unset or 1)."""
    env = os.environ if environ is None else environ
    world = env.get("WORLD_SIZE", "1")
    try:
        world_size = int(world)
        if world_size <= 1:
            return None
        node_rank = int(env.get("NODE_RANK", "0"))
        port = int(env.get("MASTER_PORT", "0"))
    except ValueError as exc:
        raise ValueError(f"WORLD_SIZE, NODE_RANK and MASTER_PORT must be integers: {exc}") from exc
    host = env.get("MASTER_HOST", "")
    if not host or not port:
        raise ValueError("a multi-node run (WORLD_SIZE > 1) needs MASTER_HOST and MASTER_PORT")
    if not 0 <= node_rank < world_size:
        raise ValueError(f"NODE_RANK must be in [0, {world_size}), got {node_rank}")
    return MultiNodeEnv(world_size, node_rank, host, port)


@dataclass
class Runtime:
    """This rank's place in the run and its groups."""

    ctx: ParallelContext
    control_group: Any  # gloo group over all ranks: step messages (Python objects)
    device: torch.device


def node_local_rank(rank: int, spec: LaunchSpec, *, multi_node: bool) -> int:
    """This rank's place among the ranks of its own machine, which picks its GPU: on one node
    every rank of the run (each pipeline stage on GPUs of its own); across nodes each node is
    one pipeline stage of tp_size ranks."""
    return rank % spec.tp_size if multi_node else rank


def init_runtime(spec: LaunchSpec, rank: int) -> Runtime:
    """Join the run as `rank` (blocks until every rank has joined) and build the groups."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    tp = spec.tp_size
    local_rank = rank % tp
    device = torch.device("cpu")
    if spec.device_type == "cuda":
        index = node_local_rank(rank, spec, multi_node=multi_node_env() is not None)
        device = torch.device("cuda", index % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{spec.master_host}:{spec.master_port}",
                            rank=rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    # Every rank creates every group, in the same order (a torch.distributed rule).
    tp_groups = [dist.new_group(list(range(p * tp, (p + 1) * tp))) for p in range(spec.pp_size)]
    control = dist.new_group(list(range(spec.world_size)), backend="gloo")
    pp_rank = rank // tp
    ctx = ParallelContext(tp_size=tp, tp_rank=local_rank, pp_size=spec.pp_size, pp_rank=pp_rank,
                          tp_group=tp_groups[pp_rank] if tp > 1 else None)
    return Runtime(ctx, control, device)


def broadcast_message(message: Any, runtime: Runtime) -> Any:
    """Rank 0 sends `message` to every rank; every rank returns it."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=runtime.control_group)
    return box[0]


def gather_messages(message: Any, runtime: Runtime) -> list[Any]:
    """Every rank's `message`, in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message, group=runtime.control_group)
    return out


def shutdown_runtime() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
