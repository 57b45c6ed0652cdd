"""Prometheus metrics of one router process, on a private registry built by `server.run`.

Request-path updates go through cached label children (one dict lookup per request), and
everything that is a level rather than an event (in-flight per engine, routable engines,
discovery health) is read from the live objects only when `/metrics` is scraped. No Trio here,
no global registry.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Protocol

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ._version import __version__
from .config import EngineSeries
from .table import EngineState, RoutingTable

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST.encode("ascii")

# Seconds. Non-streamed completions take seconds to minutes; a router answering from its own
# state (errors, admin) takes well under a millisecond.
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    float("inf"),
)
# Signed: how far after (positive) or before its prediction a first token came.
TTFT_ERROR_BUCKETS: Final = (
    *(-b for b in (10.0, 5.0, 2.5, 1.0, 0.5, 0.25, 0.1, 0.05, 0.025)),
    0.0,
    *(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
TTFB_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    float("inf"),
)

NO_LABEL: Final = ""  # label value when a request never got as far as a model or an engine


class _Child:
    """The prometheus-client child objects one (model, engine, status) request updates."""

    __slots__ = ("count", "latency")

    def __init__(self, count: Any, latency: Any) -> None:
        self.count, self.latency = count, latency


class ModelLoadView(Protocol):
    """One model's load, as admission reports it (`serving.admission.ModelLoad`)."""

    @property
    def queued(self) -> Mapping[str, int]: ...  # requests waiting, by band label
    @property
    def in_flight(self) -> int: ...
    @property
    def engines(self) -> int: ...
    @property
    def saturated(self) -> int: ...
    @property
    def saturation(self) -> float: ...


class Metrics:
    """The router's metrics. `observe_request` and `observe_ttfb` are the only calls on the
    request path; label children are created once per label combination and cached."""

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
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine_series = engine_series
        self._add_request_metrics()
        self._add_routing_metrics()
        self._add_token_metrics()
        self._add_disaggregation_metrics()
        self._add_limit_store_metrics()
        info = Info("trio_router_build", "trio_router's version.", registry=self.registry)
        info.info({"version": __version__})
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_TableCollector(table))
        self._engines = _EngineSeries(table, engine_series)
        if discovery_snapshot is not None:
            self.registry.register(_DiscoveryCollector(discovery_snapshot))
        if relayed is not None:
            self.registry.register(_RelayCollector(relayed))
        if admission is not None:
            self.registry.register(_AdmissionCollector(admission))
        if model_load is not None:
            self.registry.register(_ModelLoadCollector(model_load))
        if kv is not None:
            self.registry.register(_KvCollector(kv))

    def _add_request_metrics(self) -> None:
        """Events counted as they happen: each proxied request (count, duration, time to first
        byte), engines that could not be reached, and config reloads."""
        self._requests = Counter(
            "trio_router_requests",
            "Proxied requests by model, engine and HTTP status "
            "(model and engine are empty when the request was rejected before routing).",
            ["model", "engine", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "trio_router_request_duration_seconds",
            "Time from request received to the last response byte handed to the server, by model.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._ttfb = Histogram(
            "trio_router_time_to_first_byte_seconds",
            "Time from request received to the "
            "engine's first response body chunk forwarded, by model.",
            ["model"],
            buckets=TTFB_BUCKETS,
            registry=self.registry,
        )
        self._unreachable = Counter(
            "trio_router_engine_unreachable",
            "Attempts that could not reach an engine "
            "(each one ejects the engine and triggers an immediate re-probe).",
            ["engine"],
            registry=self.registry,
        )
        self._resumes = Counter(
            "trio_router_stream_resumes",
            "Answers whose engine failed before their end, by model, why and what became of "
            "them (resumed, retried, failed, not_resumable).",
            ["model", "reason", "outcome"],
            registry=self.registry,
        )
        self._reloads = Counter(
            "trio_router_config_reloads",
            "SIGHUP config reloads by result.",
            ["result"],
            registry=self.registry,
        )
        self._children: dict[tuple[str, str, int], _Child] = {}
        self._ttfb_children: dict[str, Any] = {}

    def _add_routing_metrics(self) -> None:
        """Where requests went: time waited at the router, refusals by admission, and the
        engines chosen."""
        self._queue_wait = Histogram(
            "trio_router_queue_wait_seconds",
            "Time requests waited at the router for a free "
            "engine (only requests that waited), by model.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._rejected = Counter(
            "trio_router_rejected_requests",
            "Requests turned away by admission, by reason "
            "(rate_limited, tenant_concurrency, queue_full, shed, queue_timeout, "
            "deadline_exceeded) and tenant.",
            ["reason", "tenant"],
            registry=self.registry,
        )
        self._refused = Counter(
            "trio_router_refused_requests",
            "Requests the router refused, by reason (the error's code, as in "
            "x-trio-router-refusal: queue_full, shed, deadline_exceeded, queue_timeout, "
            "rate_limit_exceeded, tenant_concurrency, no_routable_engine), priority band (a "
            "configured priority; sheddable or other for bands clients chose) and model.",
            ["reason", "priority", "model"],
            registry=self.registry,
        )
        self._routed = Counter(
            "trio_router_routing_decisions",
            "Engines chosen for requests, by policy, outcome "
            "(first: the first engine tried; failover: another after an unreachable one) and "
            "engine.",
            ["policy", "outcome", "engine"],
            registry=self.registry,
        )
        self._decisions: dict[tuple[str, str, str], Any] = {}

    def _add_token_metrics(self) -> None:
        """Tokens: those the engines reported per model, and kv_aware's tokenizing and
        predictions of cached tokens."""
        self._token_children: dict[str, tuple[Any, Any]] = {}
        self._tokens = Counter(
            "trio_router_tokens",
            "Tokens of answered requests, by model and kind (prompt, "
            "completion), as the engines' `usage` reports them (streams: with "
            "stream_options.include_usage).",
            ["model", "kind"],
            registry=self.registry,
        )
        self._tokenize = Histogram(
            "trio_router_tokenize_seconds",
            "Time to get a request's token ids from an engine (kv_aware), answers only.",
            buckets=TTFB_BUCKETS,
            registry=self.registry,
        )
        self._tokenize_fallbacks = Counter(
            "trio_router_tokenize_fallbacks",
            "Requests kv_aware routed without token ids, by reason (timeout, error, "
            "untokenizable, bad_answer, status_N): routed by prefix_aware instead.",
            ["reason"],
            registry=self.registry,
        )
        self._kv_cached = Counter(
            "trio_router_kv_predicted_cached_tokens",
            "Prompt tokens kv_aware expected its chosen engine to have cached, per engine "
            "(compare with trio_router_engine_prefix_cache_hit_tokens).",
            ["engine"],
            registry=self.registry,
        )
        self._ttft_error = Histogram(
            "trio_router_kv_ttft_prediction_error_seconds",
            "kv_aware's predicted time to a first token, subtracted from the time observed "
            "(seconds; positive: slower than predicted), per engine.",
            ["engine"],
            buckets=TTFT_ERROR_BUCKETS,
            registry=self.registry,
        )
        self._kv_prompt = Counter(
            "trio_router_kv_prompt_tokens",
            "Prompt tokens of the requests kv_aware routed on their tokens, per engine "
            "(compare with trio_router_engine_prefix_cache_query_tokens).",
            ["engine"],
            registry=self.registry,
        )

    def _add_disaggregation_metrics(self) -> None:
        """Requests that took another way: prefill/decode decisions, fallbacks and prefill
        time, and fallbacks to another model."""
        self._pd_decisions = Counter(
            "trio_router_pd_decisions",
            "Requests with [disaggregation] on, by route: disaggregated (prefill then "
            "decode), or direct with the reason (short_prompt, cached_on_decode, "
            "same_engine, no_prefill_engine, no_decode_engine, not_generation).",
            ["route", "reason"],
            registry=self.registry,
        )
        self._pd_fallbacks = Counter(
            "trio_router_pd_fallbacks",
            "Disaggregated requests whose prefill step did not hand the decode engine its KV "
            "cache, by reason (prefill_timeout, prefill_status, prefill_unreachable, "
            "prefill_error, missing_params, no_prefill_engine: the decode engine prefilled "
            "itself; prefill_refused: the prefill engine's 4xx went to the client).",
            ["reason"],
            registry=self.registry,
        )
        self._model_fallbacks = Counter(
            "trio_router_model_fallbacks",
            "Requests that went to a fallback model (routing.fallbacks), by the model that "
            "could not take them, the model tried next and why (no_engine, queue_full, "
            "queue_timeout, engines_refused: every engine answered 429 or 503).",
            ["model", "fallback", "reason"],
            registry=self.registry,
        )
        self._pd_prefill = Histogram(
            "trio_router_pd_prefill_seconds",
            "Duration of the prefill step of disaggregated requests (choice to answer).",
            buckets=TTFB_BUCKETS,
            registry=self.registry,
        )

    def _add_limit_store_metrics(self) -> None:
        """The shared limit store: admission time and fallbacks to local limits (its gauges
        are made on first use, only with a shared store)."""
        self._store_seconds = Histogram(
            "trio_router_limit_store_seconds",
            "Time to admit a request at the shared limit store ([limits] store = redis), of "
            "the requests it answered.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self._store_fallbacks = Counter(
            "trio_router_limit_store_fallbacks",
            "Requests admitted by this replica's share of the limits instead of the shared "
            "store, by reason (timeout, error: the store failed this request; down: it had "
            "failed within limits.retry_s).",
            ["reason"],
            registry=self.registry,
        )
        self._store_up: Gauge | None = None  # only with a shared store
        self._store_replicas: Gauge | None = None

    def _engine(self, name: str) -> str:
        """The engine label for `name` (empty with `metrics.engine_series = "none"`)."""
        return "" if self._engine_series == "none" else name

    def observe_request(self, model: str, engine: str, status: int, seconds: float) -> None:
        """Count one finished request and record its duration."""
        key = (model, self._engine(engine), status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _Child(
                self._requests.labels(model, key[1], str(status)), self._latency.labels(model)
            )
        child.count.inc()
        child.latency.observe(seconds)

    def observe_ttfb(self, model: str, seconds: float) -> None:
        """Record the time to the first forwarded response body chunk."""
        child = self._ttfb_children.get(model)
        if child is None:
            child = self._ttfb_children[model] = self._ttfb.labels(model)
        child.observe(seconds)

    def routed(self, policy: str, outcome: str, engine: str) -> None:
        """Count one routing decision."""
        key = (policy, outcome, self._engine(engine))
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self._routed.labels(*key)
        child.inc()

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        """Count the tokens of one answered request (its series looked up once per model)."""
        pair = self._token_children.get(model)
        if pair is None:
            pair = self._token_children[model] = (
                self._tokens.labels(model, "prompt"),
                self._tokens.labels(model, "completion"),
            )
        pair[0].inc(prompt)
        pair[1].inc(completion)

    def tokenized(self, seconds: float) -> None:
        self._tokenize.observe(seconds)

    def tokenize_fallback(self, reason: str) -> None:
        self._tokenize_fallbacks.labels(reason).inc()

    def kv_prediction(self, engine: str, cached: int, prompt: int) -> None:
        """One kv_aware decision for `engine`: the tokens it expected cached there, of the
        prompt's."""
        self._kv_cached.labels(self._engine(engine)).inc(cached)
        self._kv_prompt.labels(self._engine(engine)).inc(prompt)

    def ttft_prediction(self, engine: str, error: float) -> None:
        """A first token came `error` seconds after kv_aware predicted it at `engine`
        (negative: before)."""
        self._ttft_error.labels(self._engine(engine)).observe(error)

    def pd_decision(self, route: str, reason: str) -> None:
        self._pd_decisions.labels(route, reason).inc()

    def pd_fallback(self, reason: str) -> None:
        self._pd_fallbacks.labels(reason).inc()

    def limit_store_call(self, seconds: float) -> None:
        self._store_seconds.observe(seconds)

    def limit_store_fallback(self, reason: str) -> None:
        self._store_fallbacks.labels(reason).inc()

    def limit_store_replicas(self, count: int) -> None:
        if self._store_replicas is None:
            self._store_replicas = Gauge(
                "trio_router_limit_store_replicas",
                "Router replicas the shared limit store last counted (local limits divide by "
                "it while the store is away).",
                registry=self.registry,
            )
        self._store_replicas.set(count)

    def limit_store_state(self, up: bool) -> None:
        if self._store_up is None:
            self._store_up = Gauge(
                "trio_router_limit_store_up",
                "1 while the shared limit store answers, 0 while local limits apply.",
                registry=self.registry,
            )
        self._store_up.set(1 if up else 0)

    def model_fallback(self, model: str, fallback: str, reason: str) -> None:
        self._model_fallbacks.labels(model, fallback, reason).inc()

    def pd_prefill(self, seconds: float) -> None:
        self._pd_prefill.observe(seconds)

    def engine_unreachable(self, engine: str) -> None:
        self._unreachable.labels(self._engine(engine)).inc()

    def resumed(self, model: str, reason: str, outcome: str) -> None:
        """An answer whose engine failed before its end (see `trio_router_stream_resumes`)."""
        self._resumes.labels(model, reason, outcome).inc()

    def queue_wait(self, model: str, seconds: float) -> None:
        self._queue_wait.labels(model).observe(seconds)

    def rejected(self, reason: str, tenant: str) -> None:
        self._rejected.labels(reason, tenant).inc()

    def refused(self, reason: str, band: str, model: str) -> None:
        self._refused.labels(reason, band, model).inc()

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
        for counter in (self._unreachable, self._kv_cached, self._kv_prompt, self._ttft_error):
            with contextlib.suppress(KeyError):
                counter.remove(name)
        for decision in [k for k in self._decisions if k[2] == name]:
            del self._decisions[decision]
            self._routed.remove(*decision)

    def render(self) -> bytes:
        """The exposition text of every metric, for GET /metrics: the registry's, and the
        per-engine gauges written straight from the table (a sample line each, with no
        objects per sample: thousands of engines render in milliseconds)."""
        return generate_latest(self.registry) + self._engines.render(trio.current_time())


class _TableCollector:
    """Levels read from the routing table at scrape time: nothing to update per request."""

    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def collect(self) -> Iterable[Metric]:
        states = GaugeMetricFamily(
            "trio_router_engines", "Engines in the routing table by state.", labels=["state"]
        )
        routable = GaugeMetricFamily(
            "trio_router_routable_engines", "Engines that can receive requests now."
        )
        models = GaugeMetricFamily(
            "trio_router_routable_models",
            "Distinct models (base models and adapters) served by routable engines.",
        )
        counts = dict.fromkeys(EngineState, 0)
        for engine in self._table:
            counts[engine.state] += 1
        for state, count in counts.items():
            states.add_metric([state.value], count)
        routable.add_metric([], counts[EngineState.ROUTABLE])
        models.add_metric([], len(self._table.models()))
        return [states, routable, models]


ACTIVE_S: Final = 300.0  # engine_series "active": engines routed to within this many seconds
# The per-engine gauges: (name, help, what of an engine), in exposition order.
_ENGINE_GAUGES: Final = (
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
        "The engine's own running requests (scraped from its /metrics; absent when stale).",
        "running",
    ),
    (
        "trio_router_engine_waiting_requests",
        "The engine's own waiting requests (scraped from its /metrics; absent when stale).",
        "waiting",
    ),
    (
        "trio_router_engine_kv_cache_usage_ratio",
        "The engine's own KV-cache usage (0..1) (scraped from its /metrics; absent when stale).",
        "kv_cache_usage",
    ),
    (
        "trio_router_engine_prefix_cache_hit_tokens",
        "The engine's own prompt tokens served from its prefix cache since it started "
        "(vllm:prefix_cache_hits_total) (scraped from its /metrics; absent when stale).",
        "prefix_cache_hits",
    ),
    (
        "trio_router_engine_prefix_cache_query_tokens",
        "The engine's own prompt tokens looked up in its prefix cache since it started "
        "(vllm:prefix_cache_queries_total) (scraped from its /metrics; absent when stale).",
        "prefix_cache_queries",
    ),
)


class _EngineSeries:
    """The per-engine gauges, written as exposition text straight from the table: for every
    engine (`all`), the engines in use (`active`: requests in flight there, or routed there
    within `ACTIVE_S`), or none. prometheus_client would build an object per sample and
    format each through generic code, which at thousands of engines holds the serving
    thread for hundreds of milliseconds per scrape."""

    def __init__(self, table: RoutingTable, which: EngineSeries) -> None:
        self._table, self._which = table, which
        self._labels: dict[str, bytes] = {}  # engine name -> '{engine="..."} ', escaped once

    def render(self, now: float) -> bytes:
        if self._which == "none":
            return b""
        engines = [
            e
            for e in self._table
            if self._which == "all" or e.in_flight or now - e.routed_at < ACTIVE_S
        ]
        lines: dict[str, list[bytes]] = {what: [] for _, _, what in _ENGINE_GAUGES}
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
        out: list[bytes] = []
        for name, help_text, what in _ENGINE_GAUGES:
            if what != "in_flight" and not lines[what]:
                continue
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n".encode())
            prefix = name.encode()
            out.extend(prefix + line for line in lines[what])
        return b"".join(out)


_SCRAPED: Final = (
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_cache_hits",
    "prefix_cache_queries",
)


def _engine_label(name: str) -> bytes:
    escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return b'{engine="' + escaped.encode() + b'"} '


def _float(value: float) -> bytes:
    """`value` as the exposition format writes it."""
    if math.isfinite(value):
        return repr(float(value)).encode()
    return b"NaN" if math.isnan(value) else b"+Inf" if value > 0 else b"-Inf"


class _RelayCollector:
    """How many streamed answers went by the relay (engine chunks passed to the client as
    they came) rather than through the server's own framing."""

    def __init__(self, relayed: Callable[[], int]) -> None:
        self._relayed = relayed

    def collect(self) -> Iterable[Metric]:
        return [
            CounterMetricFamily(
                "trio_router_relayed_responses",
                "Streamed answers whose body the relay moved to "
                "an HTTP/1.1 client as the engine sent it.",
                value=self._relayed(),
            )
        ]


class _AdmissionCollector:
    """Requests waiting at the router by model, and saturated engines, read at scrape time."""

    def __init__(self, state: Callable[[], tuple[Mapping[str, int], int]]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        queued, saturated = self._state()
        depth = GaugeMetricFamily(
            "trio_router_queued_requests",
            "Requests waiting at the router for a free engine, by model.",
            labels=["model"],
        )
        for model, count in queued.items():
            depth.add_metric([model], count)
        busy = GaugeMetricFamily(
            "trio_router_saturated_engines",
            "Engines that take no more requests now (admission caps, or their own queue).",
        )
        busy.add_metric([], saturated)
        return [depth, busy]


class _ModelLoadCollector:
    """The saturation signal per model, read at scrape time (`Admission.load`)."""

    def __init__(self, load: Callable[[], Mapping[str, ModelLoadView]]) -> None:
        self._load = load

    def collect(self) -> Iterable[Metric]:
        saturation = GaugeMetricFamily(
            "trio_router_model_saturation",
            "How full the model's engines are, as this router sees them: 0 idle, 1 every "
            "engine at its limit, above 1 while requests wait at the router (the engines' mean "
            "load, plus the waiting requests over what the engines hold at once). The metric "
            "to scale engines on: max across router replicas.",
            labels=["model"],
        )
        queued = GaugeMetricFamily(
            "trio_router_model_queued_requests",
            "Requests waiting at this router for a free engine, by model and priority band "
            "(a configured priority; sheddable or other for bands clients chose).",
            labels=["model", "priority"],
        )
        in_flight = GaugeMetricFamily(
            "trio_router_model_in_flight_requests",
            "This router's requests in flight to the model's engines.",
            labels=["model"],
        )
        share = GaugeMetricFamily(
            "trio_router_model_saturated_engines_ratio",
            "The share of the model's routable engines that take no more requests now "
            "(admission caps, or their own queue).",
            labels=["model"],
        )
        for model, load in sorted(self._load().items()):
            saturation.add_metric([model], load.saturation)
            for band, count in sorted(load.queued.items()):
                queued.add_metric([model, band], count)
            in_flight.add_metric([model], load.in_flight)
            share.add_metric([model], load.saturated / load.engines if load.engines else 0.0)
        return [saturation, queued, in_flight, share]


class _KvCollector:
    """KV-cache events per engine, read at scrape time: {engine: ({counter: value}, blocks
    held in the index)}."""

    _COUNTERS: Final = {
        "batches": "KV-event batches applied",
        "events": "KV events applied",
        "skipped": "KV events or messages that could not be read or applied",
        "gaps": "gaps in an engine's KV-event sequence",
        "replays": "gaps (or late starts) filled by a replay",
        "replay_failures": "replays that failed or could not fill the gap",
        "resets": "times an engine's index entries were dropped (restart, lost events, "
        "AllBlocksCleared)",
    }

    def __init__(self, state: Callable[[], Mapping[str, tuple[Mapping[str, int], int]]]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        families = {
            key: CounterMetricFamily(
                f"trio_router_kv_{key}", f"Per engine: {what}.", labels=["engine"]
            )
            for key, what in self._COUNTERS.items()
        }
        blocks = GaugeMetricFamily(
            "trio_router_kv_index_blocks",
            "Prefix blocks each engine holds, as the router's block index knows them.",
            labels=["engine"],
        )
        for engine, (counters, held) in self._state().items():
            for key, family in families.items():
                family.add_metric([engine], float(counters.get(key, 0)))
            blocks.add_metric([engine], float(held))
        return [*families.values(), blocks]


class _DiscoveryCollector:
    """Discovery gauges from `DiscoveryStatus.snapshot()`: every numeric or boolean value
    becomes `trio_router_discovery_<key>`."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        out: list[Metric] = []
        for key, value in sorted(self._snapshot().items()):
            if isinstance(value, bool | int | float) and value is not None:
                name = f"trio_router_discovery_{_metric_name(key)}"
                if name.endswith("_total"):  # a count since start: a counter
                    out.append(
                        CounterMetricFamily(
                            name.removesuffix("_total"), f"Discovery: {key}.", value=float(value)
                        )
                    )
                else:
                    gauge = GaugeMetricFamily(name, f"Discovery status: {key}.")
                    gauge.add_metric([], float(value))
                    out.append(gauge)
        return out


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
