"""The routing table: every known engine keyed by pod UID, with its state and models.

Mutated only by synchronous methods on the Trio thread (no locks: there is no `await` inside a
mutation), read by the request path, and watched through `wait_changed()`.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import trio

NOT_ROUTABLE_PHASES: Final = frozenset({"Failed", "Succeeded", "Unknown"})
ENDED_PHASES: Final = frozenset({"Failed", "Succeeded"})  # every container has stopped


@dataclass(frozen=True, slots=True)
class Pod:
    """What discovery knows of one pod: the fields the readiness rules read."""

    uid: str
    name: str
    ip: str = ""
    phase: str = "Running"
    ready: bool = False
    terminating: bool = False  # metadata.deletionTimestamp is set
    restart_count: int = 0  # sum over containers; a rise means "probe again"
    labels: tuple[tuple[str, str], ...] = ()  # metadata.labels, sorted by key

    def label(self, key: str) -> str | None:
        """The value of label `key`, or None."""
        for name, value in self.labels:
            if name == key:
                return value
        return None

    def unroutable_reason(self) -> str | None:
        """Why Kubernetes says this pod must not get traffic, or None when it may."""
        if self.terminating:
            return "terminating"
        if self.phase in NOT_ROUTABLE_PHASES:
            return f"phase {self.phase}"
        if not self.ip:
            return "no pod IP"
        if not self.ready:
            return "not Ready"
        return None

    @property
    def going_away(self) -> bool:
        """Its engine is stopping for good: the pod is terminating (deleted, evicted, scaled
        down, rolled out), or all its containers have ended. Not Ready, or phase Unknown (a
        node out of touch), is not: a busy engine can fail a probe and recover."""
        return self.terminating or self.phase in ENDED_PHASES


class EventType(enum.StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True, slots=True)
class PodEvent:
    type: EventType
    pod: Pod


@dataclass(frozen=True, slots=True)
class Model:
    """One entry of an engine's /v1/models: a base model or a LoRA adapter (with `parent`).
    `card` is the entry as the engine listed it, every field kept (vLLM's `permission`,
    fields of later releases): GET /v1/models answers with it. Neither it nor `created`
    (vLLM stamps each listing with the time of the request) tells two entries apart, so a
    re-probe that finds the same models changes nothing."""

    id: str
    parent: str | None = None
    root: str | None = None
    owned_by: str = "vllm"
    max_model_len: int | None = None
    created: int = field(default=0, compare=False)
    card: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def as_openai(self) -> dict[str, Any]:
        if self.card:
            return self.card
        out: dict[str, Any] = {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": self.owned_by,
            "root": self.root or self.id,
            "parent": self.parent,
        }
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        return out


@dataclass(slots=True)
class RequestStats:
    """The router's own figures for one engine: completed requests, errors, exponentially
    weighted moving averages (weight `alpha` for each new request) of time to first byte and
    of latency, in seconds, and a request rate decaying with time constant `rate_window`
    seconds. In-flight stays on `Engine.in_flight`. Plain sync updates on the Trio thread,
    no lock; `now` defaults to `trio.current_time()`."""

    alpha: float = 0.2
    rate_window: float = 30.0
    count: int = 0
    errors: int = 0
    ttfb: float | None = None  # EWMA, seconds; None until a request got a first byte
    latency: float | None = None  # EWMA, seconds; None until a request completed
    _rate: float = 0.0  # requests/s as of `_rate_at`
    _rate_at: float = 0.0

    def record(
        self, ttfb: float | None, latency: float, *, ok: bool = True, now: float | None = None
    ) -> None:
        """Count one finished request: `ttfb` None if no byte came back; `ok` False for an
        error answer or a failure."""
        now = trio.current_time() if now is None else now
        self.count += 1
        if not ok:
            self.errors += 1
        if ttfb is not None:
            self.ttfb = ttfb if self.ttfb is None else self.ttfb + self.alpha * (ttfb - self.ttfb)
        self.latency = (
            latency
            if self.latency is None
            else self.latency + self.alpha * (latency - self.latency)
        )
        self._rate = self.requests_per_s(now) + 1.0 / self.rate_window
        self._rate_at = now

    def requests_per_s(self, now: float | None = None) -> float:
        """Completed requests per second, exponentially decayed (a steady rate reads as
        itself after a few `rate_window`s)."""
        now = trio.current_time() if now is None else now
        return self._rate * math.exp(-max(0.0, now - self._rate_at) / self.rate_window)

    def snapshot(self, now: float | None = None) -> dict[str, float | int | None]:
        """The figures as shown in /engines."""
        return {
            "requests": self.count,
            "errors": self.errors,
            "requests_per_s": self.requests_per_s(now),
            "ttfb_s": self.ttfb,
            "latency_s": self.latency,
        }


class EngineState(enum.StrEnum):
    PENDING = "pending"  # Kubernetes says no traffic (not Ready, no IP, terminating, failed)
    PROBING = "probing"  # eligible; waiting for its first successful probe
    ROUTABLE = "routable"  # eligible and the last probe(s) succeeded
    UNHEALTHY = "unhealthy"  # eligible but probes fail; re-probed with backoff


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An engine's own load, as last scraped from its /metrics (`discovery.stats`): requests
    running and waiting, KV-cache usage (0..1) and its prefix-cache counters (tokens hit and
    looked up since it started), each None when the engine does not export
    it. The figures hold until `expires` (Trio time); `fresh(now)` is the one rule by which
    admission, the policies and the metrics decide whether to believe them. Replaced whole
    by each scrape (no await between the check and the write)."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_cache_hits: float | None = None  # tokens, since the engine started
    prefix_cache_queries: float | None = None
    # Counters `kv_aware` learns its rates from (`routing.ttft`), since the engine started:
    # prompt tokens, the sums and counts of its time-to-first-token and queue histograms,
    # and the count of its end-to-end latency histogram (the requests that finished).
    prompt_tokens: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    queue_sum: float | None = None
    queue_count: float | None = None
    e2e_count: float | None = None
    scraped_at: float = -math.inf
    expires: float = -math.inf

    @classmethod
    def scraped(cls, gauges: dict[str, float], *, now: float, stale_after: float) -> EngineStats:
        """The figures of one scrape (`discovery.stats.parse_vllm_metrics`), believed for
        `stale_after` seconds."""
        return cls(
            running=gauges.get("running"),
            waiting=gauges.get("waiting"),
            kv_cache_usage=gauges.get("kv_cache_usage"),
            prefix_cache_hits=gauges.get("prefix_cache_hits"),
            prefix_cache_queries=gauges.get("prefix_cache_queries"),
            prompt_tokens=gauges.get("prompt_tokens"),
            ttft_sum=gauges.get("ttft_sum"),
            ttft_count=gauges.get("ttft_count"),
            queue_sum=gauges.get("queue_sum"),
            queue_count=gauges.get("queue_count"),
            e2e_count=gauges.get("e2e_count"),
            scraped_at=now,
            expires=now + stale_after,
        )

    def fresh(self, now: float) -> bool:
        return now <= self.expires

    def describe(self) -> dict[str, float]:
        """As GET /engines shows it: the gauges the engine exports, when they were scraped
        and for how long they hold; {} when there are none."""
        if self.scraped_at == -math.inf:
            return {}
        out = {
            key: value
            for key, value in (
                ("running", self.running),
                ("waiting", self.waiting),
                ("kv_cache_usage", self.kv_cache_usage),
                ("prefix_cache_hits", self.prefix_cache_hits),
                ("prefix_cache_queries", self.prefix_cache_queries),
            )
            if value is not None
        }
        out["scraped_at"], out["stale_after"] = self.scraped_at, self.expires - self.scraped_at
        return out


NO_STATS: Final = EngineStats()  # an engine whose load is not known (not scraped, or stale)


class Leaving(Protocol):
    """A stream in flight at an engine, registered in `Engine.streams` to hear at once that
    the engine is going away (and hand itself over to another engine, when it can)."""

    def engine_leaving(self, engine: Engine, why: str) -> None: ...


@dataclass(slots=True, eq=False)
class Engine:
    """One engine (a pod, or a static URL). Identity is `uid`; `generation` changes whenever
    the engine must be probed afresh (new IP, restart, back to Ready), so a probe that started
    under an older generation never writes its result."""

    uid: str
    name: str
    url: str
    generation: int = 0
    role: str = ""  # prefill/decode disaggregation: "prefill", "decode", "prefill-decode", ""
    state: EngineState = EngineState.PROBING
    reason: str = ""  # why the engine is not routable, for /engines and logs
    models: tuple[Model, ...] = ()
    model_ids: frozenset[str] = frozenset()
    pod: Pod | None = None
    consecutive_failures: int = 0
    in_flight: int = 0  # requests from this router being served right now
    request_failures: int = 0  # requests in a row that failed after reaching the engine
    stats: EngineStats = NO_STATS  # the engine's own load, as scraped
    requests: RequestStats = field(default_factory=RequestStats)  # this router's figures
    routed_at: float = -math.inf  # Trio time a request last took a slot on it
    routed_before: float = -math.inf  # ... and the time the request before that did
    answered_at: float = -math.inf  # Trio time a request to it last succeeded (it is alive)
    route_waiter: trio.Event | None = None  # set by the next request routed to it...
    route_wanted: Callable[[Engine, float], bool] | None = None  # ...that this wants (or any)
    # Streams in flight here that another engine could carry on, told when it goes away.
    streams: set[Leaving] = field(default_factory=set)

    @property
    def routable(self) -> bool:
        return self.state is EngineState.ROUTABLE

    def routed(self, now: float) -> None:
        """A request takes a slot on this engine (its in-flight count already counts it):
        the second within a few scrape intervals has its load scraped again."""
        self.routed_before, self.routed_at = self.routed_at, now
        if (waiter := self.route_waiter) is not None and (
            (wanted := self.route_wanted) is None or wanted(self, now)
        ):
            self.route_waiter = self.route_wanted = None
            waiter.set()

    async def wait_routed(self, wanted: Callable[[Engine, float], bool] | None = None) -> None:
        """Until the next request is routed to this engine; with `wanted`, the next for which
        `wanted(engine, now)` is true, asked synchronously as it is routed (so a request the
        waiter would only look at and let pass costs it no wake-up). One waiter at a time."""
        if self.route_waiter is None:
            self.route_waiter = trio.Event()
        self.route_wanted = wanted
        await self.route_waiter.wait()

    def leaving(self, why: str) -> int:
        """The engine is going away (`why`: its pod terminating or deleted): every stream in
        `streams` is told now, synchronously, and may hand itself over to another engine
        (those that cannot are left to finish here). Returns how many were told."""
        streams = tuple(self.streams)  # a stream may leave the set as it is told
        for stream in streams:
            stream.engine_leaving(self, why)
        return len(streams)

    def describe(self) -> dict[str, Any]:
        """The engine as shown by GET /engines."""
        return {
            "name": self.name,
            "uid": self.uid,
            "url": self.url,
            "models": [m.id for m in self.models],
            "role": self.role,
            "healthy": self.routable,
            "state": self.state.value,
            "reason": self.reason,
            "generation": self.generation,
            "consecutive_failures": self.consecutive_failures,
            "in_flight": self.in_flight,
            "requests": self.requests.snapshot(),
            "stats": self.stats.describe(),
        }


class RoutingTable:
    """Engines by UID. Every mutator is synchronous and ends by waking `wait_changed()`."""

    def __init__(self) -> None:
        self._engines: dict[str, Engine] = {}
        self._index: dict[str, tuple[Engine, ...]] | None = None
        self._known_models: set[str] = set()
        self._served: frozenset[str] = frozenset()  # the models of the last index
        self._unserved_since: dict[str, float] = {}  # a model no routable engine serves: since
        self._changed_at = 0.0  # the first change since the index was last built
        self._changed = trio.Event()
        self._remove_listeners: list[Callable[[Engine], None]] = []
        self.version = 0  # bumped by every mutation; cheap change detection for caches

    # -- reads ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[Engine]:
        return iter(list(self._engines.values()))

    def __contains__(self, uid: object) -> bool:
        return uid in self._engines

    def get(self, uid: str) -> Engine | None:
        return self._engines.get(uid)

    def current(self, uid: str, generation: int) -> Engine | None:
        """The entry for `uid` if it still has `generation`: what a probe checks after an await."""
        engine = self._engines.get(uid)
        return engine if engine is not None and engine.generation == generation else None

    def routable(self, model: str) -> Sequence[Engine]:
        """Routable engines serving `model` (base model or adapter). Hot path: O(1) after the
        first call following a change."""
        if self._index is None:
            self._index = self._build_index()
        return self._index.get(model, ())

    def routable_engines(self) -> list[Engine]:
        return [e for e in self._engines.values() if e.routable]

    def is_known_model(self, model: str) -> bool:
        """True if any engine has ever reported `model` (then "no engine" is a 503, not a 404)."""
        return model in self._known_models

    def served_within(self, model: str, seconds: float) -> bool:
        """True if a routable engine serves `model` now, or did `seconds` ago or later (the
        waiting room's "known model": one whose engines are being replaced)."""
        if self._index is None:
            self._index = self._build_index()
        if model in self._index:
            return True
        since = self._unserved_since.get(model)
        return since is not None and _now() - since <= seconds

    def may_come_back(self, model: str, tried: Collection[str]) -> bool:
        """An engine out of routing now, not among `tried` nor going away (its pod
        terminating), that served `model` when last probed or has not been probed yet: one
        that may soon take a request for it."""
        return any(
            not e.routable
            and e.uid not in tried
            and (e.pod is None or not e.pod.going_away)
            and (not e.model_ids or model in e.model_ids)
            for e in self._engines.values()
        )

    def engines_with_unknown_models(self) -> int:
        """Engines Kubernetes lets through whose models are not known: no probe has ever
        answered (not probed yet, or unreachable since they started)."""
        return sum(
            1
            for e in self._engines.values()
            if not e.models and e.state in (EngineState.PROBING, EngineState.UNHEALTHY)
        )

    def models(self) -> list[Model]:
        """The union of the models of routable engines, first reporter wins, sorted by id."""
        seen: dict[str, Model] = {}
        for engine in self._engines.values():
            if engine.routable:
                for m in engine.models:
                    seen.setdefault(m.id, m)
        return [seen[k] for k in sorted(seen)]

    async def wait_changed(self) -> None:
        """Block until the next mutation. Check your condition first, then call this with no
        checkpoint in between, and nothing is missed."""
        await self._changed.wait()

    # -- mutations (sync, Trio thread only) -----------------------------------------------
    def put(self, engine: Engine) -> None:
        """Insert `engine`, replacing any entry with the same UID."""
        self._engines[engine.uid] = engine
        self._touch()

    def remove(self, uid: str) -> Engine | None:
        """Forget `uid`; remove listeners run synchronously (e.g. a policy drops its state)."""
        engine = self._engines.pop(uid, None)
        if engine is not None:
            engine.state = EngineState.PENDING
            engine.reason = "removed"
            self._touch()
            for listener in self._remove_listeners:
                listener(engine)
        return engine

    def add_remove_listener(self, listener: Callable[[Engine], None]) -> Callable[[], None]:
        """Call `listener(engine)` synchronously whenever an engine leaves the table, until the
        returned function is called."""
        self._remove_listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._remove_listeners.remove(listener)

        return unsubscribe

    def set_role(self, uid: str, role: str) -> None:
        """Engine `uid` takes another prefill/decode role (its pod was relabelled)."""
        engine = self._engines.get(uid)
        if engine is not None and engine.role != role:
            engine.role = role
            self._touch()

    def set_pending(self, uid: str, reason: str) -> None:
        """Take `uid` out of routing because Kubernetes says so (no probing needed)."""
        engine = self._engines.get(uid)
        if engine is not None:
            engine.state, engine.reason = EngineState.PENDING, reason
            self._touch()

    def mark_routable(self, uid: str, generation: int, models: Sequence[Model]) -> bool:
        """Record a successful probe; False (and no change) if the entry is gone or newer."""
        engine = self.current(uid, generation)
        if engine is None or engine.state is EngineState.PENDING:
            return False
        models = tuple(models)
        changed = engine.state is not EngineState.ROUTABLE or engine.models != models
        engine.state, engine.reason = EngineState.ROUTABLE, ""
        engine.consecutive_failures = 0
        if changed:
            engine.models = models
            engine.model_ids = frozenset(m.id for m in models)
            self._known_models.update(engine.model_ids)
            self._touch()
        return True

    def mark_failed(self, uid: str, generation: int, reason: str, *, eject: bool) -> bool:
        """Record a failed probe (or a failed connect from the proxy). With `eject`, the engine
        leaves routing now; otherwise only its failure count grows. False if the entry is gone
        or newer."""
        engine = self.current(uid, generation)
        if engine is None or engine.state is EngineState.PENDING:
            return False
        engine.consecutive_failures += 1
        engine.reason = reason
        if eject:
            engine.state = EngineState.UNHEALTHY
        self._touch()
        return True

    def _touch(self) -> None:
        if self._index is not None:  # a model the next index lacks was lost from now on
            self._changed_at = _now()
        self.version += 1
        self._index = None
        self._changed.set()
        self._changed = trio.Event()

    def _build_index(self) -> dict[str, tuple[Engine, ...]]:
        by_url: dict[str, Engine] = {}
        for engine in self._engines.values():  # insertion order: later entries are newer
            if engine.routable:
                by_url[engine.url] = engine  # one routable entry per address
        index: dict[str, list[Engine]] = {}
        for engine in by_url.values():
            for model_id in engine.model_ids:
                index.setdefault(model_id, []).append(engine)
        served = frozenset(index)
        for model in self._served - served:
            self._unserved_since[model] = self._changed_at
        for model in served - self._served:
            self._unserved_since.pop(model, None)
        self._served = served
        return {k: tuple(v) for k, v in index.items()}


def _now() -> float:
    """Trio's clock; outside a Trio run (a table used from synchronous code), no time has
    passed since anything."""
    try:
        return trio.current_time()
    except RuntimeError:
        return 0.0
