"""The router's queue: the requests waiting for each model, in what order they go, and when
they give up.

- **Waiting for a model.** A request waits for its model, not for an engine: whenever a slot
  may have freed (a request done, an engine routable again or new, its figures lower) the
  queue asks, head by head, whether an engine can take the head request now (`place`, the
  admission's: a pick among the engines it may go to, its slot taken) and dispatches it in
  the same step, with no polling; when none can, the model's queue waits for the next change.
  A request whose client leaves while it waits leaves the queue.
- **Bands.** Each request has a priority (its tenant's `priority`, or `admission.priority`
  for anonymous traffic; `x-trio-router-priority` may lower it, never raise it: `Urgency.of`).
  Bands are served strictly by priority, the highest first; a request of a higher band than
  any waiting goes before them. A band below `admission.sheddable_below` is sheddable: its
  request is refused at once (429 `shed`) whenever it would have to wait, never queued.
- **Lines.** Within a band, requests stand in lines (a tenant's, or one for all: which line
  goes next is `fairness`'s), each line earliest deadline first, then in arrival order.
- **Limits.** At most `admission.queue_size` requests wait in all: a full queue makes room
  (`Fairness.victim`: the request it names is answered 429 `shed` or `queue_full`) or
  refuses the newcomer (429 `queue_full`). Each waits at most `admission.queue_timeout_s`
  (then 503 `queue_timeout`).
- **Deadlines.** A request may have a first-token deadline (`x-trio-router-deadline-ms`, or
  its tenant's `ttft_deadline_ms`, `admission.ttft_deadline_ms` for anonymous traffic),
  less the engines' own time to a first token (the floor `saturation` keeps). One whose
  deadline passes while it waits is answered at once (504 `deadline_exceeded`) and no engine
  sees it; so is one that arrives behind more waiting requests than the model's recent
  dispatch rate can serve before its deadline (`_cannot_start_in_time`), before it takes any
  other's place.

Everything here is synchronous bookkeeping on the Trio thread but the wait itself (`wait`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import trio

from ...config import AdmissionConfig, Config
from ...errors import (
    DeadlineError,
    NoEngineInTimeError,
    QueueTimeoutError,
    RateLimitedError,
    RequestError,
)
from ...limits.tenants import Tenant
from ...table import Engine
from .fairness import Fairness, discard

__all__ = ["ANYTIME", "ModelQueue", "Ordering", "Pick", "Urgency", "Waiter"]

# Picks an engine for a request among the routable ones whose uid is not excluded; raises
# NoEngineError when none is left.
Pick = Callable[[Collection[str]], Engine]

RATE_WINDOW: Final = 32  # recent dispatches a model's dispatch rate is measured over
RATE_MIN_SAMPLES: Final = 8  # fewer: no prediction, no request refused on one
RATE_HORIZON_S: Final = 60.0  # older dispatches say nothing of the rate now


class Urgency(NamedTuple):
    """How a request ranks in the queue: its band (higher first) and its first-token
    deadline (Trio time; inf: none)."""

    priority: int = 0
    deadline: float = math.inf

    @classmethod
    def of(
        cls, tenant: Tenant, priority: int | None, deadline_s: float | None, *, since: float
    ) -> Urgency:
        """A request's rank: its tenant's priority, lowered (never raised) to `priority`
        when the client asks, and its deadline: `deadline_s` after `since` (its arrival),
        or its tenant's default."""
        band = tenant.priority if priority is None else min(priority, tenant.priority)
        if deadline_s is None:
            deadline_s = tenant.ttft_deadline_s or math.inf
        return cls(band, since + deadline_s)


ANYTIME: Final = Urgency()  # band 0, no deadline


def queue_full(size: int) -> RateLimitedError:
    return RateLimitedError(
        f"the router's queue is full ({size} requests wait for a free engine)",
        code="queue_full",
        headers=((b"retry-after", b"1"),),
    )


def shed(priority: int, why: str) -> RateLimitedError:
    return RateLimitedError(
        f"shed: {why} (priority {priority})", code="shed", headers=((b"retry-after", b"1"),)
    )


class Waiter:
    """One request waiting for an engine for `model`: its rank, its line, and how it ends
    (an engine handed to it, or `evicted` with the error it is answered with)."""

    __slots__ = (
        "engine",
        "event",
        "evicted",
        "floor",
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
        self.floor = 0.0  # the engines' time to a first token when it came
        self.late_at = urgency.deadline  # dispatched after this, it misses its deadline


def _order(waiter: Waiter) -> tuple[float, int]:
    return waiter.order


@dataclass
class ModelQueue:
    """The requests waiting for one model: by band (highest served first), then by line
    (which one goes next: `fairness`), each line in (deadline, arrival) order."""

    fairness: Fairness[Waiter]  # the admission's, shared by every model's queue
    bands: dict[int, dict[Tenant, list[Waiter]]] = field(default_factory=dict)
    clocks: dict[int, float] = field(default_factory=dict)  # by band: its last dispatch's pass
    since: float = 0.0  # when its first request came, then when it last dispatched one

    def __len__(self) -> int:
        return sum(len(line) for lines in self.bands.values() for line in lines.values())

    def by_band(self) -> dict[int, int]:
        return {band: sum(map(len, lines.values())) for band, lines in self.bands.items() if lines}

    def push(self, waiter: Waiter) -> None:
        key = waiter.key = self.fairness.line(waiter.tenant)
        lines = self.bands.setdefault(waiter.priority, {})
        line = lines.get(key)
        if line is None:
            line = lines[key] = []
            self.fairness.opened(waiter.priority, key, self.clocks.get(waiter.priority, 0.0))
        bisect.insort(line, waiter, key=_order)

    def ahead(self, waiter: Waiter) -> int:
        """About how many requests go before `waiter` if it joins: every one of a higher
        band; in its own, those before it in its line and as many of each other line as the
        turns by weight give it before that."""
        count = 0
        key = self.fairness.line(waiter.tenant)
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
                        count += min(len(line), self.fairness.turns(key, other, mine))
        return count

    def head(self) -> Waiter | None:
        """The request that goes next: of the highest band, the head of the line whose
        turn it is."""
        if not self.bands:
            return None
        band = max(self.bands)
        lines = self.bands[band]
        return lines[self.fairness.next_line(band, lines)][0]

    def pop(self, waiter: Waiter) -> None:
        """Take the head `waiter` out: it is being dispatched."""
        key = waiter.key
        lines = self.bands[waiter.priority]
        line = lines[key]
        line.pop(0)
        self.clocks[waiter.priority] = self.fairness.served(waiter.priority, key)
        if not line:
            del lines[key]
            if not lines:
                del self.bands[waiter.priority]

    def remove(self, waiter: Waiter) -> None:
        """Take `waiter` out from anywhere (it left: timeout, client gone, cancelled)."""
        discard(self.bands, waiter.priority, waiter.key, waiter)


class Ordering:
    """The router's queue, every model's (see the module's docstring). `place` hands a
    waiting request an engine with its slot taken, or None when none can take it now."""

    def __init__(
        self,
        place: Callable[[Waiter], Engine | None],
        *,
        engineless: Callable[[str], bool] = lambda model: False,
    ) -> None:
        self._place = place
        self._engineless = engineless  # no routable engine serves the model now
        self._fairness: Fairness[Waiter] = Fairness()
        self._queues: dict[str, ModelQueue] = {}
        self._waiting = 0
        # By model: recent dispatches from its queue, each (when, the time it took: since the
        # one before, or since the queue formed).
        self._dispatched: dict[str, deque[tuple[float, float]]] = {}
        self._seq = itertools.count()
        self._config = AdmissionConfig()
        self._bands = frozenset({0})
        self._on_wait: Callable[[str, float], None] | None = None
        self._on_reject: Callable[[str, str], None] | None = None

    def configure(self, config: Config) -> None:
        """Apply `config.admission` and the tenants' bands: requests waiting keep their
        place and their line; new ones follow the new settings. The caller dispatches."""
        self._config = admission = config.admission
        self._bands = frozenset({admission.priority, *(t.priority for t in config.tenants)})
        self._fairness.fair = admission.fairness == "tenant"

    def observe(
        self,
        *,
        on_wait: Callable[[str, float], None] | None,
        on_reject: Callable[[str, str], None] | None,
    ) -> None:
        """Report each wait (model, seconds) and each refusal (reason, tenant)."""
        self._on_wait, self._on_reject = on_wait, on_reject

    @property
    def top(self) -> int:
        """The top band: the highest configured priority."""
        return max(self._bands)

    @property
    def waiting(self) -> int:
        """Requests waiting, in all."""
        return self._waiting

    def band_label(self, priority: int) -> str:
        """The metrics' label of a band: a configured priority (of a tenant, or anonymous
        traffic's) as itself; any other a client chose (by lowering its own) "sheddable"
        below `admission.sheddable_below`, "other" above: a bounded label set."""
        if priority in self._bands:
            return str(priority)
        return "sheddable" if priority < self._config.sheddable_below else "other"

    def queued(self) -> dict[str, int]:
        """Requests waiting, by model."""
        return {model: len(queue) for model, queue in self._queues.items()}

    def queued_by_band(self) -> dict[str, dict[str, int]]:
        """Requests waiting, by model and band label."""
        waiting: dict[str, dict[str, int]] = {}
        for model, queue in self._queues.items():
            counts = waiting[model] = {}
            for band, count in queue.by_band().items():
                label = self.band_label(band)
                counts[label] = counts.get(label, 0) + count
        return waiting

    def first_in_line(self, model: str, priority: int) -> bool:
        """Whether a request of band `priority` for `model` would go before every request
        waiting for it (none waits, or only lower bands): it may take a free engine now."""
        queue = self._queues.get(model)
        return not queue or max(queue.bands) < priority

    # -- joining and waiting -------------------------------------------------------------
    def join(
        self,
        tenant: Tenant,
        model: str,
        pick: Pick,
        *,
        tried: Collection[str],
        urgency: Urgency,
        first_token: float,
    ) -> Waiter:
        """Put a request in `model`'s queue (`first_token`: the engines' floor, taken off
        its deadline); `wait` then waits for its engine. Raises RateLimitedError (429 `shed`:
        its band is sheddable; `queue_full`) and DeadlineError when the requests ahead of it
        cannot be served in time."""
        now = trio.current_time()
        config = self._config
        if urgency.priority < config.sheddable_below:
            self._reject("shed", tenant)
            raise shed(urgency.priority, f"every engine for model {model!r} is saturated")
        waiter = Waiter(tenant, model, pick, tried, urgency, now, next(self._seq))
        waiter.floor, waiter.late_at = first_token, urgency.deadline - first_token
        if self._cannot_start_in_time(waiter, now):  # before it takes any other's place
            raise self.late(tenant, model, "the requests ahead of it cannot be served in time")
        if self._waiting >= config.queue_size and not self._make_room(tenant, urgency.priority):
            self._reject("queue_full", tenant)
            raise queue_full(config.queue_size)
        self._enqueue(waiter)
        return waiter

    async def wait(self, waiter: Waiter) -> Engine:
        """The engine dispatched to `waiter` (its slot held). Raises the error it was
        evicted with, DeadlineError when its deadline passes first, QueueTimeoutError after
        `admission.queue_timeout_s`. However it ends, it leaves the queue; cancelled just as
        an engine was handed to it, `waiter.engine` still holds that engine (the caller
        gives its slot back)."""
        model, tenant, config = waiter.model, waiter.tenant, self._config
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
                    raise self.late(tenant, model, "while it waited for an engine", waiter.floor)
                if now >= timeout:
                    raise self._timed_out(waiter)
            queued = False  # dispatched: `dispatch` took it out of the queue
            engine, waiter.engine = waiter.engine, None
            if self._on_wait is not None:
                self._on_wait(model, trio.current_time() - waiter.queued_at)
            return engine
        finally:
            if queued and waiter.engine is None and waiter.evicted is None:
                self._unqueue(waiter)
            self._fairness.left(waiter)

    def _timed_out(self, waiter: Waiter) -> RequestError:
        """The refusal of a request that waited `queue_timeout_s`, counted: its model had
        no routable engine (503 `no_engine`, try again after as long), or all were
        saturated (503 `queue_timeout`)."""
        wait, model = self._config.queue_timeout_s, waiter.model
        if self._engineless(model):
            self._reject("no_engine", waiter.tenant)
            return NoEngineInTimeError(
                f"waited {wait:g} s for an engine for model {model!r}: none was routable "
                "(admission.queue_timeout_s)",
                retry_after_s=wait,
            )
        self._reject("queue_timeout", waiter.tenant)
        return QueueTimeoutError(
            f"waited {wait:g} s for an engine for model {model!r}: all were saturated "
            "(admission.queue_timeout_s)"
        )

    def late(
        self, tenant: Tenant, model: str, when: str, first_token: float = 0.0
    ) -> DeadlineError:
        """The refusal of a request of `tenant` whose first-token deadline cannot be met
        (`first_token`: the engines' floor it counted), counted."""
        self._reject("deadline_exceeded", tenant)
        took = (
            f" (its engines take at least {first_token * 1000:.0f} ms to a first token)"
            if first_token
            else ""
        )
        return DeadlineError(
            f"the request's first-token deadline for model {model!r} could not be met {when}{took}"
        )

    # -- dispatching ---------------------------------------------------------------------
    def dispatch(self) -> None:
        """Hand free slots to waiting requests, in band, line and deadline order, as long as
        `place` finds an engine for each model's next one; those whose deadline has passed
        leave on the way."""
        now = trio.current_time()
        for model, queue in list(self._queues.items()):
            while (waiter := queue.head()) is not None:
                if waiter.late_at <= now:  # its wake-up has not run yet: not sent
                    late = self.late(
                        waiter.tenant, model, "while it waited for an engine", waiter.floor
                    )
                    self._evict(waiter, late)
                    continue
                engine = self._place(waiter)
                if engine is None:
                    break
                queue.pop(waiter)
                self._waiting -= 1
                self._fairness.left(waiter)
                waiter.engine = engine
                waiter.event.set()
                recent = self._dispatched.get(model)
                if recent is None:
                    recent = self._dispatched[model] = deque(maxlen=RATE_WINDOW)
                recent.append((now, now - queue.since))
                queue.since = now
            if not queue.bands and self._queues.get(model) is queue:
                del self._queues[model]

    # -- internals -----------------------------------------------------------------------
    def _cannot_start_in_time(self, waiter: Waiter, now: float) -> bool:
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

    def _enqueue(self, waiter: Waiter) -> None:
        queue = self._queues.get(waiter.model)
        if queue is None:
            queue = self._queues[waiter.model] = ModelQueue(self._fairness, since=waiter.queued_at)
        queue.push(waiter)
        self._fairness.joined(waiter)
        self._waiting += 1

    def _make_room(self, tenant: Tenant, priority: int) -> bool:
        """The queue is full: evict the waiting request fairness names for this one. False
        when none may go."""
        found = self._fairness.victim(tenant, priority)
        if found is None:
            return False
        victim, reason = found
        if reason == "shed":
            why = "the queue is full and a request of a higher band came"
            self._evict(victim, shed(victim.priority, why))
        else:
            self._evict(victim, queue_full(self._config.queue_size))
        self._reject(reason, victim.tenant)
        return True

    def _evict(self, victim: Waiter, error: RequestError) -> None:
        self._unqueue(victim)
        self._fairness.left(victim)
        victim.evicted = error
        victim.event.set()

    def _unqueue(self, waiter: Waiter) -> None:
        queue = self._queues[waiter.model]
        queue.remove(waiter)
        self._waiting -= 1
        if not queue.bands:
            del self._queues[waiter.model]

    def _reject(self, reason: str, tenant: Tenant) -> None:
        if self._on_reject is not None:
            self._on_reject(reason, tenant.name)
