"""OpenMP thread pools on a CPU, which the engine's step thread must not share its cores with.

torch's CPU kernels run their parallel regions on OpenMP (libgomp in the Linux wheels), which
keeps one pool of worker threads per thread that has run a parallel region. A model is loaded
on the caller's thread and stepped on the engine's, so there are two pools; once their threads
outnumber the cores, libgomp stops spinning between regions and every region pays a wake-up.
A decode step is hundreds of small regions: on a 2-core VM, batch-1 decode of SmolLM2 took
1.5x the time (measured: 32 ms against 20 ms for the same matmuls on a thread whose pool is the
only one). Freeing the caller's pool once the model is loaded gives the step thread the cores;
the pool comes back if the caller runs a parallel region again.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

# OpenMP 5's omp_pause_soft: free the threads, keep what can be re-created.
_OMP_PAUSE_SOFT = 1


def loaded_libgomp() -> Path | None:
    """The libgomp this process's torch runs on (the wheel bundles its own), or None (another
    OpenMP, or none: nothing to release)."""
    bundled = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if bundled:
        return bundled[0]
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1]
        if "libgomp" in Path(path).name:
            return Path(path)
    return None


def openmp_pool_releaser() -> Callable[[], bool]:
    """A function that frees the calling thread's OpenMP worker threads (libgomp's
    `omp_pause_resource_all`, which acts on the caller's pool only) and says whether it did;
    cheap when there is no pool. Without libgomp, or on one too old to pause, it does nothing
    (False)."""
    library = loaded_libgomp()
    try:
        pause = ctypes.CDLL(str(library)).omp_pause_resource_all if library else None
    except (OSError, AttributeError):
        pause = None
    if pause is None:
        return lambda: False
    pause.argtypes = [ctypes.c_int]
    return lambda: pause(_OMP_PAUSE_SOFT) == 0
