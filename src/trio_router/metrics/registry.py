"""`Metrics`: the router's private registry, the calls that update it, and its exposition.

Request-path updates go through cached label children (one dict lookup per request); the
families are declared in `families`, the levels read at scrape time in `levels`, and the
per-engine gauges written straight from the table in `engines`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Final

import trio
from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from .._version import __version__
from ..config import EngineSeries
from ..table import RoutingTable
from .engines import EngineGauges
from .families import (
    DetourFamilies,
    LimitStoreFamilies,
    RequestFamilies,
    RoutingFamilies,
    TokenFamilies,
    register_store_replicas,
    register_store_up,
)
from .levels import (
    AdmissionCollector,
    DiscoveryCollector,
    KvCollector,
    ModelLoadCollector,
    ModelLoadView,
    RelayCollector,
    TableCollector,
)

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST.encode("ascii")


class _Child:
    """The prometheus-client child objects one (model, engine, status) request updates."""

    __slots__ = ("count", "latency")

    def __init__(self, count: Any, latency: Any) -> None:
        self.count, self.latency = count, latency


class Metrics:
    """The router's metrics. `observe_request` and `observe_ttfb` are the only calls on the
    request path; label children are created once per label combination and cached. Each
    callable given is read at scrape time only; without it its levels are not exposed."""

    def __init__(
        self,
        table: RoutingTable,
        *,
        discovery_snapshot: Callable[[], Mapping[str, Any]] | None = None,
        relayed: Callable[[], int] | None = None,
        admission: Callable[[], tuple[Mapping[str, int], int]] | None = None,
        model_load: Callable[[], Mapping[str, ModelLoadView]] | None = None,
        kv: Callable[[], Mapping[str, tuple[Mapping[str, int], int]]] | None = None,
        engine_series: EngineSeries = "active",
    ) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self._engine_series = engine_series
        self._request = RequestFamilies.register(registry)
        self._routing = RoutingFamilies.register(registry)
        self._token = TokenFamilies.register(registry)
        self._detour = DetourFamilies.register(registry)
        self._store = LimitStoreFamilies.register(registry)
        self._store_up: Gauge | None = None  # only with a shared store
        self._store_replicas: Gauge | None = None
        self._children: dict[tuple[str, str, int], _Child] = {}
        self._ttfb_children: dict[str, Any] = {}
        self._decisions: dict[tuple[str, str, str], Any] = {}
        self._token_children: dict[str, tuple[Any, Any]] = {}
        info = Info("trio_router_build", "trio_router's version.", registry=registry)
        info.info({"version": __version__})
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        registry.register(TableCollector(table))
        self._engines = EngineGauges(table, engine_series)
        if discovery_snapshot is not None:
            registry.register(DiscoveryCollector(discovery_snapshot))
        if relayed is not None:
            registry.register(RelayCollector(relayed))
        if admission is not None:
            registry.register(AdmissionCollector(admission))
        if model_load is not None:
            registry.register(ModelLoadCollector(model_load))
        if kv is not None:
            registry.register(KvCollector(kv))

    def _engine(self, name: str) -> str:
        """The engine label for `name` (empty with `metrics.engine_series = "none"`)."""
        return "" if self._engine_series == "none" else name

    def observe_request(self, model: str, engine: str, status: int, seconds: float) -> None:
        """Count one finished request and record its duration."""
        key = (model, self._engine(engine), status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _Child(
                self._request.requests.labels(model, key[1], str(status)),
                self._request.latency.labels(model),
            )
        child.count.inc()
        child.latency.observe(seconds)

    def observe_ttfb(self, model: str, seconds: float) -> None:
        """Record the time to the first forwarded response body chunk."""
        child = self._ttfb_children.get(model)
        if child is None:
            child = self._ttfb_children[model] = self._request.ttfb.labels(model)
        child.observe(seconds)

    def routed(self, policy: str, outcome: str, engine: str) -> None:
        """Count one routing decision."""
        key = (policy, outcome, self._engine(engine))
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self._routing.routed.labels(*key)
        child.inc()

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        """Count the tokens of one answered request (its series looked up once per model)."""
        pair = self._token_children.get(model)
        if pair is None:
            pair = self._token_children[model] = (
                self._token.tokens.labels(model, "prompt"),
                self._token.tokens.labels(model, "completion"),
            )
        pair[0].inc(prompt)
        pair[1].inc(completion)

    def tokenized(self, seconds: float) -> None:
        self._token.tokenize.observe(seconds)

    def tokenize_fallback(self, reason: str) -> None:
        self._token.tokenize_fallbacks.labels(reason).inc()

    def kv_prediction(self, engine: str, cached: int, prompt: int) -> None:
        """One kv_aware decision for `engine`: the tokens it expected cached there, of the
        prompt's."""
        self._token.kv_cached.labels(self._engine(engine)).inc(cached)
        self._token.kv_prompt.labels(self._engine(engine)).inc(prompt)

    def ttft_prediction(self, engine: str, error: float) -> None:
        """A first token came `error` seconds after kv_aware predicted it at `engine`
        (negative: before)."""
        self._token.ttft_error.labels(self._engine(engine)).observe(error)

    def pd_decision(self, route: str, reason: str) -> None:
        self._detour.pd_decisions.labels(route, reason).inc()

    def pd_fallback(self, reason: str) -> None:
        self._detour.pd_fallbacks.labels(reason).inc()

    def model_fallback(self, model: str, fallback: str, reason: str) -> None:
        self._detour.model_fallbacks.labels(model, fallback, reason).inc()

    def pd_prefill(self, seconds: float) -> None:
        self._detour.pd_prefill.observe(seconds)

    def limit_store_call(self, seconds: float) -> None:
        self._store.seconds.observe(seconds)

    def limit_store_fallback(self, reason: str) -> None:
        self._store.fallbacks.labels(reason).inc()

    def limit_store_replicas(self, count: int) -> None:
        if self._store_replicas is None:
            self._store_replicas = register_store_replicas(self.registry)
        self._store_replicas.set(count)

    def limit_store_state(self, up: bool) -> None:
        if self._store_up is None:
            self._store_up = register_store_up(self.registry)
        self._store_up.set(1 if up else 0)

    def engine_unreachable(self, engine: str) -> None:
        self._request.unreachable.labels(self._engine(engine)).inc()

    def resumed(self, model: str, kind: str, reason: str, outcome: str) -> None:
        """An answer whose engine failed before its end (see `trio_router_stream_resumes`)."""
        self._request.resumes.labels(model, kind, reason, outcome).inc()

    def handed_over(self, model: str, reason: str, seconds: float) -> None:
        """A stream carried on at another engine paused `seconds` for its client (see
        `trio_router_stream_handover_seconds`)."""
        self._request.handovers.labels(model, reason).observe(seconds)

    def queue_wait(self, model: str, seconds: float) -> None:
        self._routing.queue_wait.labels(model).observe(seconds)

    def rejected(self, reason: str, tenant: str) -> None:
        self._routing.rejected.labels(reason, tenant).inc()

    def refused(self, reason: str, band: str, model: str) -> None:
        self._routing.refused.labels(reason, band, model).inc()

    def reload(self, result: str) -> None:
        """Count one SIGHUP reload: "ok", "unchanged" or "error"."""
        self._request.reloads.labels(result).inc()

    def forget_engine(self, name: str) -> None:
        """Drop the request series of an engine that left the table, so a churning cluster does
        not grow the exposition forever."""
        for key in [k for k in self._children if k[1] == name]:
            del self._children[key]
            model, engine, status = key
            self._request.requests.remove(model, engine, str(status))
        token = self._token
        for family in (
            self._request.unreachable,
            token.kv_cached,
            token.kv_prompt,
            token.ttft_error,
        ):
            with contextlib.suppress(KeyError):
                family.remove(name)
        for decision in [k for k in self._decisions if k[2] == name]:
            del self._decisions[decision]
            self._routing.routed.remove(*decision)

    def render(self) -> bytes:
        """The exposition text of every metric, for GET /metrics: the registry's, and the
        per-engine gauges written straight from the table (a sample line each, with no
        objects per sample: thousands of engines render in milliseconds)."""
        return generate_latest(self.registry) + self._engines.render(trio.current_time())
