"""Scheduling policies written the way a user would (`ksana_llm.SchedulingPolicy` subclasses),
importable by path for the server tests (`--scheduling-policy tests.scheduling_policies:...`)."""

from __future__ import annotations

import ksana_llm as kt


class ShortestPromptFirst(kt.SchedulingPolicy):
    """Fewest prompt tokens first: a shortest-job-first order that never preempts."""

    uses_priority = False

    def rank(self, request: kt.RequestInfo) -> float:
        return request.num_prompt_tokens


class PreemptiveShortestPromptFirst(ShortestPromptFirst):
    """The same order; a shorter waiting prompt pushes out a longer running one."""

    preemptive = True


class RecordingPolicy(kt.SchedulingPolicy):
    """Ranks everyone alike (arrival order) and keeps every RequestInfo it was shown."""

    def __init__(self) -> None:
        self.seen: list[kt.RequestInfo] = []

    def rank(self, request: kt.RequestInfo) -> float:
        self.seen.append(request)
        return 0


class CountedPolicy(kt.SchedulingPolicy):
    """Counts how many of it were made (a policy's __init__ may have side effects)."""

    made = 0

    def __init__(self) -> None:
        type(self).made += 1


class BrokenRankPolicy(kt.SchedulingPolicy):
    """A policy with bugs, keyed by request id: what a rank other than a finite number does."""

    def rank(self, request: kt.RequestInfo):
        bad = {"nan": float("nan"), "text": "soon", "bool": True, "inf": float("inf"),
               "huge": 10**400}
        if request.request_id == "raises":
            raise KeyError("no rank for this one")
        return bad.get(request.request_id, 1)
