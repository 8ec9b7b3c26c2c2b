"""How many KV blocks fit: from an explicit count, or a share of free device memory / RAM."""

from __future__ import annotations

import torch


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_blocks(device: torch.device, bytes_per_block: int, *, ratio: float | None,
                    reserved_ratio: float = 0.01) -> int:
    """Blocks that fit in `ratio` of what the device has free now (weights already loaded).

    CUDA: free memory after the weights, less `reserved_ratio` of the total, times `ratio`
    (default 0.9). CPU: `ratio` (default 0.1) of the RAM currently available.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = (free - reserved_ratio * total) * (0.9 if ratio is None else ratio)
    else:
        budget = available_host_bytes() * (0.1 if ratio is None else ratio)
    blocks = int(budget // bytes_per_block)
    if blocks < 2:
        raise ValueError(f"not enough memory for the KV cache on {device}: {budget / 2**20:.0f} MiB "
                         "left; lower the dtype, or raise block_device_memory_ratio")
    return blocks
