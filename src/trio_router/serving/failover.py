"""Choosing engines and trying them in turn: `choose` (the policy's choice, through admission:
an engine with a slot held, or a `Failed`) and `try_engines` (attempts until one answers:
another engine after each that cannot be reached, up to `proxy.retries` more, and never once
an engine has answered)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection

import trio

from ..errors import NoEngineError, RequestError
from ..http import EngineUnreachableError
from ..routing.disaggregation import Roles
from ..routing.request import Decision
from ..routing.route import Route
from ..table import Engine
from .attempt import Answered, Failed, Outcome, Refused, Take, Unreachable, attempt
from .errors import engine_unreachable
from .prepared import Prepared
from .record import ExchangeRecord
from .runtime import Runtime

__all__ = ["Route", "choose", "try_engines"]

logger = logging.getLogger(__name__)


async def choose(
    prepared: Prepared,
    record: ExchangeRecord,
    rt: Runtime,
    route: Route,
    tried: Collection[str] = (),
    unreachable: EngineUnreachableError | None = None,
) -> Engine | Failed:
    """An engine for the next attempt, its admission slot held; `Failed` when there is none:
    every engine tried (after `unreachable`, the last that could not be reached: a 502), or
    the queue full or its wait over (a fallback model may take the request)."""
    services, model, policy = rt.services, prepared.model, route.policy
    if route.among is not None:  # the engines the step may not go to count as tried
        routable = services.table.routable(model)
        tried = [*tried, *Roles.others(routable, route.among(Roles.of(routable)))]
    chosen: Decision | None = None  # the policy's last decision

    def pick(exclude: Collection[str]) -> Engine:
        nonlocal chosen
        decision = policy.choose(services.table.routable(model), prepared.info, exclude=exclude)
        if decision.cached_tokens is not None:
            services.metrics.kv_prediction(
                decision.engine.name, decision.cached_tokens, decision.prompt_tokens
            )
        chosen = decision
        return decision.engine

    try:
        engine = await services.admission.acquire(
            prepared.tenant, model, pick, tried=tried, urgency=prepared.urgency
        )
    except NoEngineError as exc:
        if unreachable is None:
            return Failed(exc, fallback=True)
        return Failed(
            engine_unreachable(
                f"no engine for model {model!r} could be reached after {record.attempts} "
                f"attempt(s); last: {unreachable}"
            )
        )
    except RequestError as exc:  # the queue: full, shed, waited too long, past its deadline
        return Failed(exc, fallback=_falls_back(exc, prepared, rt))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "request %s for %s (tenant %r): policy %s chose %s (excluded %s): %s",
            record.request_id_text,
            model,
            prepared.tenant.name,
            policy.name,
            engine.name,
            list(tried),
            chosen.reason if chosen is not None else "",
        )
    if route.phase:
        services.metrics.routed(policy.name, route.phase, engine.name)
        return engine
    services.metrics.routed(policy.name, "failover" if record.attempts else "first", engine.name)
    record.attempts += 1
    record.engine = engine.name
    # A streamed answer's first bytes are its first token: only there is a prediction timed
    # (a whole answer's first bytes come after its last token).
    streamed = prepared.payload.get("stream") is True
    if chosen is not None and chosen.predicted_ttft is not None and streamed:
        record.predicted_first = trio.current_time() + chosen.predicted_ttft
        record.observe_ttft = chosen.observe_ttft
    else:
        record.predicted_first = record.observe_ttft = None
    return engine


def _falls_back(exc: RequestError, prepared: Prepared, rt: Runtime) -> bool:
    """Whether a fallback model may take a request the queue refused: not past its own
    deadline, nor of a band the router sheds (`admission.sheddable_below`); a request pushed
    out of a full queue by a higher band's may."""
    if exc.code == "deadline_exceeded":
        return False
    return not (
        exc.code == "shed" and prepared.urgency.priority < rt.config.admission.sheddable_below
    )


async def try_engines(
    prepared: Prepared,
    record: ExchangeRecord,
    rt: Runtime,
    take: Take,
    route: Route,
    *,
    first: Engine | None = None,
    body: bytes | bytearray | None = None,
) -> Outcome:
    """Attempts until one answers (see the module's docstring), each engine chosen by
    `route`; `first`, when given, is the first engine to try, its slot already held; `body`
    is sent instead of the request's own. An engine's refusal (a fallback model is left)
    moves on to the next engine, and is the answer if every engine refuses. With
    `proxy.resume` on, up to `proxy.resume_attempts` times: an engine that broke the request
    off before anything reached the client hands it whole to another; one that failed an
    answer already begun hands `take.continuation()` to another, which carries it on."""
    tried: list[str] = []
    unreachable: EngineUnreachableError | None = None
    refused: Refused | None = None
    broken: Failed | None = None  # the last engine's failure that another is to make good
    current, retries = prepared, 0
    while True:
        if first is not None:
            engine, first = first, None
        else:
            chosen = await choose(current, record, rt, route, tried, unreachable)
            if isinstance(chosen, Failed):
                if broken is not None:  # no other engine: that failure is the answer
                    await take.give_up(broken)
                    rt.services.metrics.resumed(prepared.model, broken.broke, "failed")
                    return broken
                if refused is None:
                    return chosen
                return Failed(chosen.error, fallback=chosen.fallback, refused=refused)
            engine = chosen
        outcome = await attempt(engine, current, record, rt, take=take, body=body)
        if isinstance(outcome, Refused):  # a fallback model is left: the next engine, then it
            tried.append(engine.uid)
            refused = outcome
            continue
        if isinstance(outcome, Unreachable):
            tried.append(engine.uid)
            unreachable = outcome.error
            if len(tried) > rt.config.proxy.retries:
                return await _unreachable(outcome, current, take, broken)
            continue
        if not isinstance(outcome, Failed) or not outcome.broke:
            if broken is not None:
                done = "resumed" if broken.cut else "retried"
                if not isinstance(outcome, Answered):
                    done = "failed"
                rt.services.metrics.resumed(prepared.model, broken.broke, done)
            return outcome
        following = await _next_request(outcome, current, take, rt, retries)
        if following is None:
            return outcome
        if outcome.cut:  # the continuation of the answer begun: its first token is out
            urgency = following.urgency._replace(deadline=math.inf)
            current, body = dataclasses.replace(following, urgency=urgency), None
            record.cut(engine.name)
        retries += 1
        tried.append(engine.uid)
        broken = outcome
        logger.warning(
            "request %s for %s: engine %s failed it (%s); another engine %s",
            record.request_id_text,
            prepared.model,
            engine.name,
            outcome.error,
            "carries it on" if outcome.cut else "takes it whole",
        )


async def _unreachable(
    outcome: Unreachable, prepared: Prepared, take: Take, broken: Failed | None
) -> Failed:
    """The request could not reach another engine: the 502, or an answer carried on so far
    ended as well as it can be."""
    failed = Failed(
        engine_unreachable(
            f"engine {outcome.engine.name} for model {prepared.model!r} could not be "
            f"reached: {outcome.error}"
        ),
        cut=broken is not None and broken.cut,
    )
    if broken is not None:
        await take.give_up(failed)
    return failed


async def _next_request(
    failed: Failed, current: Prepared, take: Take, rt: Runtime, retries: int
) -> Prepared | None:
    """The request another engine is to take after `failed`, or None (`failed` is the
    answer, and an answer begun is ended as well as it can be): the same one when its engine
    broke it off before anything reached the client (not a silent engine: another would
    likely keep the client waiting as long), else the continuation of the answer begun."""
    resume, metrics = rt.resume, rt.services.metrics
    if resume is None:
        return None
    left = retries < resume.attempts
    if not failed.cut:
        if failed.broke in ("timeout", "stall"):
            return None
        if left:
            return current
        metrics.resumed(current.model, failed.broke, "failed")
        return None
    following = take.continuation() if left else None
    if following is None:
        metrics.resumed(current.model, failed.broke, "failed" if not left else "not_resumable")
        await take.give_up(failed)
    return following
