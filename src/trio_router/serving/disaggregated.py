"""A request in two steps, prefill then decode, when `[disaggregation]` is enabled and it pays
off (`routing.disaggregation` holds the rules and the bodies): the decode engine chosen (its
slot held), the prompt prefilled on a prefill engine under `prefill_timeout_s`, then the
client's request with the prefill engine's `kv_transfer_params` to the decode engine, whose
answer is the client's. Otherwise, or when the prefill step fails, one engine serves it
whole. Both steps are attempts (`attempt.attempt`); what the prefill step leaves the decode
step is a value (`failover.Decode`: the decode engine, the body, the prefill engine's name)."""

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
from .attempt import (
    Answered,
    Choice,
    Failed,
    Outcome,
    ReadAnswer,
    Refused,
    Take,
    Unreachable,
    attempt,
    client_head,
)
from .failover import Decode, Trail, choose, try_engines
from .prepared import Prepared
from .record import ExchangeRecord
from .resume import resumable
from .runtime import Runtime

__all__ = ["disaggregated"]

logger = logging.getLogger(__name__)


def _never_shed(prepared: Prepared, sheddable_below: int) -> Prepared:
    """The prefill step's request: never shed (with no prefill engine free, the decode
    engine prefills), its band raised to the lowest that is not."""
    urgency = prepared.urgency
    if urgency.priority >= sheddable_below:
        return prepared
    return dataclasses.replace(prepared, urgency=urgency._replace(priority=sheddable_below))


def _whole(roles: Roles) -> Sequence[Engine]:
    return roles.whole


def _decode(roles: Roles) -> Sequence[Engine]:
    return roles.decode


def _prefill(roles: Roles) -> Sequence[Engine]:
    return roles.prefill


async def disaggregated(
    prepared: Prepared,
    record: ExchangeRecord,
    rt: Runtime,
    take: Take,
    pd: Disaggregation,
    trail: Trail,
) -> tuple[Outcome, Trail]:
    """The request in two steps, or whole (see the module's docstring), after the attempts
    of `trail`: what came of it, and the trail with the engines of its attempts; `take`
    passes the answer to the client. A prefill engine's 4xx is the client's answer
    (`Refused`)."""
    metrics = rt.services.metrics
    roles = Roles.of(rt.services.table.routable(prepared.model))
    if (reason := pd.skip_reason(prepared.path, prepared.payload, roles)) is not None:
        metrics.pd_decision("direct", reason)
        return await try_engines(prepared, record, rt, take, Route(rt.policy, _whole), trail)
    decode_route = Route(pd.decode_policy, _decode)
    chosen = await choose(prepared, rt, decode_route, made=trail.attempts)
    if isinstance(chosen, Failed):
        return chosen, trail
    trail, decode = trail.then(chosen, record), chosen.engine
    try:
        tokens = prepared.info.tokens
        if tokens is not None and pd.holds_most(decode, tokens, prepared.model):
            reason = "cached_on_decode"
        elif not [e for e in roles.prefill if e.uid != decode.uid]:
            reason = "same_engine"
        if reason is not None:
            metrics.pd_decision("direct", reason)
            step: Decode | Refused | Failed = Decode(chosen, prepared.body)
        else:
            metrics.pd_decision("disaggregated", "")
            step = await _prefilled(prepared, record, rt, pd, chosen)
    except BaseException:
        rt.services.admission.release(decode, prepared.urgency.priority)
        raise
    if isinstance(step, (Refused, Failed)):  # a prefill engine's 4xx; the deadline passed
        rt.services.admission.release(decode, prepared.urgency.priority)
        return step, trail
    return await try_engines(prepared, record, rt, take, decode_route, trail, decode=step)


async def _prefilled(
    prepared: Prepared, record: ExchangeRecord, rt: Runtime, pd: Disaggregation, chosen: Choice
) -> Decode | Refused | Failed:
    """The prefill step on a prefill engine other than the decode engine `chosen` names,
    under `disaggregation.prefill_timeout_s`. Returns where the decode step starts: the
    decode engine, with the client's body and the prefill engine's parameters (its name in
    `prefilled_by`), or the request's own body when the decode engine must prefill itself
    (no prefill engine free, the step failed, or its answer had no parameters; each counted
    as a fallback); or the prefill engine's 4xx answer (`Refused`), the client's; or `Failed`
    when the request's first-token deadline passed while it waited for a prefill engine (no
    engine is to see it)."""
    metrics, timeout = rt.services.metrics, pd.config.prefill_timeout_s
    decode, itself = chosen.engine, Decode(chosen, prepared.body)  # itself: it prefills
    body = prefill_body(prepared.payload)  # before a slot is held: nothing here to give back
    prefill: Choice | Failed | None = None
    prepared = _never_shed(prepared, rt.config.admission.sheddable_below)
    with trio.move_on_after(timeout):  # the wait for a prefill engine
        route = Route(pd.prefill_policy, _prefill, phase="prefill")
        prefill = await choose(prepared, rt, route, [decode.uid])
    error = prefill.error if isinstance(prefill, Failed) else None
    if error is not None and error.code == "deadline_exceeded":
        return Failed(error)
    if not isinstance(prefill, Choice):
        why = f"none free within {timeout:g}s" if prefill is None else str(prefill.error)
        logger.info(
            "request %s for %s: no prefill engine (%s); engine %s prefills itself",
            record.request_id_text,
            prepared.model,
            why,
            decode.name,
        )
        metrics.pd_fallback("no_prefill_engine")
        return itself
    engine = prefill.engine
    generation, started = engine.generation, trio.current_time()
    outcome: Outcome | None = None
    take = ReadAnswer(MAX_PREFILL_ANSWER_BYTES, "prefill engine")
    try:
        with trio.move_on_after(timeout):  # the step's own: a wait in the queue is not its fault
            outcome = await attempt(
                prefill, prepared, record, rt, take=take, body=body, prefill=True
            )
    finally:
        metrics.pd_prefill(trio.current_time() - started)
    if outcome is None:
        failure, reason = f"no answer within {timeout:g}s", "prefill_timeout"
        rt.services.outliers.request_failed(engine, generation, f"prefill: {failure}")
    elif isinstance(outcome, Answered):
        if 400 <= outcome.status < 500:  # the request's fault: the client's answer
            metrics.pd_fallback("prefill_refused")
            head = client_head(outcome.headers, prefill, prepared)
            return Refused(engine, outcome.status, head, outcome.body)
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
            decoded = dataclasses.replace(chosen, prefilled_by=engine.name)
            return Decode(decoded, decode_body(payload, params))
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
    return itself
