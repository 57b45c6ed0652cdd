"""Admission: which request goes to an engine now and which waits at the router for one:
saturated engines, the router's queue and its fairness across tenants. Whether a tenant may
send a request at all (its rate, its concurrency) is for `limits` to say, before this.

- **Saturation.** An engine is saturated when this router's requests in flight to it reach
  the per-engine cap (`admission.max_in_flight_per_engine`, and never more than
  `proxy.max_connections_per_engine`: one bound, one mechanism), or, while its scraped vLLM
  figures are fresh, when its own queue (`vllm:num_requests_waiting`) reaches
  `admission.max_waiting_per_engine`. Routing policies choose among unsaturated engines only.
- **Queue.** When every engine for the model is saturated, the request waits here, not at an
  engine: at most `admission.queue_size` requests in all (beyond: 429 `queue_full`; with
  fairness, a full queue turns away the newest request of the tenant with the most waiting
  rather than a request of a tenant with fewer), each at
  most `admission.queue_timeout_s` (then 503 `queue_timeout`). A slot that frees up (a request
  done, an engine routable again, its figures lower) dispatches the next waiting request in
  the same step: no polling. A request whose client leaves while it waits leaves the queue.
- **Fairness.** With `admission.fairness = "tenant"`, dispatches go round robin across the
  tenants with waiting requests, weighted by their `weight` (stride scheduling), and in
  arrival order within a tenant: a tenant's backlog delays another tenant's next request by
  about one dispatch at most. `"none"`: arrival order.

Everything here is synchronous bookkeeping on the Trio thread but the wait in `acquire` and
the `run` task that dispatches when the routing table changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Final
from weakref import WeakKeyDictionary

import trio

from ..config import Config
from ..errors import NoEngineError, QueueTimeoutError, RateLimitedError
from ..limits.tenants import Tenant
from ..table import Engine, RoutingTable

__all__ = ["Admission"]

# Picks an engine for a request among the routable ones whose uid is not excluded; raises
# NoEngineError when none is left.
Pick = Callable[[Collection[str]], Engine]

# Each tenant's position in the fair queue (stride scheduling): grows by 1/weight per
# dispatch, one for all models' queues; kept as long as the tenant (a reload keeps the
# tenants that remain), dropped with it.
Passes = WeakKeyDictionary[Tenant, float]


def _queue_full(size: int) -> RateLimitedError:
    return RateLimitedError(
        f"the router's queue is full ({size} requests wait for a free engine)",
        code="queue_full",
        headers=((b"retry-after", b"1"),),
    )


class _Waiter:
    __slots__ = (
        "engine",
        "event",
        "evicted",
        "key",
        "model",
        "pick",
        "queued_at",
        "tenant",
        "tried",
    )

    def __init__(
        self, tenant: Tenant, model: str, pick: Pick, tried: Collection[str], now: float
    ) -> None:
        self.tenant, self.model, self.pick, self.tried = tenant, model, pick, tried
        self.queued_at = now
        self.event = trio.Event()
        self.engine: Engine | None = None  # set when dispatched: a slot is held for it
        self.key = tenant  # its line in the queue: its tenant, or one line for all (FIFO)
        self.evicted = False  # pushed out of a full queue by another tenant's request


class _Excluded(Collection[str]):
    """The engines a pick must skip: those already tried, and the saturated ones."""

    __slots__ = ("_saturated", "_tried")

    def __init__(self, tried: Collection[str], saturated: set[str]) -> None:
        self._tried, self._saturated = tried, saturated

    def __contains__(self, uid: object) -> bool:
        return uid in self._saturated or uid in self._tried

    def __iter__(self) -> Iterator[str]:
        return iter({*self._tried, *self._saturated})

    def __len__(self) -> int:
        return len({*self._tried, *self._saturated})


@dataclass
class _ModelQueue:
    """The requests waiting for one model, in dispatch order."""

    fair: bool
    passes: Passes  # the admission's, shared by every model's queue
    by_tenant: dict[Tenant, deque[_Waiter]] = field(default_factory=dict)
    clock: float = 0.0  # the stride pass of the last dispatch

    def __len__(self) -> int:
        return sum(map(len, self.by_tenant.values()))

    def push(self, waiter: _Waiter) -> None:
        key = waiter.key = waiter.tenant if self.fair else _FIFO
        waiting = self.by_tenant.get(key)
        if waiting is None:
            waiting = self.by_tenant[key] = deque()
            passes = self.passes
            passes[key] = max(passes.get(key, 0.0), self.clock)  # no credit for idle time
        waiting.append(waiter)

    def head(self) -> _Waiter | None:
        if not self.by_tenant:
            return None
        key = min(self.by_tenant, key=self.passes.__getitem__)
        return self.by_tenant[key][0]

    def pop(self, waiter: _Waiter) -> None:
        """Take the head `waiter` out: it is being dispatched."""
        key = waiter.key
        waiting = self.by_tenant[key]
        waiting.popleft()
        self.clock = self.passes[key] = self.passes[key] + 1.0 / key.weight
        if not waiting:
            del self.by_tenant[key]

    def remove(self, waiter: _Waiter) -> None:
        """Take `waiter` out from anywhere (it left: timeout, client gone, cancelled)."""
        key = waiter.key
        waiting = self.by_tenant.get(key)
        if waiting is not None and waiter in waiting:
            waiting.remove(waiter)
            if not waiting:
                del self.by_tenant[key]


_FIFO: Final = Tenant(name="(fifo)")  # the one queue key when fairness is "none"


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
        self._by_tenant: dict[Tenant, list[_Waiter]] = {}  # waiting requests, oldest first
        self._passes: Passes = WeakKeyDictionary()
        self.saturated: set[str] = set()  # uids of engines that take no more now
        self._on_wait = on_wait  # (model, seconds waited) of each request that waited
        self._on_reject = on_reject  # (reason, tenant) of each request turned away
        self.configure(config)

    # -- configuration -------------------------------------------------------------------
    def configure(self, config: Config) -> None:
        """Apply `config.admission` and `proxy.max_connections_per_engine` (at start and on
        reload): requests queued or in flight keep going."""
        self._config = admission = config.admission
        caps = [
            c
            for c in (admission.max_in_flight_per_engine, config.proxy.max_connections_per_engine)
            if c > 0
        ]
        self._cap = min(caps) if caps else 0
        fair = admission.fairness == "tenant"
        for queue in self._queues.values():
            queue.fair = fair  # waiting requests keep their line; new ones follow the setting
        self._fair = fair
        for engine in self._table:
            self._update_saturation(engine, trio.current_time())
        self._dispatch()

    def observe(
        self, *, on_wait: Callable[[str, float], None], on_reject: Callable[[str, str], None]
    ) -> None:
        """Report each wait (model, seconds) and each rejection by the queue (reason,
        tenant)."""
        self._on_wait, self._on_reject = on_wait, on_reject

    # -- per request ---------------------------------------------------------------------
    async def acquire(
        self,
        tenant: Tenant,
        model: str,
        pick: Pick,
        *,
        tried: Collection[str] = (),
    ) -> Engine:
        """An engine for a request, with a slot held on it for the caller (give it back with
        `release`). When every engine for `model` not in `tried` is saturated, wait in the
        queue. Raises NoEngineError when every routable engine for it has been tried
        (failover is over), RateLimitedError (429 `queue_full`) when the queue is full,
        QueueTimeoutError after `admission.queue_timeout_s`. Cancellation (the client left, a
        deadline) takes the request out of the queue (and gives back a slot it was just
        given)."""
        if not self._queues.get(model):  # nobody waits for this model: no one to overtake
            engine = self._take_now(model, pick, tried)
            if engine is not None:
                return engine
        if self._waiting >= self._config.queue_size and not self._make_room(tenant):
            self._reject("queue_full", tenant)
            raise _queue_full(self._config.queue_size)
        waiter, queue = self._enqueue(tenant, model, pick, tried)
        queued = True
        try:
            deadline = waiter.queued_at + self._config.queue_timeout_s
            while waiter.engine is None:
                with trio.move_on_at(deadline):
                    await waiter.event.wait()
                if waiter.engine is not None:
                    break
                if waiter.evicted:
                    raise _queue_full(self._config.queue_size)
                if trio.current_time() >= deadline:
                    self._reject("queue_timeout", tenant)
                    raise QueueTimeoutError(
                        f"waited {self._config.queue_timeout_s:g} s for an engine for model "
                        f"{model!r}: all were saturated (admission.queue_timeout_s)"
                    )
            queued = False  # dispatched: `_dispatch` took it out of the queue
            engine, waiter.engine = waiter.engine, None
            if self._on_wait is not None:
                self._on_wait(model, trio.current_time() - waiter.queued_at)
            return engine
        finally:
            self._left(waiter, queue, queued=queued)

    def _take_now(self, model: str, pick: Pick, tried: Collection[str]) -> Engine | None:
        """An unsaturated engine for `model`, its slot taken, or None (all saturated).
        NoEngineError when every routable engine for it has been tried."""
        try:
            engine = pick(_Excluded(tried, self.saturated))
        except NoEngineError:
            if all(e.uid in tried for e in self._table.routable(model)):
                raise
            return None
        self._take(engine)
        return engine

    def _enqueue(
        self, tenant: Tenant, model: str, pick: Pick, tried: Collection[str]
    ) -> tuple[_Waiter, _ModelQueue]:
        waiter = _Waiter(tenant, model, pick, tried, trio.current_time())
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue(fair=self._fair, passes=self._passes)
        queue.push(waiter)
        self._by_tenant.setdefault(tenant, []).append(waiter)
        self._waiting += 1
        return waiter, queue

    def _left(self, waiter: _Waiter, queue: _ModelQueue, *, queued: bool) -> None:
        """`waiter` is done waiting, however it ended (dispatched, turned away, cancelled)."""
        if queued and waiter.engine is None and not waiter.evicted:
            self._unqueue(waiter, queue)
        tenant = waiter.tenant
        mine = self._by_tenant.get(tenant)
        if mine is not None and waiter in mine:
            mine.remove(waiter)
            if not mine:
                del self._by_tenant[tenant]
        if waiter.engine is not None:  # dispatched just as it left: give the slot back
            self.release(waiter.engine)

    def _make_room(self, tenant: Tenant) -> bool:
        """The queue is full: when `tenant` has fewer requests waiting than the tenant with
        the most, that tenant's newest waiting request is turned away (429) to make room, so
        a flood from one tenant cannot keep the others out of the queue. False otherwise."""
        if not self._fair:
            return False
        mine = len(self._by_tenant.get(tenant, ()))
        biggest = max(self._by_tenant, key=lambda t: len(self._by_tenant[t]), default=None)
        if biggest is None or biggest is tenant or len(self._by_tenant[biggest]) <= mine + 1:
            return False
        victim = self._by_tenant[biggest][-1]
        queue = self._queues[victim.model]
        self._unqueue(victim, queue)
        victim.evicted = True
        victim.event.set()
        self._reject("queue_full", biggest)
        return True

    def _unqueue(self, waiter: _Waiter, queue: _ModelQueue) -> None:
        queue.remove(waiter)
        self._waiting -= 1
        if not queue.by_tenant and self._queues.get(waiter.model) is queue:
            del self._queues[waiter.model]

    def release(self, engine: Engine) -> None:
        """Give back the slot a request held on `engine`; the next waiting request may take
        it at once."""
        engine.in_flight -= 1
        if engine.uid in self.saturated and not self._is_saturated(engine, trio.current_time()):
            self.saturated.discard(engine.uid)
            if self._waiting:
                self._dispatch()

    def load_changed(self, engine: Engine) -> None:
        """The engine's scraped figures changed: it may have become (un)saturated."""
        self._update_saturation(engine, trio.current_time())

    def queued(self) -> dict[str, int]:
        """Requests waiting, by model."""
        return {model: len(queue) for model, queue in self._queues.items()}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: after every change of the routing table (an engine routable
        again, or gone), update saturation and dispatch what can go."""
        task_status.started()
        while True:
            await self._table.wait_changed()
            self.saturated.intersection_update(e.uid for e in self._table)
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

    def _take(self, engine: Engine) -> None:
        engine.in_flight += 1
        if self._cap and engine.in_flight >= self._cap:
            self.saturated.add(engine.uid)

    def _dispatch(self) -> None:
        """Hand free slots to waiting requests, in fairness order, as long as they can go."""
        for model, queue in list(self._queues.items()):
            while (waiter := queue.head()) is not None:
                try:
                    engine = waiter.pick(_Excluded(waiter.tried, self.saturated))
                except NoEngineError:
                    break
                queue.pop(waiter)
                self._waiting -= 1
                mine = self._by_tenant.get(waiter.tenant)
                if mine is not None and waiter in mine:
                    mine.remove(waiter)
                    if not mine:
                        del self._by_tenant[waiter.tenant]
                self._take(engine)
                waiter.engine = engine
                waiter.event.set()
            if not queue.by_tenant:
                del self._queues[model]

    def _reject(self, reason: str, tenant: Tenant) -> None:
        if self._on_reject is not None:
            self._on_reject(reason, tenant.name)
