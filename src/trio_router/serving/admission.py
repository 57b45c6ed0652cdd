"""Admission: which request goes to an engine now and which waits at the router for one:
saturated engines, the router's queue, its priority bands, deadlines and fairness across
tenants. Whether a tenant may send a request at all (its rate, its concurrency) is for
`limits` to say, before this.

- **Saturation.** An engine is saturated when this router's requests in flight to it reach
  the per-engine cap (`admission.max_in_flight_per_engine`, and never more than
  `proxy.max_connections_per_engine`: one bound, one mechanism), or, while its scraped vLLM
  figures are fresh, when its own queue (`vllm:num_requests_waiting`) reaches
  `admission.max_waiting_per_engine`. Routing policies choose among unsaturated engines only.
- **Queue.** When every engine for the model is saturated, the request waits here, not at an
  engine: at most `admission.queue_size` requests in all, each at most
  `admission.queue_timeout_s` (then 503 `queue_timeout`). A slot that frees up (a request
  done, an engine routable again, its figures lower) dispatches the next waiting request in
  the same step: no polling. A request whose client leaves while it waits leaves the queue.
- **Priority bands.** Each request has a priority (its tenant's `priority`, or
  `admission.priority` for anonymous traffic; `x-trio-router-priority` may lower it, never
  raise it). Bands are served strictly by priority, the highest first. A band below
  `admission.sheddable_below` is sheddable: its request is refused at once (429 `shed`)
  whenever it would have to wait, never queued.
- **Reserved slots.** With a cap, `admission.reserve_per_engine` of each engine's slots are
  kept for the top band (the highest configured priority): a request of a lower band goes
  only to an engine with more free slots than that, so engines that cannot preempt (or
  schedule by priority) still have room for the top band's next request the moment it
  comes. An arriving request of a higher band than any waiting takes a free slot at once.
  With `priority_to_engines` too, the engines are taken to run cap - reserve requests at once
  and to preempt a lower band for the top one: the top band's requests then go past the
  lower bands' limit, but never more of them to one engine than it runs at once (more would
  wait there behind their own band).
- **A full queue.** A request of a band higher than the lowest band waiting takes the place
  of the newest waiting request of that lowest band (429 `shed` for it); in the lowest band
  itself, with fairness, it takes the place of the newest request of the tenant with the
  most waiting in that band when that tenant has more than one more than its own; otherwise
  it is refused (429 `queue_full`).
- **Deadlines.** A request may have a first-token deadline (`x-trio-router-deadline-ms`, or
  its tenant's `ttft_deadline_ms`, `admission.ttft_deadline_ms` for anonymous traffic). One
  whose deadline passes while it waits is answered at once (504 `deadline_exceeded`) and no
  engine sees it; so is one that arrives behind more waiting requests than the model's
  recent dispatch rate (`_cannot_start_in_time`) can serve before its deadline. Its deadline
  counts the engines' own time to a first token (`first_token_floor`): a request with less
  time left than that is not sent.
- **Fairness within a band.** With `admission.fairness = "tenant"`, dispatches go round robin
  across the tenants with waiting requests in the band, weighted by their `weight` (stride
  scheduling); each tenant's own requests go earliest deadline first (those without one
  after, in arrival order): a tenant's backlog delays another tenant's next request by about
  one dispatch at most, and no tenant's deadlines can overtake another's turn. `"none"`: one
  line per band, earliest deadline first, then arrival order.

Everything here is synchronous bookkeeping on the Trio thread but the wait in `acquire` and
the `run` task that dispatches when the routing table changes.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Final, NamedTuple
from weakref import WeakKeyDictionary

import trio

from ..config import Config
from ..errors import (
    DeadlineError,
    NoEngineError,
    QueueTimeoutError,
    RateLimitedError,
    RequestError,
)
from ..limits.tenants import Tenant
from ..table import Engine, RoutingTable

__all__ = ["Admission", "ModelLoad", "Urgency"]

# Picks an engine for a request among the routable ones whose uid is not excluded; raises
# NoEngineError when none is left.
Pick = Callable[[Collection[str]], Engine]

# Each tenant's position in one band of the fair queue (stride scheduling): grows by 1/weight
# per dispatch in that band, one for all models' queues; kept as long as the tenant (a reload
# keeps the tenants that remain), dropped with it.
Passes = WeakKeyDictionary[Tenant, float]

RATE_WINDOW: Final = 32  # recent dispatches a model's dispatch rate is measured over
RATE_MIN_SAMPLES: Final = 8  # fewer: no prediction, no request refused on one
RATE_HORIZON_S: Final = 60.0  # older dispatches say nothing of the rate now
FIRST_TOKEN_WINDOW: Final = 32  # recent answers whose time to a first byte is remembered
FIRST_TOKEN_MIN: Final = 4  # fewer: no floor (0)


class Urgency(NamedTuple):
    """How a request ranks in the queue: its band (higher first) and its first-token
    deadline (Trio time; inf: none)."""

    priority: int = 0
    deadline: float = math.inf


ANYTIME: Final = Urgency()  # band 0, no deadline


def _queue_full(size: int) -> RateLimitedError:
    return RateLimitedError(
        f"the router's queue is full ({size} requests wait for a free engine)",
        code="queue_full",
        headers=((b"retry-after", b"1"),),
    )


def _shed(priority: int, why: str) -> RateLimitedError:
    return RateLimitedError(
        f"shed: {why} (priority {priority})", code="shed", headers=((b"retry-after", b"1"),)
    )


class _Waiter:
    __slots__ = (
        "engine",
        "event",
        "evicted",
        "key",
        "late_at",
        "model",
        "order",
        "pick",
        "priority",
        "queued_at",
        "tenant",
        "tried",
        "urgency",
    )

    def __init__(
        self,
        tenant: Tenant,
        model: str,
        pick: Pick,
        tried: Collection[str],
        urgency: Urgency,
        now: float,
        seq: int,
    ) -> None:
        self.tenant, self.model, self.pick, self.tried = tenant, model, pick, tried
        self.urgency, self.priority = urgency, urgency.priority
        self.order = (urgency.deadline, seq)  # its place in its line: deadline, then arrival
        self.queued_at = now
        self.event = trio.Event()
        self.engine: Engine | None = None  # set when dispatched: a slot is held for it
        self.key = tenant  # its line in its band: its tenant, or one line for all (FIFO)
        self.evicted: RequestError | None = None  # out of the queue undispatched: why
        self.late_at = urgency.deadline  # dispatched after this, it misses its deadline


def _order(waiter: _Waiter) -> tuple[float, int]:
    return waiter.order


class _Excluded(Collection[str]):
    """The engines a pick must skip: those already tried, the saturated ones, and for a
    band below the top one those whose free slots are reserved."""

    __slots__ = ("_reserved", "_saturated", "_tried")

    def __init__(
        self, tried: Collection[str], saturated: set[str], reserved: Collection[str] = ()
    ) -> None:
        self._tried, self._saturated, self._reserved = tried, saturated, reserved

    def __contains__(self, uid: object) -> bool:
        return uid in self._saturated or uid in self._tried or uid in self._reserved

    def __iter__(self) -> Iterator[str]:
        return iter({*self._tried, *self._saturated, *self._reserved})

    def __len__(self) -> int:
        return len({*self._tried, *self._saturated, *self._reserved})


@dataclass
class _ModelQueue:
    """The requests waiting for one model: by band (highest served first), then by line
    (a tenant's, or one for all), each line in (deadline, arrival) order."""

    fair: bool
    passes: dict[int, Passes]  # the admission's, by band, shared by every model's queue
    bands: dict[int, dict[Tenant, list[_Waiter]]] = field(default_factory=dict)
    clocks: dict[int, float] = field(default_factory=dict)  # by band: its last dispatch's pass
    since: float = 0.0  # when its first request came, then when it last dispatched one

    def __len__(self) -> int:
        return sum(len(line) for lines in self.bands.values() for line in lines.values())

    def by_band(self) -> dict[int, int]:
        return {band: sum(map(len, lines.values())) for band, lines in self.bands.items() if lines}

    def push(self, waiter: _Waiter) -> None:
        key = waiter.key = waiter.tenant if self.fair else _FIFO
        lines = self.bands.setdefault(waiter.priority, {})
        line = lines.get(key)
        if line is None:
            line = lines[key] = []
            passes = self.passes.setdefault(waiter.priority, WeakKeyDictionary())
            clock = self.clocks.get(waiter.priority, 0.0)
            passes[key] = max(passes.get(key, 0.0), clock)  # no credit for idle time
        bisect.insort(line, waiter, key=_order)

    def ahead(self, waiter: _Waiter) -> int:
        """About how many requests go before `waiter` if it joins: every one of a higher
        band; in its own, those before it in its line and, with fairness, as many of each
        other line as the turns by weight give it before that."""
        count = 0
        key = waiter.tenant if self.fair else _FIFO
        own = self.bands.get(waiter.priority, {}).get(key, [])
        mine = bisect.bisect_left(own, waiter.order, key=_order)
        for band, lines in self.bands.items():
            if band > waiter.priority:
                count += sum(map(len, lines.values()))
            elif band == waiter.priority:
                for other, line in lines.items():
                    if other is key:
                        count += mine
                    else:
                        turns = math.ceil((mine + 1) * other.weight / key.weight)
                        count += min(len(line), turns)
        return count

    def head(self) -> _Waiter | None:
        if not self.bands:
            return None
        band = max(self.bands)
        lines = self.bands[band]
        key = min(lines, key=self.passes[band].__getitem__)
        return lines[key][0]

    def pop(self, waiter: _Waiter) -> None:
        """Take the head `waiter` out: it is being dispatched."""
        key = waiter.key
        lines = self.bands[waiter.priority]
        line = lines[key]
        line.pop(0)
        passes = self.passes[waiter.priority]
        self.clocks[waiter.priority] = passes[key] = passes[key] + 1.0 / key.weight
        if not line:
            del lines[key]
            if not lines:
                del self.bands[waiter.priority]

    def remove(self, waiter: _Waiter) -> None:
        """Take `waiter` out from anywhere (it left: timeout, client gone, cancelled)."""
        _discard(self.bands, waiter.priority, waiter.key, waiter)


def _discard(
    index: dict[int, dict[Tenant, list[_Waiter]]], band: int, key: Tenant, waiter: _Waiter
) -> None:
    """Take `waiter` out of `index[band][key]`, and the entries it leaves empty."""
    lines = index.get(band, {})
    line = lines.get(key)
    if line is not None and waiter in line:
        line.remove(waiter)
        if not line:
            del lines[key]
            if not lines:
                del index[band]


_FIFO: Final = Tenant(name="(fifo)")  # the one line of a band when fairness is "none"


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's load as admission sees it (the saturation signal): requests waiting by
    band, this router's requests in flight to its engines, how many of its engines are
    saturated, and `saturation`: the engines' mean load (each at most 1) plus the waiting
    requests over what the engines hold at once. 0 idle, 1 every engine at its limit, above
    1 while requests wait (README: Autoscaling on the saturation signal)."""

    queued: dict[str, int]  # by band label (`Admission.band_label`)
    in_flight: int
    engines: int
    saturated: int
    saturation: float


class Admission:
    """Admission control of one router process; see the module's docstring."""

    def __init__(
        self,
        table: RoutingTable,
        config: Config,
        *,
        on_wait: Callable[[str, float], None] | None = None,
        on_reject: Callable[[str, str], None] | None = None,
    ) -> None:
        self._table = table
        self._queues: dict[str, _ModelQueue] = {}
        self._waiting = 0
        # Waiting requests of every model by band, then tenant, oldest first.
        self._by_band: dict[int, dict[Tenant, list[_Waiter]]] = {}
        self._passes: dict[int, Passes] = {}
        # By model: recent dispatches from its queue, each (when, the time it took: since the
        # one before, or since the queue formed).
        self._dispatched: dict[str, deque[tuple[float, float]]] = {}
        self._first_tokens: dict[str, deque[float]] = {}  # by model: engines' recent TTFB
        self._seq = itertools.count()
        self.saturated: set[str] = set()  # uids of engines that take no more now
        # Uids of engines whose free slots are kept for the top band (reserve_per_engine).
        self.reserved: set[str] = set()
        # This router's requests in flight by engine and band (so that a reload that changes
        # the top band counts right), and, with engines that preempt by priority, the engines
        # that run as many of the top band's as they can run at once.
        self._band_load: dict[str, dict[int, int]] = {}
        self.top_full: set[str] = set()
        self._on_wait = on_wait  # (model, seconds waited) of each request that waited
        self._on_reject = on_reject  # (reason, tenant) of each request turned away
        self.configure(config)

    # -- configuration -------------------------------------------------------------------
    def configure(self, config: Config) -> None:
        """Apply `config.admission` and `proxy.max_connections_per_engine` (at start and on
        reload): requests queued or in flight keep going."""
        self._config = admission = config.admission
        self._bands = frozenset({admission.priority, *(t.priority for t in config.tenants)})
        caps = [
            c
            for c in (admission.max_in_flight_per_engine, config.proxy.max_connections_per_engine)
            if c > 0
        ]
        self._cap = min(caps) if caps else 0
        self._reserve = min(admission.reserve_per_engine, self._cap) if self._cap else 0
        self._top = max(self._bands)
        # The engines run cap - reserve at once and preempt lower bands for the top one.
        self._engines_preempt = bool(self._reserve) and admission.priority_to_engines
        fair = admission.fairness == "tenant"
        for queue in self._queues.values():
            queue.fair = fair  # waiting requests keep their line; new ones follow the setting
        self._fair = fair
        self.reserved.clear()
        self.top_full.clear()
        for engine in self._table:
            if self._engines_preempt and self._top_count(engine) >= self._cap - self._reserve:
                self.top_full.add(engine.uid)
            self._update_saturation(engine, trio.current_time())
            if self._reserve and engine.in_flight >= self._cap - self._reserve:
                self.reserved.add(engine.uid)
        self._dispatch()

    def observe(
        self, *, on_wait: Callable[[str, float], None], on_reject: Callable[[str, str], None]
    ) -> None:
        """Report each wait (model, seconds) and each rejection by the queue (reason,
        tenant)."""
        self._on_wait, self._on_reject = on_wait, on_reject

    def band_label(self, priority: int) -> str:
        """The metrics' label of a band: a configured priority (of a tenant, or anonymous
        traffic's) as itself; any other a client chose (by lowering its own) "sheddable"
        below `admission.sheddable_below`, "other" above: a bounded label set."""
        if priority in self._bands:
            return str(priority)
        return "sheddable" if priority < self._config.sheddable_below else "other"

    @staticmethod
    def urgency(
        tenant: Tenant, priority: int | None, deadline_s: float | None, *, since: float
    ) -> Urgency:
        """A request's rank: its tenant's priority, lowered (never raised) to `priority`
        when the client asks, and its deadline: `deadline_s` after `since` (its arrival),
        or its tenant's default."""
        band = tenant.priority if priority is None else min(priority, tenant.priority)
        if deadline_s is None:
            deadline_s = tenant.ttft_deadline_s or math.inf
        return Urgency(band, since + deadline_s)

    # -- per request ---------------------------------------------------------------------
    async def acquire(
        self,
        tenant: Tenant,
        model: str,
        pick: Pick,
        *,
        tried: Collection[str] = (),
        urgency: Urgency = ANYTIME,
    ) -> Engine:
        """An engine for a request, with a slot held on it for the caller (give it back with
        `release`). When every engine for `model` not in `tried` is saturated, wait in the
        queue. Raises NoEngineError when every routable engine for it has been tried
        (failover is over), RateLimitedError (429 `queue_full`, or `shed`) when the queue is
        full or the request's band is sheddable, DeadlineError when its deadline passes
        first, QueueTimeoutError after `admission.queue_timeout_s`. Cancellation (the client
        left, a deadline) takes the request out of the queue (and gives back a slot it was
        just given)."""
        now = trio.current_time()
        first_token = self.first_token_floor(model)
        if now >= urgency.deadline - first_token:
            raise self._late(tenant, model, "before it could be routed", first_token)
        queue = self._queues.get(model)
        if not queue or max(queue.bands) < urgency.priority:  # no one to overtake
            engine = self._take_now(model, pick, tried, urgency.priority)
            if engine is not None:
                return engine
        config = self._config
        if urgency.priority < config.sheddable_below:
            self._reject("shed", tenant)
            raise _shed(urgency.priority, f"every engine for model {model!r} is saturated")
        waiter = _Waiter(tenant, model, pick, tried, urgency, now, next(self._seq))
        waiter.late_at = urgency.deadline - first_token
        if self._cannot_start_in_time(waiter, now):  # before it takes any other's place
            raise self._late(tenant, model, "the requests ahead of it cannot be served in time")
        if self._waiting >= config.queue_size and not self._make_room(tenant, urgency.priority):
            self._reject("queue_full", tenant)
            raise _queue_full(config.queue_size)
        queue = self._enqueue(waiter)
        queued = True
        try:
            timeout = waiter.queued_at + config.queue_timeout_s
            wake = min(timeout, waiter.late_at)
            while waiter.engine is None:
                with trio.move_on_at(wake):
                    await waiter.event.wait()
                if waiter.engine is not None:
                    break
                if waiter.evicted is not None:
                    raise waiter.evicted
                now = trio.current_time()
                if now >= waiter.late_at:
                    raise self._late(tenant, model, "while it waited for an engine", first_token)
                if now >= timeout:
                    self._reject("queue_timeout", tenant)
                    raise QueueTimeoutError(
                        f"waited {config.queue_timeout_s:g} s for an engine for model "
                        f"{model!r}: all were saturated (admission.queue_timeout_s)"
                    )
            queued = False  # dispatched: `_dispatch` took it out of the queue
            engine, waiter.engine = waiter.engine, None
            if self._on_wait is not None:
                self._on_wait(model, trio.current_time() - waiter.queued_at)
            return engine
        finally:
            self._left(waiter, queue, queued=queued)

    def _late(
        self, tenant: Tenant, model: str, when: str, first_token: float = 0.0
    ) -> DeadlineError:
        self._reject("deadline_exceeded", tenant)
        took = (
            f" (its engines take at least {first_token * 1000:.0f} ms to a first token)"
            if first_token
            else ""
        )
        return DeadlineError(
            f"the request's first-token deadline for model {model!r} could not be met {when}{took}"
        )

    def first_token(self, model: str, seconds: float) -> None:
        """An engine of `model` gave a request its first byte `seconds` after it was sent
        there: the floor below which no deadline is met (`first_token_floor`)."""
        recent = self._first_tokens.get(model)
        if recent is None:
            recent = self._first_tokens[model] = deque(maxlen=FIRST_TOKEN_WINDOW)
        recent.append(seconds)

    def first_token_floor(self, model: str) -> float:
        """The least time the model's engines took to a first byte over their last
        FIRST_TOKEN_WINDOW answers (0 until FIRST_TOKEN_MIN of them): a request dispatched
        with less time than that left before its deadline would miss it at the engine."""
        recent = self._first_tokens.get(model)
        if recent is None or len(recent) < FIRST_TOKEN_MIN:
            return 0.0
        return min(recent)

    def _cannot_start_in_time(self, waiter: _Waiter, now: float) -> bool:
        """Whether the requests that would go before `waiter` take past its deadline at the
        model's recent dispatch rate: the rate while its queue waited (idle time between
        bursts not counted), over its last RATE_WINDOW dispatches within RATE_HORIZON_S.
        Fewer than RATE_MIN_SAMPLES of them: no prediction, False."""
        if waiter.urgency.deadline == math.inf:
            return False
        queue = self._queues.get(waiter.model)
        recent = self._dispatched.get(waiter.model)
        if queue is None or recent is None:
            return False
        while recent and recent[0][0] < now - RATE_HORIZON_S:
            recent.popleft()
        busy = sum(took for _, took in recent)
        if len(recent) < RATE_MIN_SAMPLES or busy <= 0:
            return False
        rate = len(recent) / busy  # dispatches per second while requests waited
        return queue.ahead(waiter) >= rate * (waiter.late_at - now)

    def _take_now(
        self, model: str, pick: Pick, tried: Collection[str], priority: int
    ) -> Engine | None:
        """An unsaturated engine for `model`, its slot taken, or None (all saturated, or
        only reserved slots left for a lower band). NoEngineError when every routable engine
        for it has been tried."""
        try:
            engine = pick(self._excluded(tried, priority))
        except NoEngineError:
            if all(e.uid in tried for e in self._table.routable(model)):
                raise
            return None
        self._take(engine, priority)
        return engine

    def _enqueue(self, waiter: _Waiter) -> _ModelQueue:
        queue = self._queues.get(waiter.model)
        if queue is None:
            queue = self._queues[waiter.model] = _ModelQueue(
                fair=self._fair, passes=self._passes, since=waiter.queued_at
            )
        queue.push(waiter)
        self._by_band.setdefault(waiter.priority, {}).setdefault(waiter.tenant, []).append(waiter)
        self._waiting += 1
        return queue

    def _left(self, waiter: _Waiter, queue: _ModelQueue, *, queued: bool) -> None:
        """`waiter` is done waiting, however it ended (dispatched, turned away, cancelled)."""
        if queued and waiter.engine is None and waiter.evicted is None:
            self._unqueue(waiter, queue)
        self._forget(waiter)
        if waiter.engine is not None:  # dispatched just as it left: give the slot back
            self.release(waiter.engine, waiter.priority)

    def _forget(self, waiter: _Waiter) -> None:
        """Take `waiter` out of the index by band and tenant."""
        _discard(self._by_band, waiter.priority, waiter.tenant, waiter)

    def _make_room(self, tenant: Tenant, priority: int) -> bool:
        """The queue is full: push out a waiting request for this one (see the module's
        docstring). False when none may be."""
        lowest = min(self._by_band, default=None)
        if lowest is None or lowest > priority:
            return False
        tenants = self._by_band[lowest]
        if lowest < priority:  # the newest request of the lowest band
            victim = max((line[-1] for line in tenants.values()), key=lambda w: w.queued_at)
            self._evict(
                victim, _shed(lowest, "the queue is full and a request of a higher band came")
            )
            self._reject("shed", victim.tenant)
            return True
        if not self._fair:
            return False
        mine = len(tenants.get(tenant, ()))
        biggest = max(tenants, key=lambda t: len(tenants[t]))
        if biggest is tenant or len(tenants[biggest]) <= mine + 1:
            return False
        self._evict(tenants[biggest][-1], _queue_full(self._config.queue_size))
        self._reject("queue_full", biggest)
        return True

    def _evict(self, victim: _Waiter, error: RequestError) -> None:
        self._unqueue(victim, self._queues[victim.model])
        self._forget(victim)
        victim.evicted = error
        victim.event.set()

    def _unqueue(self, waiter: _Waiter, queue: _ModelQueue) -> None:
        queue.remove(waiter)
        self._waiting -= 1
        if not queue.bands and self._queues.get(waiter.model) is queue:
            del self._queues[waiter.model]

    def release(self, engine: Engine, priority: int = 0) -> None:
        """Give back the slot a request of band `priority` held on `engine`; the next
        waiting request may take it at once."""
        engine.in_flight -= 1
        freed = False
        bands = self._band_load.get(engine.uid)
        if bands is not None and bands.get(priority):
            bands[priority] -= 1
            if not bands[priority]:
                del bands[priority]
        if engine.uid in self.top_full and self._top_count(engine) < self._cap - self._reserve:
            self.top_full.discard(engine.uid)
            freed = True
        if engine.uid in self.saturated and not self._is_saturated(engine, trio.current_time()):
            self.saturated.discard(engine.uid)
            freed = True
        if engine.uid in self.reserved and engine.in_flight < self._cap - self._reserve:
            self.reserved.discard(engine.uid)
            freed = True
        if freed and self._waiting:
            self._dispatch()

    def load_changed(self, engine: Engine) -> None:
        """The engine's scraped figures changed: it may have become (un)saturated."""
        self._update_saturation(engine, trio.current_time())

    def queued(self) -> dict[str, int]:
        """Requests waiting, by model."""
        return {model: len(queue) for model, queue in self._queues.items()}

    def load(self) -> dict[str, ModelLoad]:
        """Each served base model's load (`ModelLoad`), read at scrape time; requests waiting
        for one of its adapters count as its own."""
        now = trio.current_time()
        models = self._table.models()
        parents = {m.id: m.parent for m in models if m.parent is not None}
        waiting_for: dict[str, dict[str, int]] = {}
        for name, queue in self._queues.items():
            counts = waiting_for.setdefault(parents.get(name) or name, {})
            for band, count in queue.by_band().items():
                label = self.band_label(band)
                counts[label] = counts.get(label, 0) + count
        out: dict[str, ModelLoad] = {}
        for model in {*(m.id for m in models if m.parent is None), *waiting_for}:
            engines = self._table.routable(model)
            queued = waiting_for.get(model, {})
            waiting = sum(queued.values())
            busy, in_flight, held = 0.0, 0, 0.0
            saturated = 0
            for engine in engines:
                in_flight += engine.in_flight
                saturated += engine.uid in self.saturated
                share, holds = self._engine_load(engine, now)
                busy += share
                held += holds
            if engines:
                saturation = busy / len(engines) + waiting / max(held, 1.0)
            else:
                saturation = float(waiting > 0) * (1.0 + waiting)
            out[model] = ModelLoad(queued, in_flight, len(engines), saturated, saturation)
        return out

    def _engine_load(self, engine: Engine, now: float) -> tuple[float, float]:
        """How full `engine` is (0..1) and how many requests it holds at once when full: the
        cap over this router's requests in flight when there is one (with engines that
        preempt, what it runs at once: the cap less the reserve); its own figures otherwise
        (its queue against `admission.max_waiting_per_engine`, its KV cache)."""
        runs = self._cap - self._reserve if self._engines_preempt else self._cap
        if engine.uid in self.saturated:
            share = 1.0
        elif runs:
            share = engine.in_flight / runs
        else:
            share = 0.0
        stats = engine.stats
        fresh = stats.fresh(now)
        if fresh and not share >= 1.0:
            limit = self._config.max_waiting_per_engine
            if limit and stats.waiting is not None:
                share = max(share, stats.waiting / limit)
            if stats.kv_cache_usage is not None:
                share = max(share, stats.kv_cache_usage)
        if runs:
            holds = float(runs)
        elif fresh and stats.running:
            holds = stats.running
        else:
            holds = max(float(engine.in_flight), 1.0)
        return min(share, 1.0), holds

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: after every change of the routing table (an engine routable
        again, or gone), update saturation and dispatch what can go."""
        task_status.started()
        while True:
            await self._table.wait_changed()
            self.saturated.intersection_update(e.uid for e in self._table)
            self.reserved.intersection_update(e.uid for e in self._table)
            self.top_full.intersection_update(e.uid for e in self._table)
            for uid in self._band_load.keys() - {e.uid for e in self._table}:
                del self._band_load[uid]
            if self._waiting:
                self._dispatch()

    # -- internals -----------------------------------------------------------------------
    def _is_saturated(self, engine: Engine, now: float) -> bool:
        if self._cap and engine.in_flight >= self._cap:
            return True
        limit = self._config.max_waiting_per_engine
        stats = engine.stats
        return bool(limit) and stats.fresh(now) and (stats.waiting or 0.0) >= limit

    def _update_saturation(self, engine: Engine, now: float) -> None:
        if self._is_saturated(engine, now):
            self.saturated.add(engine.uid)
        elif engine.uid in self.saturated:
            self.saturated.discard(engine.uid)
            if self._waiting:
                self._dispatch()

    def hold(self, engine: Engine, priority: int = 0) -> None:
        """Take a slot on `engine` for a request of band `priority` that is already there
        (the gateway served it from another endpoint than the one chosen); give it back
        with `release`."""
        self._take(engine, priority)

    def _take(self, engine: Engine, priority: int) -> None:
        engine.in_flight += 1
        engine.routed(trio.current_time())
        if self._cap and engine.in_flight >= self._cap:
            self.saturated.add(engine.uid)
        if self._reserve and engine.in_flight >= self._cap - self._reserve:
            self.reserved.add(engine.uid)
        bands = self._band_load.setdefault(engine.uid, {})
        bands[priority] = bands.get(priority, 0) + 1
        if self._engines_preempt and self._top_count(engine) >= self._cap - self._reserve:
            self.top_full.add(engine.uid)

    def _top_count(self, engine: Engine) -> int:
        """The top band's requests this router has in flight on `engine`."""
        bands = self._band_load.get(engine.uid, {})
        return sum(count for band, count in bands.items() if band >= self._top)

    def _excluded(self, tried: Collection[str], priority: int) -> _Excluded:
        """What a request of band `priority` may not be sent to (see `_Excluded`)."""
        if self._reserve and priority < self._top:
            return _Excluded(tried, self.saturated, self.reserved)
        if self._engines_preempt:
            return _Excluded(tried, self.saturated, self.top_full)
        return _Excluded(tried, self.saturated)

    def _dispatch(self) -> None:
        """Hand free slots to waiting requests, in priority and fairness order, as long as
        they can go."""
        now = trio.current_time()
        for model, queue in list(self._queues.items()):
            while (waiter := queue.head()) is not None:
                if waiter.late_at <= now:  # its wake-up has not run yet: not sent
                    floor = waiter.urgency.deadline - waiter.late_at
                    late = self._late(waiter.tenant, model, "while it waited for an engine", floor)
                    self._evict(waiter, late)
                    continue
                try:
                    engine = waiter.pick(self._excluded(waiter.tried, waiter.priority))
                except NoEngineError:
                    break
                queue.pop(waiter)
                self._waiting -= 1
                self._forget(waiter)
                self._take(engine, waiter.priority)
                waiter.engine = engine
                waiter.event.set()
                recent = self._dispatched.get(model)
                if recent is None:
                    recent = self._dispatched[model] = deque(maxlen=RATE_WINDOW)
                recent.append((now, now - queue.since))
                queue.since = now
            if not queue.bands and self._queues.get(model) is queue:
                del self._queues[model]

    def _reject(self, reason: str, tenant: Tenant) -> None:
        if self._on_reject is not None:
            self._on_reject(reason, tenant.name)
