"""The router's `GET /metrics`: every server's Prometheus metrics in one page, each sample
labelled with the `server` (its URL) it came from, so one scrape of the router (or of a
`serve --data-parallel-size N` front end) sees every replica. A server that cannot be reached
is left out and counted in `ksana_llm:router_unreachable_servers`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["PROBE_TIMEOUT_S", "merged_metrics", "scrape_servers"]

SERVER_LABEL = "server"
# How long the router waits for each server's answer to a probe (/metrics, /load, /v1/stats,
# /is_sleeping): one frozen server must not wedge the scraper or load balancer polling it.
PROBE_TIMEOUT_S = 10.0


class _Families:
    """A collector over already-made metric families (prometheus_client renders them)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merged_metrics(pages: dict[str, str], unreachable: int = 0) -> bytes:
    """One exposition page from each server's (URL -> its /metrics text): a family appears
    once, with every server's samples under a `server` label."""
    merged: dict[tuple[str, str], Metric] = {}
    for url, text in pages.items():
        for family in text_string_to_metric_families(text):
            key = (family.name, family.type)
            target = merged.get(key)
            if target is None:
                target = merged[key] = Metric(family.name, family.documentation, family.type,
                                              family.unit)
            for sample in family.samples:
                target.add_sample(sample.name, {**sample.labels, SERVER_LABEL: url},
                                  sample.value, sample.timestamp, sample.exemplar)
    gauge = Metric("ksana_llm:router_unreachable_servers",
                   "Servers whose /metrics the router could not read for this page.", "gauge")
    gauge.add_sample("ksana_llm:router_unreachable_servers", {}, float(unreachable))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), gauge]))
    return generate_latest(registry)


async def scrape_servers(client: httpx.AsyncClient, urls: Iterable[str],
                         headers: dict[str, str]) -> tuple[dict[str, str], int]:
    """Every server's /metrics text by URL, and how many could not be read (down, or not a
    200)."""
    async def scrape(url: str) -> tuple[str, str | None]:
        try:
            answer = await client.get(url + "/metrics", headers=headers, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return url, None
        return url, answer.text if answer.status_code == 200 else None

    results = await asyncio.gather(*map(scrape, dict.fromkeys(urls)))
    pages = {url: text for url, text in results if text is not None}
    return pages, len(results) - len(pages)
