"""The endpoint picker's decision, on the Trio thread: which engine a gateway's request goes
to, made by the proxy's own steps: the one intake of a request as data
(`serving.intake.Incoming`, built here from the gateway's exchange; `serving.prepared.take_in`
and `resolve`), tenants and limits, `serving.failover.choose` with admission and the routing
policy, fallback models.

`Picker.exchange` serves one request of the gateway from its decision to its end: it answers
`Chosen` (the endpoints, in order, and what to change of the request) or `Refusal` (an
immediate answer: 503 no ready endpoint, 429 over a limit or the queue full, 4xx a request
that cannot be routed), then holds the engine's admission slot and the tenant's ticket until
the gateway says the request has ended, so the engines' load counts it while its answer
streams. The gateway reports the endpoint that served it (it may have fallen back to another
of the list): the slot moves there. The exchange's record (metrics, span, access record) is
written once when it ends, with the status the gateway reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final

import trio

from ..errors import BodyTooLargeError, NoEngineError, RequestError
from ..limits.local import Ticket
from ..routing.route import Route
from ..serving.attempt import Failed, usage_of
from ..serving.errors import CLIENT_CLOSED, error_answer, error_body
from ..serving.failover import choose
from ..serving.intake import Incoming
from ..serving.prepared import (
    Prepared,
    fell_back,
    for_model,
    next_model,
    resolve,
    take_in,
    with_tokens,
)
from ..serving.record import ExchangeRecord
from ..serving.runtime import Runtime
from ..table import Engine

__all__ = ["STOPPED", "Chosen", "Exchange", "Picker", "Refusal", "endpoint_of"]

logger = logging.getLogger(__name__)

REASON_HEADER: Final = b"x-trio-router-reason"  # the error code of an immediate answer


def endpoint_of(engine: Engine) -> str:
    """The engine's `ip:port` (`[ip6]:port`), as the gateway's destination header names it."""
    return engine.url.removeprefix("http://")


@dataclass(frozen=True, slots=True)
class Chosen:
    """Route the request to `endpoints[0]` (the others, in order, if the gateway falls
    back); `headers` to set on it, and its `body` when routing rewrote it (a fallback or
    aliased model's name), else None."""

    endpoints: tuple[str, ...]
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Answer the request at once: `status`, `headers` (with the reason) and `body`."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


Verdict = Chosen | Refusal


@dataclass(eq=False, slots=True)
class Exchange:
    """One request of the gateway, as the gRPC side hands it over, and what the gateway says
    of it afterwards (each set on the Trio thread). `answer` is called once, on the Trio
    thread, with the verdict."""

    method: str
    target: str  # the path and query
    headers: list[tuple[bytes, bytes]]  # lower-case names, no pseudo-headers
    body: bytes
    subset: tuple[str, ...] | None  # the gateway's endpoint subset hint, if any
    answer: Callable[[Verdict], None]
    client: str = ""
    ended: trio.Event = field(default_factory=trio.Event)
    gone: bool = False  # the gateway's stream broke off (the request is gone)
    deciding: trio.CancelScope | None = None  # while the verdict is being made
    status: int = 0  # the answer's status, as the gateway reported it
    served: str = ""  # the endpoint that served it, as the gateway reported it
    tail: bytes = b""  # the end of the answer's body, when the gateway sent it

    def responded(self, status: int, served: str) -> None:
        """The answer's head passed the gateway: its status and the endpoint that served it."""
        self.status, self.served = status, served

    def end(self, tail: bytes = b"", gone: bool = False) -> None:
        """The gateway's stream for this request is over: the answer's end, or (`gone`) the
        request gone, which stops a decision still being made; `tail`: the end of the
        answer's body, if the gateway sent it."""
        if tail:
            self.tail = tail
        self.gone = gone
        if gone and self.deciding is not None:
            self.deciding.cancel(reason="the gateway's stream ended")
        self.ended.set()


@dataclass(slots=True)
class _Held:
    """What a routed request holds until it ends: its engine's admission slot and its
    tenant's ticket."""

    engine: Engine | None = None
    ticket: Ticket | None = None
    priority: int = 0  # the request's band: its slot is given back as that band's


class Picker:
    """Decides for the gateway's requests with the router's current runtime (`runtime()`,
    swapped whole on a reload) and max body size."""

    def __init__(self, runtime: Callable[[], Runtime], *, endpoints: int = 1) -> None:
        self._runtime, self._endpoints = runtime, endpoints

    async def exchange(self, ex: Exchange) -> None:
        """Serve `ex` from its decision to its end (see the module's docstring). The verdict
        is given exactly once: a Refusal when this is cancelled before it is made."""
        rt = self._runtime()
        incoming = Incoming.of_target(ex.method, ex.target, ex.headers, ex.client)
        record = ExchangeRecord.begin(rt.recording, incoming)
        held = _Held()
        verdict: Verdict | None = None
        try:
            with trio.CancelScope() as ex.deciding:
                if ex.gone:
                    ex.deciding.cancel(reason="the gateway's stream ended")
                verdict = await self._decide(ex, incoming, record, rt, held)
            ex.deciding = None
            if verdict is None:  # the gateway's stream ended first
                record.status = CLIENT_CLOSED
                verdict = STOPPED
            ex.answer(verdict)
            if held.engine is not None:
                await ex.ended.wait()
                self._settle(ex, record, rt)
                held.engine = self._moved(ex, held.engine, held.priority, rt)
        finally:
            if verdict is None:  # cancelled from outside: the picker stops
                ex.answer(STOPPED)
            if held.engine is not None:
                rt.services.admission.release(held.engine, held.priority)
            if held.ticket is not None:
                rt.services.limits.leave(held.ticket)
            if not record.status:
                record.status = CLIENT_CLOSED
            record.finish()

    async def _decide(
        self, ex: Exchange, incoming: Incoming, record: ExchangeRecord, rt: Runtime, held: _Held
    ) -> Verdict:
        """The verdict for `ex` (`incoming`: its request as data): the engine chosen (its
        slot and the tenant's ticket kept in `held`), or the refusal of a request that cannot
        be routed."""
        try:
            if len(ex.body) > rt.config.server.max_body_bytes:
                raise BodyTooLargeError(
                    f"request body exceeds server.max_body_bytes "
                    f"({rt.config.server.max_body_bytes})"
                )
            intake = take_in(incoming, rt, record)
            prepared = await resolve(intake, ex.body, rt, record)
            held.ticket = await rt.services.limits.admit(intake.tenant)
            held.priority = prepared.urgency.priority
            held.engine, prepared = await self._choose(prepared, ex.subset, record, rt)
        except RequestError as exc:
            return _refusal(exc, record)
        return self._chosen(held.engine, prepared, ex, rt)

    async def _choose(
        self,
        prepared: Prepared,
        subset: tuple[str, ...] | None,
        record: ExchangeRecord,
        rt: Runtime,
    ) -> tuple[Engine, Prepared]:
        """The engine for `prepared`, its admission slot held: the policy's choice among the
        engines of the first model of its chain that can take it (within the gateway's
        subset), and the request for that model. Raises RequestError: no model can."""
        prepared = await with_tokens(prepared, rt)
        while True:
            route = rt.route
            if (pinned := prepared.pinned) is not None:
                route = Route(rt.policy, lambda roles: (pinned,))
            chosen = await choose(prepared, rt, route, _outside(prepared, subset, rt))
            if not isinstance(chosen, Failed):
                record.tried(chosen.engine.name)
                return chosen.engine, prepared
            index = next_model(rt.services.table, prepared, prepared.index)
            assert chosen.error is not None
            if index is None or not chosen.fallback:
                raise chosen.error
            fell_back(
                rt,
                record,
                prepared.model,
                prepared.chain[index],
                chosen.error.code,
                str(chosen.error),
            )
            prepared = await with_tokens(await for_model(prepared, index, rt, record), rt)

    def _chosen(self, engine: Engine, prepared: Prepared, ex: Exchange, rt: Runtime) -> Chosen:
        """The verdict for `engine`: it first, then (when more are asked for) others of the
        model, as the policy would order them; the request's id and the engines' key set on
        it when the router made them; its body when routing rewrote it."""
        endpoints = [endpoint_of(engine)]
        if self._endpoints > 1 and prepared.pinned is None:
            others = [e for e in rt.services.table.routable(prepared.model) if e is not engine]
            allowed = set(ex.subset) if ex.subset is not None else None
            exclude = [engine.uid]
            while len(endpoints) < self._endpoints and others:
                decision = rt.policy.choose(others, prepared.info, exclude=exclude)
                if decision.engine.uid in exclude:
                    break
                exclude.append(decision.engine.uid)
                others.remove(decision.engine)
                if allowed is None or endpoint_of(decision.engine) in allowed:
                    endpoints.append(endpoint_of(decision.engine))
        sent = {name: value for name, value in ex.headers}
        changed = tuple(
            (name, value)
            for name, value in prepared.headers
            if name in (b"x-request-id", b"authorization") and sent.get(name) != value
        )
        body = bytes(prepared.body) if prepared.body is not ex.body else None
        return Chosen(tuple(endpoints), changed, body)

    @staticmethod
    def _settle(ex: Exchange, record: ExchangeRecord, rt: Runtime) -> None:
        """What the gateway reported of the answer: its status, and its usage summary when
        the gateway sent the answer's body."""
        record.status = ex.status  # none reported: 499, when the record is written
        if ex.status == 200 and ex.tail and (usage := usage_of(ex.tail)):
            rt.services.metrics.tokens(record.served_model, *usage)

    @staticmethod
    def _moved(ex: Exchange, held: Engine, priority: int, rt: Runtime) -> Engine:
        """The engine whose slot the request holds: the one that served it, if the gateway
        fell back to another endpoint of the list (the slot moves there)."""
        if not ex.served or ex.served == endpoint_of(held):
            return held
        for engine in rt.services.table:
            if endpoint_of(engine) == ex.served:
                rt.services.admission.release(held, priority)
                rt.services.admission.hold(engine, priority)
                return engine
        return held


def _outside(prepared: Prepared, subset: tuple[str, ...] | None, rt: Runtime) -> Collection[str]:
    """The engines of the request's model the gateway's subset leaves out (their uids), as if
    tried; NoEngineError when it leaves none (no engine of the subset is ready)."""
    if subset is None:
        return ()
    allowed = set(subset)
    routable = rt.services.table.routable(prepared.model)
    outside = [e.uid for e in routable if endpoint_of(e) not in allowed]
    if len(outside) == len(routable):
        raise NoEngineError(
            f"no ready endpoint of model {prepared.model!r} among the {len(allowed)} of the "
            "gateway's subset hint"
        )
    return outside


STOPPED: Final = Refusal(
    503,
    (
        (b"content-type", b"application/json"),
        (REASON_HEADER, b"picker_stopping"),
        (b"retry-after", b"1"),
    ),
    error_body("the endpoint picker is stopping", type="server_error", code="picker_stopping"),
)


def _refusal(exc: RequestError, record: ExchangeRecord) -> Refusal:
    """The immediate answer for `exc`: the proxy's own error answer, with its reason."""
    record.status = exc.status
    if exc.refusal:
        record.refusal = exc.code
    logger.warning(
        "request %s for %s refused with %d: %s",
        record.request_id_text,
        record.model or "-",
        exc.status,
        exc,
    )
    status, headers, body = error_answer(exc, record.request_id, record.engine)
    return Refusal(status, (*headers, (REASON_HEADER, exc.code.encode())), body)
