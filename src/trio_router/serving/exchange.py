"""The proxy exchange: one proxied request, from its head to its last byte.

    resolve  -> admit -> disaggregate, or try engines -> answer -> record

`run_exchange` takes the request in as the endpoint picker does (`prepared.take_in`: its
head and tenant), reads its body and resolves it (`prepared.resolve`: a frozen `Prepared`),
admits it under its tenant's limits (`limits`), takes its token ids when the policy routes on
them, routes it (to the engine that holds its stored response, through prefill and decode
steps, or to the policy's choice, `failover.try_engines`: each try one `attempt.attempt`),
goes on to the next fallback model while the one before cannot take it, and writes what is
left to answer (an error, or an engine's refusal read whole) through the request's answer
writer (`answer.Answer`); an engine's answer went to the client from inside its attempt.
Each step returns what it decided (the routing: its `Outcome` and the `Trail` of engines
tried, which names the engine on an error answer); `ExchangeRecord` hears what it reports
and writes the metrics, the span and the access record once, however the request ends.

The request runs in its own cancel scope, armed on the answer writer: the client leaving
cancels it at any await (in the body, in the router's queue, while the engine is awaited or
its answer relayed); leaving the scope closes the engine's connection (vLLM then aborts the
generation), and the request is counted with status 499. No task per request watches for
that on trio_router's own server, and nothing below the exchange takes a "client gone" check.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
from collections.abc import Callable

import trio

from ..asgi import Receive
from ..errors import RequestError
from ..routing.route import Route
from .answer import Answer
from .attempt import Failed, Outcome, Refused
from .deliver import Deliver
from .disaggregated import disaggregated
from .errors import CLIENT_CLOSED, error_answer
from .failover import Trail, try_engines
from .intake import Held, Incoming, read_body
from .prepared import (
    Prepared,
    fell_back,
    for_model,
    next_model,
    resolve,
    take_in,
    with_tokens,
)
from .record import ExchangeRecord
from .resume import resumable, with_token_ids
from .runtime import Runtime

__all__ = ["request_ids", "run_exchange"]

logger = logging.getLogger(__name__)

_FALLBACK_REASONS = {"no_routable_engine": "no_engine"}  # else the error's code


def request_ids() -> Callable[[], bytes]:
    """Request ids for requests that came without one: this process's random prefix and a
    counter."""
    prefix, counter = secrets.token_hex(4).encode(), itertools.count(1)
    return lambda: b"%s-%d" % (prefix, next(counter))


async def run_exchange(incoming: Incoming, receive: Receive, answer: Answer, rt: Runtime) -> None:
    """Serve the request `incoming` (its body from `receive`) to its end (see the module's
    docstring). A cancellation from outside (the drain deadline) propagates; the client
    leaving ends it quietly with status 499."""
    record = ExchangeRecord.begin(rt.recording, incoming)
    held = Held(rt.services.bodies)
    try:
        with trio.CancelScope() as cancel:
            answer.arm(cancel)
            await _serve(incoming, receive, answer, rt, record, held)
        if cancel.cancelled_caught:  # only the client leaving cancels this scope
            record.status = CLIENT_CLOSED
    finally:
        held.release()
        record.finish()


async def _serve(
    incoming: Incoming,
    receive: Receive,
    answer: Answer,
    rt: Runtime,
    record: ExchangeRecord,
    held: Held,
) -> None:
    """Resolve, admit and route the request, and answer what its routing left to answer; the
    request leaves its tenant's limits however it ends."""
    services, server = rt.services, rt.config.server
    try:
        intake = take_in(incoming, rt, record)
        body = await read_body(
            receive,
            intake.head.content_length,
            server.max_body_bytes,
            stall_s=server.request_body_timeout_s,
            held=held,
        )
    except RequestError as exc:  # before the body was read: the connection cannot go on
        held.release()
        await _error(answer, record, exc, close=True)
        return
    if body is None:
        record.status = CLIENT_CLOSED  # the client left while sending
        return
    try:
        prepared = await resolve(intake, body, rt, record)
        ticket = await services.limits.admit(intake.tenant)
    except RequestError as exc:
        held.release()
        await _error(answer, record, exc)
        return
    try:
        prepared = await with_tokens(prepared, rt)
        outcome, trail = await _route_through_fallbacks(prepared, answer, rt, record)
        await _answer(outcome, trail, answer, record)
    finally:
        services.limits.leave(ticket)


async def _route_through_fallbacks(
    prepared: Prepared, answer: Answer, rt: Runtime, record: ExchangeRecord
) -> tuple[Outcome, Trail]:
    """The request routed to the model it names, then to each fallback model while the one
    before cannot take it (no engine, the queue, every engine refused): what came of it, and
    the engines of its attempts, every model's."""
    trail = Trail()
    while True:
        if rt.resume is not None and resumable(prepared) is not None:
            prepared = dataclasses.replace(prepared, body=with_token_ids(prepared))
        take = Deliver(answer, record, rt, prepared)
        outcome, trail = await _route(prepared, take, rt, record, trail)
        if not isinstance(outcome, Failed) or not outcome.fallback:
            return outcome, trail
        index = next_model(rt.services.table, prepared, prepared.index)
        if index is None:
            return outcome, trail
        if outcome.refused is not None:
            reason = "engines_refused"
        else:
            assert outcome.error is not None
            reason = _FALLBACK_REASONS.get(outcome.error.code, outcome.error.code)
        fell_back(rt, record, prepared.model, prepared.chain[index], reason, str(outcome.error))
        try:
            prepared = await with_tokens(await for_model(prepared, index, rt, record), rt)
        except RequestError as exc:
            return Failed(exc), trail


async def _route(
    prepared: Prepared, take: Deliver, rt: Runtime, record: ExchangeRecord, trail: Trail
) -> tuple[Outcome, Trail]:
    """The request to an engine of the model it names, after the attempts of `trail`: the
    engine that holds its stored response, disaggregation's steps, or the policy's choice."""
    if (pinned := prepared.pinned) is not None:
        route = Route(rt.policy, lambda roles: (pinned,))
        return await try_engines(prepared, record, rt, take, route, trail)
    if (pd := rt.disaggregation) is not None:
        return await disaggregated(prepared, record, rt, take, pd, trail)
    return await try_engines(prepared, record, rt, take, rt.route, trail)


async def _answer(outcome: Outcome, trail: Trail, answer: Answer, record: ExchangeRecord) -> None:
    """What the routing left to answer: an engine's refusal (every engine of every model
    refused, or a prefill engine's 4xx), or an error (naming the engine tried last, in
    `trail`); nothing when an engine answered, the client left, or the answer was cut (the
    client's connection then closes without its end)."""
    if isinstance(outcome, Failed) and outcome.refused is not None:
        outcome = outcome.refused
    if isinstance(outcome, Refused):
        record.engine = outcome.engine.name
        record.status = outcome.status
        answer.start(outcome.status, outcome.head)
        await answer.end(outcome.body)
        record.sent = answer.sent
    elif isinstance(outcome, Failed):
        if outcome.error is None:
            record.status = CLIENT_CLOSED
        elif outcome.cut:
            record.status = outcome.error.status
        else:
            await _error(answer, record, outcome.error, engine=trail.last)


async def _error(
    answer: Answer,
    record: ExchangeRecord,
    exc: RequestError,
    *,
    engine: str = "",
    close: bool = False,
) -> None:
    """`exc` as the client's answer (naming `engine`, the engine tried last, if any)."""
    record.status = exc.status
    if exc.refusal:
        record.refusal = exc.code
    logger.warning(
        "request %s for %s failed with %d: %s",
        record.request_id_text,
        record.model or "-",
        exc.status,
        exc,
    )
    status, headers, body = error_answer(exc, record.request_id, engine, close=close)
    answer.start(status, headers)
    await answer.end(body)
