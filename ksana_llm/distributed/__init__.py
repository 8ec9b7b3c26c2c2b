"""Tensor and pipeline parallelism on torch.distributed (NCCL on GPUs, gloo on CPUs)."""

from .context import ParallelContext, balanced_split

__all__ = ["ParallelContext", "balanced_split"]
