"""Admission: which request goes to an engine now and which waits at the router for one.
Whether a tenant may send a request at all (its rate, its concurrency) is for `limits` to
say, before this.

`Admission` composes three concerns, each its own module, the way flow control is usually
split (an ordering policy, a fairness policy, a saturation detector):

- `saturation`: which engines take no more now (the per-engine caps, the engines' own
  queues), the slots this router's requests hold on them, the slots kept for the top band,
  the engines' time to a first token, and each model's load (the saturation signal).
- `ordering`: the router's queue, by model: bands served strictly by priority, first-token
  deadlines, `queue_size`, `queue_timeout_s`, sheddable bands, and the dispatch that hands a
  freed slot to the next waiting request in the same step.
- `fairness`: within a band, whose line goes next (tenants by weight, or one line for
  all), and whose waiting request gives way when the queue is full.

A request (`acquire`) goes at once to an engine it may go to (one `saturation` does not
exclude for its band) unless requests of its band or a higher one wait for its model; else
it joins the queue and waits there for a slot, its deadline or the queue's timeout. A request
waits for its model, not for an engine: whatever frees a slot (`release`, `load_changed`, a
change of the routing table seen by `run`, `configure`) dispatches what can go. Everything
here is synchronous bookkeeping on the Trio thread but the wait in `acquire` and the `run`
task.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import trio

from ...config import Config
from ...errors import NoEngineError
from ...limits.tenants import Tenant
from ...table import Engine, RoutingTable
from .ordering import ANYTIME, Ordering, Pick, Urgency, Waiter
from .saturation import ModelLoad, Saturation

__all__ = ["ANYTIME", "Admission", "ModelLoad", "Pick", "Urgency"]


class Admission:
    """Admission control of one router process; see the package's docstring."""

    def __init__(
        self,
        table: RoutingTable,
        config: Config,
        *,
        on_wait: Callable[[str, float], None] | None = None,
        on_reject: Callable[[str, str], None] | None = None,
    ) -> None:
        self._table = table
        self._saturation = Saturation(table)
        self._ordering = Ordering(self._place, engineless=self._engineless)
        # (model, seconds waited) of each request that waited; (reason, tenant) of each
        # request turned away.
        self._ordering.observe(on_wait=on_wait, on_reject=on_reject)
        self.configure(config)

    # -- configuration -------------------------------------------------------------------
    def configure(self, config: Config) -> None:
        """Apply `config.admission`, the tenants' bands and `proxy.max_connections_per_engine`
        (at start and on reload): requests queued or in flight keep going, and what the new
        limits let go goes."""
        self._ordering.configure(config)
        self._saturation.configure(config, self._ordering.top)
        self._room = config.admission.wait_for_engine
        self._known_model_s = config.admission.known_model_s
        self._fronted = config.routing.fronted()
        self._ordering.dispatch()

    def observe(
        self, *, on_wait: Callable[[str, float], None], on_reject: Callable[[str, str], None]
    ) -> None:
        """Report each wait (model, seconds) and each rejection by the queue (reason,
        tenant)."""
        self._ordering.observe(on_wait=on_wait, on_reject=on_reject)

    def band_label(self, priority: int) -> str:
        """The metrics' label of a band (`Ordering.band_label`)."""
        return self._ordering.band_label(priority)

    @staticmethod
    def urgency(
        tenant: Tenant, priority: int | None, deadline_s: float | None, *, since: float
    ) -> Urgency:
        """A request's rank in the queue (`Urgency.of`)."""
        return Urgency.of(tenant, priority, deadline_s, since=since)

    def waits_for(self, model: str) -> bool:
        """Whether a request for `model` with no routable engine waits for one (the waiting
        room): on (`admission.wait_for_engine`), and the model is known: an engine served it
        within `admission.known_model_s`, or the configuration names it."""
        return self._room and (
            model in self._fronted or self._table.served_within(model, self._known_model_s)
        )

    # -- per request ---------------------------------------------------------------------
    async def acquire(
        self,
        tenant: Tenant,
        model: str,
        pick: Pick,
        *,
        tried: Collection[str] = (),
        urgency: Urgency = ANYTIME,
        may_wait: bool = True,
        carrying_on: bool = False,
    ) -> Engine:
        """An engine for a request, with a slot held on it for the caller (give it back with
        `release`). When every engine for `model` not in `tried` is saturated, wait in the
        queue; when no engine for it is routable at all (`tried` or not), with the waiting
        room on and `may_wait`, wait there for one (the engines tried are gone: any that
        comes back may take it); `carrying_on` (an answer begun, to be carried on), wait
        there too while every routable engine has been tried and one that has not is out of
        routing for now (ejected, failing its probes, not probed yet). Raises
        NoEngineError when every routable engine for it has
        been tried (failover is over) and the request may not wait, RateLimitedError (429
        `queue_full`, or `shed`) when the queue is full or the request's band is sheddable,
        DeadlineError when its deadline passes first, after `admission.queue_timeout_s`
        NoEngineInTimeError (503 `no_engine`) when no engine was routable then, else
        QueueTimeoutError. Cancellation (the client left, a deadline) takes the request out
        of the queue (and gives back a slot it was just given)."""
        first_token = self._saturation.first_token_floor(model)
        if trio.current_time() >= urgency.deadline - first_token:
            raise self._ordering.late(tenant, model, "before it could be routed", first_token)
        if self._ordering.first_in_line(model, urgency.priority):  # no one to overtake
            waits = "untried" if carrying_on and may_wait else "room" if may_wait else ""
            engine = self._take_now(model, pick, tried, urgency.priority, waits)
            if engine is not None:
                return engine
        if not self._table.routable(model):  # the waiting room: whatever comes may take it
            tried = ()
        waiter = self._ordering.join(
            tenant, model, pick, tried=tried, urgency=urgency, first_token=first_token
        )
        try:
            return await self._ordering.wait(waiter)
        finally:
            if waiter.engine is not None:  # dispatched just as it left: give the slot back
                self.release(waiter.engine, waiter.priority)

    def _take_now(
        self, model: str, pick: Pick, tried: Collection[str], priority: int, waits: str
    ) -> Engine | None:
        """An engine for `model` that may take a request of band `priority` now, its slot
        taken, or None (all saturated, or only reserved slots left for a lower band): the
        request waits. NoEngineError when every routable engine for it has been tried, or
        none is routable and the request may not wait for one (`waits`: "" never, "room"
        when none is routable, "untried" also while every routable one has been tried)."""
        try:
            engine = pick(self._saturation.excluded(tried, priority))
        except NoEngineError:
            routable = self._table.routable(model)
            if not routable and self._room and waits:
                return None  # the waiting room (`resolve` let only a known model through)
            if all(e.uid in tried for e in routable):
                if self._room and waits == "untried" and self._table.may_come_back(model, tried):
                    return None  # for an engine not tried yet, out of routing for now
                raise
            return None
        self._saturation.take(engine, priority)
        return engine

    def _place(self, waiter: Waiter) -> Engine | None:
        """An engine for the waiting request, its slot taken, or None: none can take it
        now (the queue's `place`)."""
        try:
            engine = waiter.pick(self._saturation.excluded(waiter.tried, waiter.priority))
        except NoEngineError:
            return None
        self._saturation.take(engine, waiter.priority)
        return engine

    def _engineless(self, model: str) -> bool:
        """No routable engine serves `model` now (the queue's wait ends `no_engine`)."""
        return not self._table.routable(model)

    def hold(self, engine: Engine, priority: int = 0) -> None:
        """Take a slot on `engine` for a request of band `priority` that is already there
        (the gateway served it from another endpoint than the one chosen); give it back
        with `release`."""
        self._saturation.take(engine, priority)

    def release(self, engine: Engine, priority: int = 0) -> None:
        """Give back the slot a request of band `priority` held on `engine`; the next
        waiting request may take it at once."""
        if self._saturation.release(engine, priority) and self._ordering.waiting:
            self._ordering.dispatch()

    def load_changed(self, engine: Engine) -> None:
        """The engine's scraped figures changed: it may have become (un)saturated."""
        if self._saturation.update(engine, trio.current_time()) and self._ordering.waiting:
            self._ordering.dispatch()

    def first_token(self, model: str, seconds: float) -> None:
        """An engine of `model` gave a request its first byte `seconds` after it was sent
        there (`Saturation.first_token`)."""
        self._saturation.first_token(model, seconds)

    def first_token_floor(self, model: str) -> float:
        """The least time the model's engines took to a first byte lately
        (`Saturation.first_token_floor`)."""
        return self._saturation.first_token_floor(model)

    # -- what it reports -----------------------------------------------------------------
    @property
    def saturated(self) -> set[str]:
        """Uids of the engines that take no more now."""
        return self._saturation.saturated

    @property
    def reserved(self) -> set[str]:
        """Uids of the engines whose free slots are kept for the top band."""
        return self._saturation.reserved

    @property
    def top_full(self) -> set[str]:
        """With engines that preempt by priority, uids of those that run as many of the top
        band's requests as they can at once."""
        return self._saturation.top_full

    def queued(self) -> dict[str, int]:
        """Requests waiting, by model."""
        return self._ordering.queued()

    def load(self) -> dict[str, ModelLoad]:
        """Each served base model's load (`ModelLoad`), read at scrape time; requests waiting
        for one of its adapters count as its own."""
        return self._saturation.load(self._ordering.queued_by_band())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: after every change of the routing table (an engine routable
        again, or gone), forget the engines gone and dispatch what can go."""
        task_status.started()
        while True:
            await self._table.wait_changed()
            self._saturation.forget_gone()
            if self._ordering.waiting:
                self._ordering.dispatch()
