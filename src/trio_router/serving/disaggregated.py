"""A request in two steps, prefill then decode, when `[disaggregation]` is enabled and it pays
off (`routing.disaggregation` holds the rules and the bodies): the decode engine chosen (its
slot held), the prompt prefilled on a prefill engine under `prefill_timeout_s`, then the
client's request with the prefill engine's `kv_transfer_params` to the decode engine, whose
answer is the client's. Otherwise, or when the prefill step fails, one engine serves it
whole. Both steps are attempts (`attempt.attempt`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import trio

from ..routing.disaggregation import (
    MAX_PREFILL_ANSWER_BYTES,
    Disaggregation,
    Roles,
    decode_body,
    prefill_body,
    transfer_params,
)
from ..routing.route import Route
from ..table import Engine
from .attempt import Answered, Failed, Outcome, ReadAnswer, Refused, Take, Unreachable, attempt
from .failover import choose, try_engines
from .prepared import Prepared
from .record import ExchangeRecord
from .resume import resumable
from .runtime import Runtime

__all__ = ["disaggregated"]

logger = logging.getLogger(__name__)


def _whole(roles: Roles) -> Sequence[Engine]:
    return roles.whole


def _decode(roles: Roles) -> Sequence[Engine]:
    return roles.decode


def _prefill(roles: Roles) -> Sequence[Engine]:
    return roles.prefill


async def disaggregated(
    prepared: Prepared, record: ExchangeRecord, rt: Runtime, take: Take, pd: Disaggregation
) -> Outcome:
    """The request in two steps, or whole (see the module's docstring); `take` passes the
    answer to the client. A prefill engine's 4xx is the client's answer (`Refused`)."""
    metrics = rt.services.metrics
    roles = Roles.of(rt.services.table.routable(prepared.model))
    if (reason := pd.skip_reason(prepared.path, prepared.payload, roles)) is not None:
        metrics.pd_decision("direct", reason)
        return await try_engines(prepared, record, rt, take, Route(rt.policy, _whole))
    decode_route = Route(pd.decode_policy, _decode)
    decode = await choose(prepared, record, rt, decode_route)
    if isinstance(decode, Failed):
        return decode
    try:
        tokens = prepared.info.tokens
        if tokens is not None and pd.holds_most(decode, tokens):
            reason = "cached_on_decode"
        elif not [e for e in roles.prefill if e.uid != decode.uid]:
            reason = "same_engine"
        if reason is not None:
            metrics.pd_decision("direct", reason)
            body: bytes | bytearray | Refused | Failed = prepared.body
        else:
            metrics.pd_decision("disaggregated", "")
            body = await _prefilled(prepared, record, rt, pd, decode)
    except BaseException:
        rt.services.admission.release(decode, prepared.urgency.priority)
        raise
    if isinstance(body, (Refused, Failed)):  # a prefill engine's 4xx; the deadline passed
        rt.services.admission.release(decode, prepared.urgency.priority)
        return body
    return await try_engines(prepared, record, rt, take, decode_route, first=decode, body=body)


async def _prefilled(
    prepared: Prepared, record: ExchangeRecord, rt: Runtime, pd: Disaggregation, decode: Engine
) -> bytes | bytearray | Refused | Failed:
    """The prefill step on a prefill engine other than `decode`, under
    `disaggregation.prefill_timeout_s`. Returns the decode engine's body: the client's with
    the prefill engine's parameters, or the request's own when the decode engine must prefill
    itself (no prefill engine free, the step failed, or its answer had no parameters; each
    counted as a fallback); or the prefill engine's 4xx answer (`Refused`), the client's; or
    `Failed` when the request's first-token deadline passed while it waited for a prefill
    engine (no engine is to see it). The step is never shed: with no prefill engine free, the
    decode engine prefills."""
    metrics, timeout = rt.services.metrics, pd.config.prefill_timeout_s
    body = prefill_body(prepared.payload)  # before a slot is held: nothing here to give back
    engine: Engine | Failed | None = None
    urgency = prepared.urgency
    sheddable_below = rt.config.admission.sheddable_below
    if urgency.priority < sheddable_below:
        prepared = dataclasses.replace(prepared, urgency=urgency._replace(priority=sheddable_below))
    with trio.move_on_after(timeout):  # the wait for a prefill engine
        route = Route(pd.prefill_policy, _prefill, phase="prefill")
        engine = await choose(prepared, record, rt, route, [decode.uid])
    error = engine.error if isinstance(engine, Failed) else None
    if error is not None and error.code == "deadline_exceeded":
        return Failed(error)
    if not isinstance(engine, Engine):
        why = f"none free within {timeout:g}s" if engine is None else str(engine.error)
        logger.info(
            "request %s for %s: no prefill engine (%s); engine %s prefills itself",
            record.request_id_text,
            prepared.model,
            why,
            decode.name,
        )
        metrics.pd_fallback("no_prefill_engine")
        return prepared.body
    generation, started = engine.generation, trio.current_time()
    outcome: Outcome | None = None
    take = ReadAnswer(MAX_PREFILL_ANSWER_BYTES, "prefill engine")
    try:
        with trio.move_on_after(timeout):  # the step's own: a wait in the queue is not its fault
            outcome = await attempt(
                engine, prepared, record, rt, take=take, body=body, prefill=True
            )
    finally:
        metrics.pd_prefill(trio.current_time() - started)
    if outcome is None:
        failure, reason = f"no answer within {timeout:g}s", "prefill_timeout"
        rt.services.outliers.request_failed(engine, generation, f"prefill: {failure}")
    elif isinstance(outcome, Answered):
        if 400 <= outcome.status < 500:  # the request's fault: the client's answer
            record.engine = engine.name
            metrics.pd_fallback("prefill_refused")
            return Refused(engine, outcome.status, outcome.headers, outcome.body)
        if outcome.status != 200:
            failure, reason = f"answered {outcome.status}", "prefill_status"
        elif (params := transfer_params(outcome.body)) is None:
            failure, reason = "no kv_transfer_params in its answer", "missing_params"
        else:
            rt.services.outliers.request_succeeded(engine)
            record.prefill_engine = engine.name
            payload = prepared.payload
            if rt.resume is not None and resumable(prepared) is not None:
                payload = {**payload, "return_token_ids": True}  # carried on if it fails
            return decode_body(payload, params)
    elif isinstance(outcome, Unreachable):
        failure, reason = str(outcome.error), "prefill_unreachable"
    else:
        assert isinstance(outcome, Failed)  # a prefill step is never refused
        failure, reason = str(outcome.error), "prefill_error"
    logger.warning(
        "request %s for %s: prefill on engine %s failed (%s); engine %s prefills itself",
        record.request_id_text,
        prepared.model,
        engine.name,
        failure,
        decode.name,
    )
    metrics.pd_fallback(reason)
    return prepared.body
