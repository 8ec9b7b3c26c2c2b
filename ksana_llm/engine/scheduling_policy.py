"""Scheduling policies: which waiting request starts first, and which running one yields.

A policy ranks each request once, when the scheduler takes it; a smaller rank is more urgent, and
equal ranks go in arrival order. The scheduler keeps its waiting, running and swapped-out queues
in that order: it admits from the front and preempts from the back. A `preemptive` policy also
lets a waiting request that cannot start push out running sequences of a strictly larger rank
(strictly, so that two requests of one rank never push each other out in turn).

    class ShortestPromptFirst(ksana_llm.SchedulingPolicy):
        def rank(self, request):
            return request.num_prompt_tokens

    engine = ksana_llm.Engine(scheduler=ShortestPromptFirst())
    # or, from the command line or a config: --scheduling-policy my_module:ShortestPromptFirst
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from ksana_llm.import_path import import_by_path


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may rank a request by (read-only)."""

    request_id: str
    priority: int  # the request's own priority (Request(priority=), HTTP "priority")
    arrival_time: float  # time.monotonic() when it was submitted
    num_prompt_tokens: int
    max_new_tokens: int
    num_sequences: int  # n parallel samples, or beams


class SchedulingPolicy:
    """Subclass it and override `rank` (and `preemptive`, `uses_priority` where they differ).

    `rank` runs on the engine's thread for every request, before it is queued: keep it cheap.
    If it raises, or returns anything but a finite real number, that request fails with the
    error (a `ValueError` for a bad value) and everyone else is served on. One policy object
    given to several engines is shared: its `rank` then runs on each engine's thread."""

    # A more urgent waiting request preempts running ones of a larger rank (see the module doc).
    preemptive: ClassVar[bool] = False
    # Whether a request's `priority` means something here; when not, a priority other than 0
    # is refused rather than silently ignored (vLLM's rule for its FCFS policy).
    uses_priority: ClassVar[bool] = True

    def rank(self, request: RequestInfo) -> float:
        return 0.0

    def rank_of(self, request: RequestInfo) -> float:
        """`rank`, checked: what the scheduler stores."""
        value = self.rank(request)
        try:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError
            rank = float(value)  # (numpy numbers too; an int past a float's range overflows)
        except (TypeError, OverflowError):
            rank = math.nan
        if not math.isfinite(rank):
            raise ValueError(f"scheduling policy {type(self).__name__}: rank() must return a "
                             f"finite number, got {value!r} for request {request.request_id!r}")
        return rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FifoPolicy(SchedulingPolicy):
    """First come, first served (vLLM's "fcfs")."""

    uses_priority = False


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` values first, then arrival order; a waiting request preempts running
    ones of a lower priority (vLLM's "priority")."""

    preemptive = True

    def rank(self, request: RequestInfo) -> float:
        return request.priority


BUILT_IN_POLICIES: MappingProxyType[str, type[SchedulingPolicy]] = MappingProxyType({
    "fifo": FifoPolicy, "fcfs": FifoPolicy, "priority": PriorityPolicy})


def resolve_scheduling_policy(spec: str | SchedulingPolicy | type[SchedulingPolicy]
                              ) -> SchedulingPolicy:
    """A policy from "fifo", "priority", an import path ("package.module:Class" or
    "package.module.Class") of a `SchedulingPolicy` subclass, the subclass, or an instance.
    Raises ValueError saying what is wrong."""
    found = scheduling_policy_source(spec)
    if isinstance(found, SchedulingPolicy):
        return found
    try:
        return found()
    except TypeError as exc:
        raise ValueError(f"cannot make a {found.__name__} without arguments ({exc}); pass an "
                         "instance instead") from None


def scheduling_policy_source(spec: str | SchedulingPolicy | type[SchedulingPolicy]
                             ) -> SchedulingPolicy | type[SchedulingPolicy]:
    """The instance, or the class to make one from, that `spec` names: checked (imported) but
    not made, so that checking a config builds no policy. ValueError saying what is wrong."""
    if isinstance(spec, SchedulingPolicy):
        return spec
    if isinstance(spec, type):
        if not issubclass(spec, SchedulingPolicy):
            raise ValueError(f"{spec.__name__} is not a SchedulingPolicy subclass")
        return spec
    if not isinstance(spec, str):
        raise ValueError("expected 'fifo', 'priority', a 'module:Class' import path or a "
                         f"SchedulingPolicy, got {type(spec).__name__}")
    if spec in BUILT_IN_POLICIES:
        return BUILT_IN_POLICIES[spec]
    if ":" not in spec and "." not in spec:
        raise ValueError(f"{spec!r} is neither 'fifo', 'priority' nor a 'module:Class' import "
                         "path of a SchedulingPolicy subclass")
    cls = import_by_path(spec, "the scheduling policy")
    return scheduling_policy_source(cls)
