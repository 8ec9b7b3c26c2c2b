"""The engine's start-up heap, moved out of the garbage collector's way while it serves.

CPython's cyclic collector runs a full (oldest-generation) pass whenever enough objects have
survived the young passes, and a full pass walks every tracked object in the process: after
torch, transformers and a loaded model that is a few hundred thousand objects
(`benchmarks/step_overhead.py` reports the passes: 200-270 ms each on a 2-core VM without the
freeze, ~8 ms with it, at 256 sequences). The step loop runs on one Python thread, so each
pause stalls the device for tens of decode steps.
Nearly all of those objects are made at start-up and live as long as the engine;
`gc.freeze()` moves them to the permanent generation, which no pass walks, so a full pass then
costs what the requests made since.

`gc.freeze` is process-wide: a process with several engines freezes at each start (each freeze
adds what is new) and thaws at each stop, after which the others' start-up objects are walked
again (slower passes, nothing lost). Thawing gives the stopped engine's objects back to the
collector: the engine's own are freed by reference counting either way, but a reference cycle
(a plugin's, a custom model's) would otherwise never be.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect start-up garbage, then freeze every object still alive."""
    gc.collect()  # garbage frozen now would be kept until a thaw
    gc.freeze()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (an engine stopped)."""
    gc.unfreeze()
