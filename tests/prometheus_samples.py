"""Reading a Prometheus exposition in tests: every sample by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels without model_name): value} of a rendered exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, frozenset(labels.items()))]
