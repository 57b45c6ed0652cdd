"""The client's take of an engine's answer: `Deliver`, what an attempt does with the answer of
a request from a client (`attempt.Take`).

It passes the engine's answer on through the request's answer writer: its head, then its
body as it comes (the model's name echoed back as the client asked for it when an alias named
it), then the end; the usage summary at its end is counted. With `proxy.resume` on:

- an answer of a known length (a whole answer, not a stream) up to MAX_HELD_ANSWER_BYTES is
  read whole before its head goes out, so an engine failing in its middle leaves nothing at
  the client and another engine may answer instead (`failover.try_engines`); so may one
  when the engine answered 500 as vLLM does while it shuts down or once its engine core has
  died (`_GOING`);
- a stream a continuation can carry on (`resume.resumable`) is followed event by event
  (`resume.Track`); when its engine fails before its end, the answer stays open and
  `continuation()` gives the request that carries it on at another engine, whose events this
  take then writes into the same answer; an engine going away hands such a stream over at
  once, and the client's pause is timed (`handover.Handover`);
- a stream that cannot be carried on ends with an error event in its API's shape and a clean
  end (`give_up`), never a silent cut a client could take for a finished answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from functools import partial
from typing import Final

import trio

from ..errors import RequestError
from ..http import ClientGoneError, TransportError, UpstreamResponse, read_whole
from ..table import Engine
from .answer import Answer, Rewrite
from .attempt import Choice, Failed, client_head, usage_of
from .errors import error_body, from_transport
from .handover import Handover
from .names import ModelEcho
from .prepared import Prepared
from .record import ExchangeRecord
from .resume import (
    RESUMABLE_PATHS,
    EngineErrorAnswerError,
    StreamAbortedError,
    Track,
    continuation,
    not_resumable,
    resumable,
    token_limit,
)
from .resume.parsed import carry_on_parsed
from .runtime import Runtime

__all__ = ["MAX_HELD_ANSWER_BYTES", "Deliver"]

logger = logging.getLogger(__name__)

MAX_HELD_ANSWER_BYTES: Final = 16 * 1024 * 1024  # a whole answer held before it is passed on
# What vLLM's 500 answer says when the engine, not the request, is at fault: its API server
# shutting down (a new request during --shutdown-timeout's drain), or its engine core dead.
_GOING: Final = (
    b"cannot schedule new futures after shutdown",
    b"EngineCore encountered an issue",
    b"EngineDeadError",
)
_NOT_FOLLOWED: Final = nullcontext()  # the handover of a stream that is not followed


class Deliver:
    """The client's take of an engine's answer (see the module's docstring), for the request
    `prepared` (as resolved: a continuation is built from it). Of `record`, which hears what
    it reports (the answer's status, bytes and first byte), only the model the client asked
    for is read (for an alias's echo)."""

    __slots__ = (
        "_answer",
        "_echo",
        "_handover",
        "_open",
        "_prepared",
        "_record",
        "_rt",
        "_track",
        "committed",
        "first_byte",
    )

    def __init__(
        self, answer: Answer, record: ExchangeRecord, rt: Runtime, prepared: Prepared
    ) -> None:
        self._answer, self._record, self._rt, self._prepared = answer, record, rt, prepared
        self._echo = rt.names.echo(record.model, prepared.model)  # an alias's, back
        self._track: Track | None = None  # the stream followed for a continuation
        self._handover: Handover | None = None  # ... and its handover to another engine
        self._open = False  # the answer has begun and not ended
        self.committed = False  # bytes of this attempt's answer reached the client
        self.first_byte: float | None = None  # when the answer's first bytes passed on

    async def __call__(self, response: UpstreamResponse, choice: Choice) -> bytes:
        self.committed = False
        echo = self._echo
        if self._open and self._track is not None:  # an answer begun, carried on
            tail = await self._go_on(response, choice.engine, echo)
        elif self._held(response):
            tail = await self._whole(response, choice, echo)
        else:
            tail = await self._stream(response, choice, echo)
        self._record.sent = self._answer.sent
        if response.status == 200 and (usage := usage_of(tail)):
            self._rt.services.metrics.tokens(self._prepared.model, *usage)
        return b""

    async def _whole(
        self, response: UpstreamResponse, choice: Choice, echo: ModelEcho | None
    ) -> bytes:
        head = client_head(response.headers, choice, self._prepared, sized=echo is None)
        what = f"engine {choice.engine.name}"
        body = await read_whole(response, MAX_HELD_ANSWER_BYTES, what)
        if response.status == 500 and any(sign in body for sign in _GOING):
            # The engine is shutting down or its core died, and nothing reached the client:
            # another engine may answer.
            raise EngineErrorAnswerError(f"{what} answered 500: {body[:300]!r}")
        if echo is not None:
            body = echo.feed(body, final=True)
        self._begin(response.status)
        if self.first_byte is None:
            self._first(choice, trio.current_time())
        self._answer.start(response.status, head)
        await self._answer.end(body)
        self._open = False
        return body[-8192:]

    async def _stream(
        self, response: UpstreamResponse, choice: Choice, echo: ModelEcho | None
    ) -> bytes:
        answer = self._answer
        head = client_head(response.headers, choice, self._prepared, sized=echo is None)
        track = self._follow(response)
        self._begin(response.status)
        answer.start(response.status, head)
        on_first = partial(self._first, choice) if self.first_byte is None else None
        return await self._pass(response, choice.engine, _chained(track, echo), on_first)

    def _first(self, choice: Choice, now: float) -> None:
        """The answer's first bytes passed on (`now`): the time to first byte, and how far
        off the engine's predicted first token was (told to the policy that predicted it)."""
        self.first_byte = now
        self._record.first_byte(now, self._prepared.model)
        if choice.started is not None:
            choice.started()
        if choice.first_token is not None:
            error = now - choice.first_token
            self._rt.services.metrics.ttft_prediction(choice.engine.name, error)
            if choice.observe_ttft is not None:
                choice.observe_ttft(error)

    async def _go_on(
        self, response: UpstreamResponse, engine: Engine, echo: ModelEcho | None
    ) -> bytes:
        """A continuation's answer (or, when no event had passed, the whole request's),
        written into the answer it carries on."""
        track, handover = self._track, self._handover
        assert track is not None and handover is not None and self._rt.resume is not None
        on_first = handover.carrying_on()
        if track.mode == "parsed":  # the render's answer: the engine's parsers carry it on
            self.committed = True
            write: Callable[[bytes], Awaitable[None]] = self._answer.body
            if echo is not None:
                feed = echo.feed

                async def write(data: bytes) -> None:
                    await self._answer.body(feed(data, final=False))

            if on_first is not None:
                write = _timed(write, on_first)
            parsed = carry_on_parsed(
                response, engine, write, self._rt, self._prepared, track, handover.now_from
            )
            return await self._through(engine, response, parsed)
        if response.status != 200 or not _is_event_stream(response):
            raise StreamAbortedError(
                f"engine {engine.name} answered the continuation with {response.status}"
            )
        response.stall = self._rt.resume.stall
        self.committed = True
        return await self._pass(response, engine, _chained(track, echo), on_first)

    async def _pass(
        self,
        response: UpstreamResponse,
        engine: Engine,
        rewrite: Rewrite | None,
        on_first: Callable[[float], None] | None,
    ) -> bytes:
        """The body relayed into the answer, and the answer ended (see `_through`)."""
        relay = self._answer.relay(response, rewrite=rewrite, on_first=on_first)
        return await self._through(engine, response, relay)

    async def _through(
        self, engine: Engine, response: UpstreamResponse, passing: Awaitable[bytes | None]
    ) -> bytes:
        """The answer's body `passing` (which returns the end of what it read, where a usage
        summary is), and the answer ended; a failure raised with the answer left open when
        it can be carried on, else ended as well as it can be."""
        track, handover = self._track, self._handover
        tail = b""  # what the relay read last: a usage summary is there (none when it broke)
        try:
            with _NOT_FOLLOWED if handover is None else handover.passing(engine, response):
                tail = await passing or b""
            if (
                track is not None
                and not track.inert
                and (track.aborted or not (track.done or track.finish))
            ):
                raise StreamAbortedError(
                    f"engine {engine.name} ended the stream before its answer was complete"
                )
        except TransportError as exc:
            if isinstance(exc, ClientGoneError) or self.continuation_possible():
                raise
            if track is not None and track.done:  # only the body's last chunk was lost
                pass
            elif track is not None and (track.finish is not None or self._spent()):
                await self._answer.body(track.ending())  # only the end was lost
            elif _is_event_stream(response) or (track is not None and track.mode == "parsed"):
                await self._end_with_error(from_transport(exc))
                raise
            else:
                raise
        await self._answer.end()
        self._open = False
        return tail

    def _begin(self, status: int) -> None:
        self.committed = self._open = True
        self._record.status = status

    def _follow(self, response: UpstreamResponse) -> Track | None:
        """A `Track` of this stream when a continuation could carry it on."""
        prepared, resume = self._prepared, self._rt.resume
        if (
            resume is None
            or response.status != 200
            or not _is_event_stream(response)
            or (kind := resumable(prepared)) is None
        ):
            return None
        options = prepared.payload.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        show = prepared.payload.get("return_token_ids") is True
        self._track = Track(kind, show_ids=show, usage=usage)
        self._handover = Handover(self._rt, prepared.model, self.continuation_possible)
        response.stall = resume.stall
        return self._track

    def continuation_possible(self) -> bool:
        """The open answer could be carried on at another engine."""
        track = self._track
        return (
            self._open
            and track is not None
            and track.carriable(token_limit(self._prepared.payload))
        )

    def _spent(self) -> bool:
        """Every token the request allows has reached the client."""
        track = self._track
        return track is not None and track.spent(token_limit(self._prepared.payload))

    @property
    def complete(self) -> bool:
        return self._track is not None and self._track.done

    @property
    def kind(self) -> str:
        track = self._track
        if track is not None:
            return "tool_call" if track.tool_ids else "reasoning" if track.reasoned else "content"
        return "content" if self._prepared.payload.get("stream") is True else "whole"

    def continuation(self) -> Prepared | None:
        if not self._open or self._track is None:
            return None
        return continuation(self._prepared, self._track)

    async def give_up(self, failed: Failed) -> None:
        if self._open and failed.error is not None:
            await self._end_with_error(failed.error)

    async def _end_with_error(self, error: RequestError) -> None:
        """An open stream ends with an error event (an OpenAI-style error object, or
        Anthropic's for /v1/messages), not a silent cut a client could take for a finished
        answer."""
        logger.warning(
            "request %s for %s: its stream ends with an error event, not carried on (%s): %s",
            self._record.request_id_text,
            self._prepared.model,
            self._why_not(),
            error,
        )
        body = error_body(str(error), type=error.type, code=error.code)
        if self._prepared.path.startswith("/v1/messages"):
            message = json.dumps({"type": error.type, "message": str(error)})
            event = b'event: error\ndata: {"type":"error","error":%s}\n\n' % message.encode()
        else:
            event = b"data: %s\n\n" % body
        await self._answer.body(event)
        await self._answer.end()
        self._open = False

    def _why_not(self) -> str:
        """Why the open answer is not carried on at another engine."""
        prepared, track = self._prepared, self._track
        if self._rt.resume is None:
            return 'proxy.resume is "off"'
        if track is None:
            kind = RESUMABLE_PATHS.get(prepared.path)
            if kind is None:
                return f"no continuation for {prepared.path} streams"
            return not_resumable(prepared.payload, kind) or "not a stream"
        if track.inert:
            return "the engine sends no token ids"
        return "no other engine carried it on (none left to try, or proxy.resume_attempts spent)"

    def _held(self, response: UpstreamResponse) -> bool:
        """The answer is read whole before it is passed on: `proxy.resume` is on and its
        length is known (a whole answer, not a stream) and at most MAX_HELD_ANSWER_BYTES."""
        if self._rt.resume is None:
            return False
        for name, length in response.headers:  # a loop: no generator made per answer
            if name == b"content-length":
                return length.isdigit() and int(length) <= MAX_HELD_ANSWER_BYTES
        return False


def _is_event_stream(response: UpstreamResponse) -> bool:
    for name, value in response.headers:  # a loop: no generator made per answer
        if name == b"content-type" and value.startswith(b"text/event-stream"):
            return True
    return False


def _timed(
    write: Callable[[bytes], Awaitable[None]], on_first: Callable[[float], None]
) -> Callable[[bytes], Awaitable[None]]:
    """`write`, with `on_first(now)` called once, when its first bytes have gone."""
    first: list[Callable[[float], None]] = [on_first]

    async def timed(data: bytes) -> None:
        await write(data)
        if first and data:
            first.pop()(trio.current_time())

    return timed


def _chained(track: Track | None, echo: ModelEcho | None) -> Rewrite | None:
    """The rewriting of a body: the track's, then the alias's echo."""
    if echo is None:
        return None if track is None else Rewrite(track, track.framed)
    feed = echo.feed
    if track is None:
        return Rewrite(lambda piece, final: feed(piece, final=final))
    return Rewrite(lambda piece, final: feed(track(piece, final), final=final))
