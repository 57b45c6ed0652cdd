"""Prometheus metrics of one router process, on a private registry built by `server.run`.

Request-path updates go through cached label children (one dict lookup per request), and
everything that is a level rather than an event (in-flight per engine, routable engines,
discovery health) is read from the live objects only when `/metrics` is scraped. No Trio here,
no global registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from .endpoints import EngineState, RoutingTable

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST.encode("ascii")

# Seconds. Non-streamed completions take seconds to minutes; a router answering from its own
# state (errors, admin) takes well under a millisecond.
LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                          5.0, 10.0, 30.0, 60.0, 120.0, 300.0, float("inf"))
TTFB_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, float("inf"))

NO_LABEL: Final = ""  # label value when a request never got as far as a model or an engine


class _Child:
    """The prometheus-client child objects one (model, engine, status) request updates."""

    __slots__ = ("count", "latency")

    def __init__(self, count: Any, latency: Any) -> None:
        self.count, self.latency = count, latency


class Metrics:
    """The router's metrics. `observe_request` and `observe_ttfb` are the only calls on the
    request path; label children are created once per label combination and cached."""

    def __init__(self, table: RoutingTable, *,
                 discovery_snapshot: Callable[[], Mapping[str, Any]] | None = None,
                 relayed: Callable[[], int] | None = None,
                 admission: Callable[[], tuple[Mapping[str, int], int]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(
            "trio_router_requests", "Proxied requests by model, engine and HTTP status "
            "(model and engine are empty when the request was rejected before routing).",
            ["model", "engine", "status"], registry=self.registry)
        self._latency = Histogram(
            "trio_router_request_duration_seconds", "Time from request received to the last "
            "response byte handed to the server, by model.", ["model"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self._ttfb = Histogram(
            "trio_router_time_to_first_byte_seconds", "Time from request received to the "
            "engine's first response body chunk forwarded, by model.", ["model"],
            buckets=TTFB_BUCKETS, registry=self.registry)
        self._unreachable = Counter(
            "trio_router_engine_unreachable", "Attempts that could not reach an engine "
            "(each one ejects the engine and triggers an immediate re-probe).", ["engine"],
            registry=self.registry)
        self._reloads = Counter(
            "trio_router_config_reloads", "SIGHUP config reloads by result.", ["result"],
            registry=self.registry)
        self._queue_wait = Histogram(
            "trio_router_queue_wait_seconds", "Time requests waited at the router for a free "
            "engine (only requests that waited), by model.", ["model"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self._rejected = Counter(
            "trio_router_rejected_requests", "Requests turned away by admission, by reason "
            "(rate_limited, tenant_concurrency, queue_full, queue_timeout) and tenant.",
            ["reason", "tenant"], registry=self.registry)
        self._children: dict[tuple[str, str, int], _Child] = {}
        self._ttfb_children: dict[str, Any] = {}
        self.registry.register(_TableCollector(table))
        if discovery_snapshot is not None:
            self.registry.register(_DiscoveryCollector(discovery_snapshot))
        if relayed is not None:
            self.registry.register(_RelayCollector(relayed))
        if admission is not None:
            self.registry.register(_AdmissionCollector(admission))

    def observe_request(self, model: str, engine: str, status: int, seconds: float) -> None:
        """Count one finished request and record its duration."""
        key = (model, engine, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _Child(
                self._requests.labels(model, engine, str(status)), self._latency.labels(model))
        child.count.inc()
        child.latency.observe(seconds)

    def observe_ttfb(self, model: str, seconds: float) -> None:
        """Record the time to the first forwarded response body chunk."""
        child = self._ttfb_children.get(model)
        if child is None:
            child = self._ttfb_children[model] = self._ttfb.labels(model)
        child.observe(seconds)

    def engine_unreachable(self, engine: str) -> None:
        self._unreachable.labels(engine).inc()

    def queue_wait(self, model: str, seconds: float) -> None:
        self._queue_wait.labels(model).observe(seconds)

    def rejected(self, reason: str, tenant: str) -> None:
        self._rejected.labels(reason, tenant).inc()

    def reload(self, result: str) -> None:
        """Count one SIGHUP reload: "ok", "unchanged" or "error"."""
        self._reloads.labels(result).inc()

    def forget_engine(self, name: str) -> None:
        """Drop the request series of an engine that left the table, so a churning cluster does
        not grow the exposition forever."""
        for key in [k for k in self._children if k[1] == name]:
            del self._children[key]
            model, engine, status = key
            self._requests.remove(model, engine, str(status))

    def render(self) -> bytes:
        """The exposition text of every metric, for GET /metrics."""
        return generate_latest(self.registry)


class _TableCollector:
    """Levels read from the routing table at scrape time: nothing to update per request."""

    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily(
            "trio_router_in_flight_requests", "Requests being served by each engine now.",
            labels=["engine"])
        states = GaugeMetricFamily(
            "trio_router_engines", "Engines in the routing table by state.", labels=["state"])
        routable = GaugeMetricFamily(
            "trio_router_routable_engines", "Engines that can receive requests now.")
        models = GaugeMetricFamily(
            "trio_router_routable_models", "Distinct models (base models and adapters) "
            "served by routable engines.")
        counts = dict.fromkeys(EngineState, 0)
        for engine in self._table:
            counts[engine.state] += 1
            in_flight.add_metric([engine.name], engine.in_flight)
        for state, count in counts.items():
            states.add_metric([state.value], count)
        routable.add_metric([], counts[EngineState.ROUTABLE])
        models.add_metric([], len(self._table.models()))
        return [in_flight, states, routable, models]


class _RelayCollector:
    """How many streamed answers went by the relay (engine chunks passed to the client as
    they came) rather than through the server's own framing."""

    def __init__(self, relayed: Callable[[], int]) -> None:
        self._relayed = relayed

    def collect(self) -> Iterable[Metric]:
        return [CounterMetricFamily(
            "trio_router_relayed_responses", "Streamed answers whose body the relay moved to "
            "an HTTP/1.1 client as the engine sent it.", value=self._relayed())]


class _AdmissionCollector:
    """Requests waiting at the router by model, and saturated engines, read at scrape time."""

    def __init__(self, state: Callable[[], tuple[Mapping[str, int], int]]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        queued, saturated = self._state()
        depth = GaugeMetricFamily("trio_router_queued_requests", "Requests waiting at the "
                                  "router for a free engine, by model.", labels=["model"])
        for model, count in queued.items():
            depth.add_metric([model], count)
        busy = GaugeMetricFamily("trio_router_saturated_engines", "Engines that take no more "
                                 "requests now (admission caps, or their own queue).")
        busy.add_metric([], saturated)
        return [depth, busy]


class _DiscoveryCollector:
    """Discovery gauges from `DiscoveryStatus.snapshot()`: every numeric or boolean value
    becomes `trio_router_discovery_<key>`."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        out: list[Metric] = []
        for key, value in sorted(self._snapshot().items()):
            if isinstance(value, bool | int | float) and value is not None:
                gauge = GaugeMetricFamily(f"trio_router_discovery_{_metric_name(key)}",
                                          f"Discovery status: {key}.")
                gauge.add_metric([], float(value))
                out.append(gauge)
        return out


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
