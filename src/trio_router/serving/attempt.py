"""One attempt at one engine: `attempt(choice, prepared, record, rt, take=...) -> Outcome`.

An attempt sends the request to the engine of a `Choice` (chosen, its admission slot held:
`failover.choose`), hands the engine's answer to `take` (the client's answer writer,
`Deliver`; or read whole, `ReadAnswer`: the prefill step), and returns what happened as a
value: `Answered`, `Refused` (a 429 or 503 read whole while a fallback model is left),
`Unreachable` (the request never reached the engine: another may be tried) or `Failed` (the
engine failed after it had the request: before any byte reached the client, `error` is the
client's answer; after, the client's answer is cut). Inside it, however it ends: the
attempt's trace span, the engine's figures (with the time the take saw the answer's first
bytes) and outlier reports, and the admission slot given back.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import trio

from ..errors import RequestError
from ..http import (
    ClientGoneError,
    EngineBrokeOffError,
    EngineLeavingError,
    EngineStalledError,
    EngineTimeoutError,
    EngineUnreachableError,
    LocalLimitError,
    MalformedResponseError,
    TransportError,
    UpstreamResponse,
    read_whole,
)
from ..table import Engine
from .errors import (
    ENGINE_HEADER,
    MODEL_HEADER,
    PREFILL_ENGINE_HEADER,
    REQUEST_ID_HEADER,
    from_transport,
    http_date,
)
from .prepared import Prepared
from .record import ExchangeRecord
from .resume import EngineErrorAnswerError, StreamAbortedError
from .runtime import Runtime
from .stored import new_response_id, with_request_id

__all__ = [
    "MAX_REFUSAL_BYTES",
    "Answered",
    "Choice",
    "Failed",
    "Outcome",
    "ReadAnswer",
    "Refused",
    "Take",
    "Unreachable",
    "attempt",
    "broke_reason",
    "client_head",
]

logger = logging.getLogger(__name__)

MAX_REFUSAL_BYTES: Final = 64 * 1024  # an engine's 429/503 read whole while a fallback is left
# Response headers of the engine replaced by the router's own (the pool already dropped the
# hop-by-hop ones). The engine's Date passes through, as a gateway's should; the router dates
# only the answers it makes itself, or an engine's answer that came without one.
_REPLACED: Final = frozenset(
    {ENGINE_HEADER, PREFILL_ENGINE_HEADER, MODEL_HEADER, REQUEST_ID_HEADER}
)
_USAGE: Final = re.compile(
    rb'"usage"\s*:\s*\{[^{}]*"prompt_tokens"\s*:\s*(\d+)[^{}]*'
    rb'"completion_tokens"\s*:\s*(\d+)'
)


@dataclass(frozen=True, slots=True)
class Choice:
    """The engine chosen for an attempt, its admission slot held (`failover.choose`):
    `number`, which of the request's attempts it is (0: a prefill step, not one of them);
    `prefilled_by`, the prefill engine whose work the body sent carries ("": none); for a
    streamed request whose policy timed it (kv_aware), when its first token is expected
    (`first_token`, Trio time) and who learns how far off that was (`observe_ttft`); who
    learns when the answer's first bytes reach the client (`started`, the policy's)."""

    engine: Engine
    number: int = 0
    prefilled_by: str = ""
    first_token: float | None = None
    observe_ttft: Callable[[float], None] | None = None
    started: Callable[[], None] | None = None


class Take(Protocol):
    """What an attempt does with the engine's answer: passes it to the client
    (`deliver.Deliver`), or reads it whole (`ReadAnswer`), returning what it kept; and what
    becomes of an answer its engine failed once bytes of it reached the client."""

    @property
    def committed(self) -> bool:
        """Bytes of the answer reached the client: a failure now cuts the client's answer."""
        ...

    @property
    def first_byte(self) -> float | None:
        """When the answer's first bytes passed on to the client (Trio time; None before)."""
        ...

    @property
    def complete(self) -> bool:
        """The whole answer reached the client (a stream's `[DONE]`), though the engine's
        body may not have ended: a client may leave now without losing anything."""
        ...

    async def __call__(self, response: UpstreamResponse, choice: Choice) -> bytes: ...

    def continuation(self) -> Prepared | None:
        """The request that carries a cut answer on at another engine (`resume`), or None."""
        ...

    @property
    def kind(self) -> str:
        """What the answer is, as resumes are counted: "whole" (read whole), or a stream's
        "content", "reasoning" or "tool_call" (what had passed of it)."""
        ...

    async def give_up(self, failed: Failed) -> None:
        """No engine carries the cut answer on: end it as well as it can be."""
        ...


@dataclass(frozen=True, slots=True)
class Answered:
    """The engine answered, and `take` had its answer (`body`: what it kept of it)."""

    engine: Engine
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine answered 429 or 503 while a fallback model is left, read whole: the
    client's answer if no fallback model takes the request (`head`: its headers as the
    client gets them, `client_head`)."""

    engine: Engine
    status: int
    head: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Unreachable:
    """The request never reached the engine: another engine may have it."""

    engine: Engine
    error: EngineUnreachableError


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed. `error`: the client's answer, or with `cut` the failure of an
    answer that had begun (the client's connection is cut, the error's status counted);
    None when the client left. `fallback`: a fallback model may take the request (no
    engine, the queue), and `refused` is then the answer if none does. `broke`: why an engine
    that had the request broke it off before anything reached the client ("reset",
    "closed", "malformed"): another engine may take it whole."""

    error: RequestError | None
    cut: bool = False
    fallback: bool = False
    refused: Refused | None = None
    broke: str = ""  # the engine had the request and failed it unanswered: why (see below)


Outcome = Answered | Refused | Unreachable | Failed


async def attempt(
    choice: Choice,
    prepared: Prepared,
    record: ExchangeRecord,
    rt: Runtime,
    *,
    take: Take,
    body: bytes | bytearray | None = None,
    prefill: bool = False,
) -> Outcome:
    """One attempt at the chosen engine (its admission slot held; given back here):
    `prepared` sent (with `body` instead of its own, if given), the answer handed to `take`
    (see the module's docstring). `prefill`: the prefill step of a disaggregated request (any
    answer but 200 or a 4xx fails the engine, a 200 is left for the step to judge, a 429 or
    503 is never a refusal, and an unreachable engine is not counted as a request's).
    Cancellation propagates, the slot given back and the span ended."""
    services, tracing, engine = rt.services, rt.services.tracing, choice.engine
    headers, span = prepared.headers, None
    if record.span is not None and tracing is not None:
        span, headers = tracing.start_attempt(
            record.span, engine.name, engine.url, choice.number, prepared.target, headers
        )
    if body is None:
        body = prepared.body
        if prepared.name_responses:
            body = with_request_id(body, new_response_id(engine))
    generation, status = engine.generation, None
    failure: str | None = "cancelled"
    sent_at = trio.current_time()
    try:
        async with rt.pool.request(
            engine.url, prepared.method, prepared.target, headers, body
        ) as response:
            status = response.status
            if prepared.refusable and status in (429, 503) and not prefill:
                refused = await _refusal(response, choice, prepared, record, rt, generation)
                failure = None
                return refused
            kept = await take(response, choice)
        failure = None
        first_byte = take.first_byte
        _answered(engine, generation, status, record, rt, first_byte=first_byte, prefill=prefill)
        # The engine's own time to a first byte, for deadlines (not the queue's, nor taken
        # when an engine before this one sent the answer's first bytes).
        if status == 200 and first_byte is not None and first_byte >= sent_at and not prefill:
            services.admission.first_token(prepared.model, first_byte - sent_at)
        return Answered(engine, status, response.headers, kept)
    except EngineUnreachableError as exc:
        failure = str(exc)
        services.outliers.report_unreachable(
            engine, generation, failure, refused=exc.connect_failed
        )
        if not prefill:
            services.metrics.engine_unreachable(engine.name)
        return Unreachable(engine, exc)
    except TransportError as exc:
        failure = str(exc)
        failed = _broken(engine, generation, exc, record, rt, take=take, prefill=prefill)
        if failed.cut:
            logger.log(
                logging.INFO if failed.broke == "leaving" else logging.WARNING,  # planned
                "request %s for %s on engine %s broke off mid-response: %s",
                record.request_id_text,
                prepared.model,
                engine.name,
                exc,
            )
        return failed
    finally:
        services.admission.release(engine, prepared.urgency.priority)
        if span is not None and tracing is not None:
            tracing.end_attempt(span, status=status, error=failure)


async def _refusal(
    response: UpstreamResponse,
    choice: Choice,
    prepared: Prepared,
    record: ExchangeRecord,
    rt: Runtime,
    generation: int,
) -> Refused:
    """The engine's 429 or 503 while a fallback model is left, read whole."""
    engine, status = choice.engine, response.status
    what = f"engine {engine.name}'s {status} answer"
    body = await read_whole(response, MAX_REFUSAL_BYTES, what)
    _answered(engine, generation, status, record, rt, first_byte=None, prefill=False)
    logger.info(
        "request %s for %s: engine %s answered %d; a fallback model is left",
        record.request_id_text,
        prepared.model,
        engine.name,
        status,
    )
    return Refused(engine, status, client_head(response.headers, choice, prepared), body)


def _answered(
    engine: Engine,
    generation: int,
    status: int,
    record: ExchangeRecord,
    rt: Runtime,
    *,
    first_byte: float | None,
    prefill: bool,
) -> None:
    """An answer came whole (its first bytes passed on at `first_byte`, if they did): the
    engine's figures and health."""
    outliers = rt.services.outliers
    if prefill:  # a 200 is judged by the step, once it has read its parameters
        if 400 <= status < 500:  # the request's fault, not the engine's
            outliers.request_succeeded(engine)
        elif status != 200:
            outliers.request_failed(engine, generation, f"prefill: answered {status}")
        return
    ttfb = None if first_byte is None else first_byte - record.started
    engine.requests.record(ttfb, trio.current_time() - record.started, ok=status < 500)
    if status >= 500 and rt.config.proxy.eject_on_5xx:
        outliers.request_failed(engine, generation, f"answered {status}")
    else:
        outliers.request_succeeded(engine)


def _broken(
    engine: Engine,
    generation: int,
    exc: TransportError,
    record: ExchangeRecord,
    rt: Runtime,
    *,
    take: Take,
    prefill: bool,
) -> Failed:
    """The attempt failed after the engine had the request (or the router could not open a
    connection, which is not the engine's fault): before any byte of the answer reached the
    client (`take.committed`), the error is the client's answer; after, the answer is cut."""
    if isinstance(exc, ClientGoneError):  # the relay found the client gone
        return Failed(None)
    if prefill:  # its answer never reaches the client
        rt.services.outliers.request_failed(engine, generation, f"prefill: {exc}")
        return Failed(from_transport(exc))
    if not isinstance(exc, LocalLimitError):  # the router's own limits: not the engine's
        first_byte = take.first_byte
        ttfb = None if first_byte is None else first_byte - record.started
        engine.requests.record(ttfb, trio.current_time() - record.started, ok=False)
        rt.services.outliers.request_failed(engine, generation, str(exc))
    return Failed(from_transport(exc), cut=take.committed, broke=broke_reason(exc))


def broke_reason(exc: TransportError) -> str:
    """Why an engine that had the request failed it, as the resume counter names it ("" for
    a failure that is not the engine's: the router's own limits, a request it cannot send)."""
    if isinstance(exc, StreamAbortedError):
        return "abort"
    if isinstance(exc, EngineErrorAnswerError):
        return "error_500"
    if isinstance(exc, EngineLeavingError):
        return "leaving"
    if isinstance(exc, EngineStalledError):
        return "stall"
    if isinstance(exc, EngineTimeoutError):
        return "timeout"
    if isinstance(exc, EngineBrokeOffError):
        return "reset" if isinstance(exc.__cause__, OSError) else "closed"
    if isinstance(exc, MalformedResponseError):
        return "malformed"
    return ""


def client_head(
    headers: list[tuple[bytes, bytes]],
    choice: Choice,
    prepared: Prepared,
    *,
    sized: bool = True,
) -> list[tuple[bytes, bytes]]:
    """The client's response headers from those of the engine `choice` names: the router's
    own replaced, a Date added when the engine sent none, the engines that served it, the
    model (`prepared`'s) and the request id. Not `sized`: the body is rewritten, its
    Content-Length left out."""
    out = []
    dated = False
    for header in headers:
        name = header[0]
        if name not in _REPLACED and (sized or name != b"content-length"):
            out.append(header)
            dated = dated or name == b"date"
    if not dated:
        out.append((b"date", http_date()))
    engine, prefill = choice.engine.name, choice.prefilled_by
    out.append((ENGINE_HEADER, engine.encode()))
    out.append((MODEL_HEADER, prepared.model.encode()))
    if prefill and prefill != engine:
        out.append((PREFILL_ENGINE_HEADER, prefill.encode()))
    out.append((REQUEST_ID_HEADER, prepared.request_id))
    return out


def usage_of(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the `usage` summary at the end of an engine's answer
    (a JSON body, or a stream's last events), if it has one."""
    found = None
    for found in _USAGE.finditer(tail):  # noqa: B007 (the last one counts)
        pass
    return (int(found.group(1)), int(found.group(2))) if found is not None else None


class ReadAnswer:
    """A `Take` that reads the answer whole (at most `max_bytes`; MalformedResponseError past
    it), for `what` (in that error's message); nothing of it reaches the client."""

    __slots__ = ("_max_bytes", "_what")
    committed = False
    complete = False
    first_byte = None
    kind = "whole"

    def __init__(self, max_bytes: int, what: str) -> None:
        self._max_bytes, self._what = max_bytes, what

    async def __call__(self, response: UpstreamResponse, choice: Choice) -> bytes:
        return await read_whole(response, self._max_bytes, f"{self._what} {choice.engine.name}")

    def continuation(self) -> Prepared | None:
        return None

    async def give_up(self, failed: Failed) -> None:
        pass
