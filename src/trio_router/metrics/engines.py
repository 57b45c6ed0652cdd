"""The per-engine gauges, written as exposition text straight from the routing table.

prometheus_client would build an object per sample and format each through generic code,
which at thousands of engines holds the serving thread for hundreds of milliseconds per
scrape; here each engine's label is escaped once and each sample is one formatted line.
Which engines get samples is `metrics.engine_series`."""

from __future__ import annotations

import math
from typing import Final

from ..config import EngineSeries
from ..table import RoutingTable

ACTIVE_S: Final = 300.0  # engine_series "active": engines routed to within this many seconds
# The per-engine gauges: (name, help, what of an engine), in exposition order.
ENGINE_GAUGES: Final = (
    ("trio_router_in_flight_requests", "Requests being served by each engine now.", "in_flight"),
    (
        "trio_router_engine_latency_seconds",
        "Moving average of this router's request latency (received to last byte) per engine.",
        "latency",
    ),
    (
        "trio_router_engine_time_to_first_byte_seconds",
        "Moving average of this router's time to first byte per engine.",
        "ttfb",
    ),
    (
        "trio_router_engine_running_requests",
        "The engine's own running requests (scraped from its /metrics; no sample while stale).",
        "running",
    ),
    (
        "trio_router_engine_waiting_requests",
        "The engine's own waiting requests (scraped from its /metrics; no sample while stale).",
        "waiting",
    ),
    (
        "trio_router_engine_kv_cache_usage_ratio",
        "The engine's own KV-cache usage (0..1) "
        "(scraped from its /metrics; no sample while stale).",
        "kv_cache_usage",
    ),
    (
        "trio_router_engine_prefix_cache_hit_tokens",
        "The engine's own prompt tokens served from its prefix cache since it started "
        "(vllm:prefix_cache_hits_total) (scraped from its /metrics; no sample while stale).",
        "prefix_cache_hits",
    ),
    (
        "trio_router_engine_prefix_cache_query_tokens",
        "The engine's own prompt tokens looked up in its prefix cache since it started "
        "(vllm:prefix_cache_queries_total) (scraped from its /metrics; no sample while stale).",
        "prefix_cache_queries",
    ),
)
# The figures of an engine's own /metrics (`EngineStats`), written while they are fresh.
_SCRAPED: Final = (
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_cache_hits",
    "prefix_cache_queries",
)


class EngineGauges:
    """The per-engine gauges. Every family is described (HELP and TYPE) on every scrape, so
    the target always names it; samples are written for every engine (`all`), for the
    engines in use (`active`: requests in flight there, or routed there within `ACTIVE_S`),
    or for none, and of those only the figures an engine has (scraped ones while fresh)."""

    def __init__(self, table: RoutingTable, which: EngineSeries) -> None:
        self._table, self._which = table, which
        self._labels: dict[str, bytes] = {}  # engine name -> '{engine="..."} ', escaped once

    def render(self, now: float) -> bytes:
        """The gauges' exposition text at `now` (Trio's clock, against `ACTIVE_S` and the
        scraped figures' freshness)."""
        lines = self._samples(now) if self._which != "none" else {}
        out: list[bytes] = []
        for name, help_text, what in ENGINE_GAUGES:
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n".encode())
            prefix = name.encode()
            out.extend(prefix + line for line in lines.get(what, ()))
        return b"".join(out)

    def _samples(self, now: float) -> dict[str, list[bytes]]:
        """{what of an engine: its sample lines less the family name} for the engines
        `metrics.engine_series` names."""
        engines = [
            e
            for e in self._table
            if self._which == "all" or e.in_flight or now - e.routed_at < ACTIVE_S
        ]
        lines: dict[str, list[bytes]] = {what: [] for _, _, what in ENGINE_GAUGES}
        labels = self._labels
        if len(labels) > 2 * len(self._table) + 64:  # engines that left: let their labels go
            labels.clear()
        for engine in engines:
            label = labels.get(engine.name)
            if label is None:
                label = labels[engine.name] = _engine_label(engine.name)
            lines["in_flight"].append(b"%s%d.0\n" % (label, engine.in_flight))
            figures = engine.requests
            if figures.latency is not None:
                lines["latency"].append(b"%s%s\n" % (label, _float(figures.latency)))
            if figures.ttfb is not None:
                lines["ttfb"].append(b"%s%s\n" % (label, _float(figures.ttfb)))
            stats = engine.stats
            if stats.fresh(now):
                for what in _SCRAPED:
                    if (value := getattr(stats, what)) is not None:
                        lines[what].append(b"%s%s\n" % (label, _float(value)))
        return lines


def _engine_label(name: str) -> bytes:
    escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return b'{engine="' + escaped.encode() + b'"} '


def _float(value: float) -> bytes:
    """`value` as the exposition format writes it."""
    if math.isfinite(value):
        return repr(float(value)).encode()
    return b"NaN" if math.isnan(value) else b"+Inf" if value > 0 else b"-Inf"
