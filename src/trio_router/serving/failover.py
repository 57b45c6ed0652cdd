"""Choosing engines and trying them in turn: `choose` (the policy's choice, through admission:
an engine with a slot held, or a `Failed`) and `try_engines` (attempts until one answers:
another engine after each that cannot be reached, up to `proxy.retries` more, and never once
an engine has answered)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from ..errors import NoEngineError, RequestError
from ..http import EngineUnreachableError
from ..routing.disaggregation import Roles
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
    why = ""

    def pick(exclude: Collection[str]) -> Engine:
        nonlocal why
        decision = policy.choose(services.table.routable(model), prepared.info, exclude=exclude)
        if decision.cached_tokens is not None:
            services.metrics.kv_prediction(
                decision.engine.name, decision.cached_tokens, decision.prompt_tokens
            )
        why = decision.reason
        return decision.engine

    try:
        engine = await services.admission.acquire(prepared.tenant, model, pick, tried=tried)
    except NoEngineError as exc:
        if unreachable is None:
            return Failed(exc, fallback=True)
        return Failed(
            engine_unreachable(
                f"no engine for model {model!r} could be reached after {record.attempts} "
                f"attempt(s); last: {unreachable}"
            )
        )
    except RequestError as exc:  # the queue: full, or waited too long
        return Failed(exc, fallback=True)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "request %s for %s (tenant %r): policy %s chose %s (excluded %s): %s",
            record.request_id_text,
            model,
            prepared.tenant.name,
            policy.name,
            engine.name,
            list(tried),
            why,
        )
    if route.phase:
        services.metrics.routed(policy.name, route.phase, engine.name)
        return engine
    services.metrics.routed(policy.name, "failover" if record.attempts else "first", engine.name)
    record.attempts += 1
    record.engine = engine.name
    return engine


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
    moves on to the next engine, and is the answer if every engine refuses. An engine that
    fails the request before anything reached the client (`Failed.broke`) hands it to
    another, with `proxy.resume` on, up to `proxy.resume_attempts` times."""
    tried: list[str] = []
    unreachable: EngineUnreachableError | None = None
    refused: Refused | None = None
    broken: Failed | None = None  # the last engine that failed the request unanswered
    retries = 0
    while True:
        if first is not None:
            engine, first = first, None
        else:
            chosen = await choose(prepared, record, rt, route, tried, unreachable)
            if isinstance(chosen, Failed):
                if broken is not None:  # no other engine: that failure is the answer
                    rt.services.metrics.resumed(prepared.model, broken.broke, "failed")
                    return broken
                if refused is None:
                    return chosen
                return Failed(chosen.error, fallback=True, refused=refused)
            engine = chosen
        outcome = await attempt(engine, prepared, record, rt, take=take, body=body)
        if isinstance(outcome, Refused):  # a fallback model is left: the next engine, then it
            tried.append(engine.uid)
            refused = outcome
        elif isinstance(outcome, Unreachable):
            tried.append(engine.uid)
            unreachable = outcome.error
            if len(tried) > rt.config.proxy.retries:
                return Failed(
                    engine_unreachable(
                        f"engine {engine.name} for model {prepared.model!r} could not be "
                        f"reached ({len(tried)} attempt(s)): {outcome.error}"
                    )
                )
        elif isinstance(outcome, Failed) and outcome.broke and not outcome.cut:
            proxy = rt.config.proxy
            if proxy.resume != "on" or retries >= proxy.resume_attempts:
                if proxy.resume == "on":
                    rt.services.metrics.resumed(prepared.model, outcome.broke, "failed")
                return outcome
            retries += 1
            tried.append(engine.uid)
            broken = outcome
            logger.warning(
                "request %s for %s: engine %s failed it before any answer (%s); another "
                "engine takes it",
                record.request_id_text,
                prepared.model,
                engine.name,
                outcome.error,
            )
        else:
            if broken is not None:
                done = "retried" if isinstance(outcome, Answered) else "failed"
                rt.services.metrics.resumed(prepared.model, broken.broke, done)
            return outcome
