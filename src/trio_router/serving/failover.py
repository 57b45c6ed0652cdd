"""Choosing engines and trying them in turn: `choose` (the policy's choice, through admission:
a `Choice`, an engine with its slot held, or a `Failed`) and `try_engines` (attempts until
one answers: another engine after each that cannot be reached, up to `proxy.retries` more,
and never once an engine has answered). What the request went through travels as values:
the `Trail` of engines its attempts went to (every model's: a fallback model's attempts
count after the first's), taken and returned by `try_engines`; the record only hears of it
(`ExchangeRecord.tried`, `cut`)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass

import trio

from ..errors import NoEngineError, RequestError
from ..http import EngineUnreachableError
from ..routing.disaggregation import Roles
from ..routing.request import Decision
from ..routing.route import Route
from ..table import Engine
from .attempt import Answered, Choice, Failed, Outcome, Refused, Take, Unreachable, attempt
from .errors import engine_unreachable
from .prepared import Prepared, next_model
from .record import ExchangeRecord
from .runtime import Runtime

__all__ = ["Decode", "Route", "Trail", "choose", "try_engines"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Trail:
    """The engines a request's attempts went to so far, in order (a prefill step is not an
    attempt)."""

    engines: tuple[str, ...] = ()

    @property
    def attempts(self) -> int:
        return len(self.engines)

    @property
    def last(self) -> str:
        """The engine tried last ("": none yet)."""
        return self.engines[-1] if self.engines else ""

    def then(self, choice: Choice, record: ExchangeRecord) -> Trail:
        """The trail with `choice`'s engine after it, as the record reports it."""
        record.tried(choice.engine.name)
        return Trail((*self.engines, choice.engine.name))


@dataclass(frozen=True, slots=True)
class Decode:
    """Where a disaggregated request's decode step starts: its first engine, chosen and its
    slot held (`first.prefilled_by` names the prefill engine whose work `body` carries, if
    one did), and the body sent to it and to any engine tried after it."""

    first: Choice
    body: bytes | bytearray


async def choose(
    prepared: Prepared,
    rt: Runtime,
    route: Route,
    tried: Collection[str] = (),
    unreachable: EngineUnreachableError | None = None,
    *,
    made: int = 0,
    waits: str = "room",
) -> Choice | Failed:
    """An engine for the request's next attempt (after `made` of them; a prefill step's
    engine is not one), its admission slot held; `Failed` when there is none: every engine
    tried (after `unreachable`, the last that could not be reached: a 502), or the queue full
    or its wait over (a fallback model may take the request). With no routable engine left
    for the model, it waits for one (the waiting room) when `waits` ("room"; "untried": an
    answer begun, also while every routable engine has been tried and another may come
    back; "": never) and no fallback
    model has one."""
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
            prepared.tenant,
            model,
            pick,
            tried=tried,
            urgency=prepared.urgency,
            may_wait=bool(waits) and next_model(services.table, prepared, prepared.index) is None,
            carrying_on=waits == "untried",
        )
    except NoEngineError as exc:
        if unreachable is None:
            return Failed(exc, fallback=True)
        return Failed(
            engine_unreachable(
                f"no engine for model {model!r} could be reached after {made} "
                f"attempt(s); last: {unreachable}"
            )
        )
    except RequestError as exc:  # the queue: full, shed, waited too long, past its deadline
        return Failed(exc, fallback=_falls_back(exc, prepared, rt))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "request %s for %s (tenant %r): policy %s chose %s (excluded %s): %s",
            prepared.request_id.decode(errors="replace"),
            model,
            prepared.tenant.name,
            policy.name,
            engine.name,
            list(tried),
            chosen.reason if chosen is not None else "",
        )
    if route.phase:
        services.metrics.routed(policy.name, route.phase, engine.name)
        return Choice(engine)
    services.metrics.routed(policy.name, "failover" if made else "first", engine.name)
    return _choice(engine, made + 1, chosen, streamed=prepared.payload.get("stream") is True)


def _choice(engine: Engine, number: int, chosen: Decision | None, *, streamed: bool) -> Choice:
    """Attempt `number`'s choice of `engine`, with what the policy's decision (`chosen`)
    wants to hear of its answer: when its first bytes pass on (`started`) and, for a
    streamed answer, how far off its predicted first token was (a streamed answer's first
    bytes are its first token; a whole answer's come after its last)."""
    if chosen is None:
        return Choice(engine, number)
    if chosen.predicted_ttft is None or not streamed:
        return Choice(engine, number, started=chosen.started)
    return Choice(
        engine,
        number,
        first_token=trio.current_time() + chosen.predicted_ttft,
        observe_ttft=chosen.observe_ttft,
        started=chosen.started,
    )


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
    trail: Trail,
    *,
    decode: Decode | None = None,
) -> tuple[Outcome, Trail]:
    """Attempts until one answers (see the module's docstring), each engine chosen by
    `route`, after the attempts of `trail`: what came of them, and the trail with their
    engines. `decode`, when given, is the first engine to try (its slot already held) and
    the body sent instead of the request's own. An engine's refusal (a fallback model is
    left) moves on to the next engine, and is the answer if every engine refuses. With
    `proxy.resume` on, up to `proxy.resume_attempts` times: an engine that broke the request
    off before anything reached the client hands it whole to another; one that failed an
    answer already begun hands `take.continuation()` to another, which carries it on."""
    tried: list[str] = []
    unreachable: EngineUnreachableError | None = None
    refused: Refused | None = None
    broken: Failed | None = None  # the last engine's failure that another is to make good
    broken_by = ""  # ... that engine's name
    current, retries = prepared, 0
    first, body = (decode.first, decode.body) if decode is not None else (None, None)
    prefilled_by = first.prefilled_by if first is not None else ""
    while True:
        if first is not None:
            choice, first = first, None
        else:
            waits = "room" if broken is None else "untried" if broken.cut else ""
            chosen = await choose(
                current, rt, route, tried, unreachable, made=trail.attempts, waits=waits
            )
            if isinstance(chosen, Failed):
                return await _none_left(chosen, refused, broken, take, rt, prepared), trail
            choice = chosen
            if prefilled_by:  # the next engines are sent the same decode body
                choice = dataclasses.replace(chosen, prefilled_by=prefilled_by)
            trail = trail.then(choice, record)
        engine = choice.engine
        try:
            outcome = await attempt(choice, current, record, rt, take=take, body=body)
        except trio.Cancelled:  # the client left (or the drain's deadline came) ...
            if broken is not None and take.complete:  # ... once the whole answer reached it
                _resumed(record, prepared, take, rt, (broken, broken_by, engine.name), None)
            raise
        if isinstance(outcome, Refused):  # a fallback model is left: the next engine, then it
            tried.append(engine.uid)
            refused = outcome
            continue
        if isinstance(outcome, Unreachable):
            tried.append(engine.uid)
            unreachable = outcome.error
            if len(tried) > rt.config.proxy.retries:
                return await _unreachable(outcome, current, take, broken), trail
            continue
        if not isinstance(outcome, Failed) or not outcome.broke:
            if broken is not None:
                _resumed(record, prepared, take, rt, (broken, broken_by, engine.name), outcome)
            return outcome, trail
        following = await _next_request(outcome, current, take, rt, retries)
        if following is None:
            return outcome, trail
        if outcome.cut:  # the continuation of the answer begun: its first token is out
            urgency = following.urgency._replace(deadline=math.inf)
            current, body = dataclasses.replace(following, urgency=urgency), None
            record.cut(engine.name)
        retries += 1
        tried.append(engine.uid)
        broken, broken_by = outcome, engine.name
        logger.log(
            logging.INFO if outcome.broke == "leaving" else logging.WARNING,  # planned
            "request %s for %s: engine %s failed it (%s); another engine %s",
            record.request_id_text,
            prepared.model,
            engine.name,
            outcome.error,
            "carries it on" if outcome.cut else "takes it whole",
        )


def _resumed(
    record: ExchangeRecord,
    prepared: Prepared,
    take: Take,
    rt: Runtime,
    failure: tuple[Failed, str, str],
    outcome: Outcome | None,
) -> None:
    """An answer another engine took after one failed it (`failure`: the failure, the
    failed engine, the engine that took it on), counted and logged as what came of its
    attempt there (`outcome`; None: cancelled, the client gone): "resumed" (carried on) or
    "retried" (taken whole) when the engine answered or the whole answer reached the client
    (`take.complete`), else "failed"."""
    broken, failed_by, took_on = failure
    answered = isinstance(outcome, Answered) or take.complete
    done = ("resumed" if broken.cut else "retried") if answered else "failed"
    rt.services.metrics.resumed(prepared.model, take.kind, broken.broke, done)
    logger.info(
        "request %s for %s: engine %s failed it (%s), engine %s took it on: %s",
        record.request_id_text,
        prepared.model,
        failed_by,
        broken.broke,
        took_on,
        done,
    )


async def _none_left(
    failed: Failed,
    refused: Refused | None,
    broken: Failed | None,
    take: Take,
    rt: Runtime,
    prepared: Prepared,
) -> Failed:
    """No engine is left to try (`failed`, the choice's): the failure another engine was to
    make good is the answer, its answer begun ended as well as it can be; else the refusal
    of the engines tried, if they all refused (a fallback model may take the request); else
    `failed`."""
    if broken is not None:
        await take.give_up(broken)
        rt.services.metrics.resumed(prepared.model, take.kind, broken.broke, "failed")
        return broken
    if refused is None:
        return failed
    return Failed(failed.error, fallback=failed.fallback, refused=refused)


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
        metrics.resumed(current.model, take.kind, failed.broke, "failed")
        return None
    following = take.continuation() if left else None
    if following is None:
        outcome = "failed" if not left else "not_resumable"
        metrics.resumed(current.model, take.kind, failed.broke, outcome)
        await take.give_up(failed)
    return following
