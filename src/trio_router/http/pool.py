"""The pool of keep-alive HTTP/1.1 connections to engines, and one exchange on it.

`UpstreamPool` keeps idle connections per origin (`http://host:port`). One exchange is
`async with pool.request(...) as response:`; the block is entered once the response head has
arrived, and `async for chunk in response` yields the body as it arrives from the socket:
everything already received, de-chunked, in one piece. Nothing is buffered whole, so a slow
reader slows the engine down through TCP backpressure. (`http.whole`: a whole small GET.)

The wire format is the codec's (`http.codec`), the socket work the connection's
(`http.connection`); this module owns deadlines and reuse, and turns every failure into one
of `http.errors`:

- `EngineUnreachableError`: the request was not delivered -- connect refused or timed out, or
  the connection closed or reset before any byte of a response. A stale pooled keep-alive
  connection is retried once on a fresh connection before this is raised. The one error after
  which the request may be sent to another engine.
- `EngineTimeoutError`: the engine was silent for longer than `read_timeout` while the request
  was being sent, while the head was awaited, or between two body chunks (a stream: `stall`).
- `EngineBrokeOffError`, `MalformedResponseError`: after the request was delivered, a reset or
  early close, or an answer that is not HTTP/1.1.
- `LocalLimitError`: the router could not open a socket (file descriptors, memory).
- `InvalidRequestError`: the request cannot be written as HTTP/1.1.

An exchange stops when its task is cancelled (the client left, a deadline): leaving its
`async with` block then closes the connection, and the engine sees the close.

Timeouts are Trio cancel scopes, so a test clock and outer scopes see them.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import trio

from .codec import ProtocolError, ResponseParser, encode_request_head
from .connection import Connection, Connector, Origin, open_tcp_socket
from .errors import (
    EngineBrokeOffError,
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    LocalLimitError,
    MalformedResponseError,
    TransportError,
)
from .stall import Stall, stalled

__all__ = ["RelaySource", "UpstreamPool", "UpstreamResponse"]

CHECKPOINT_EVERY: Final = 16  # body chunks returned at once, at most, between two checkpoints
INLINE_BODY_BYTES: Final = 64 * 1024  # smaller bodies go out in the same write as the head
MAX_ORIGINS: Final = 1024  # origins remembered before those without idle connections are dropped

# Out of descriptors, buffers or memory: the router's own limits when opening a connection.
_LOCAL_LIMITS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _StaleConnectionError(Exception):
    """A connection closed or reset before any response byte: retried once, then unreachable."""


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to engines, pooled per origin.

    Runs no background task: an idle connection is checked (age, and whether the engine has
    closed it) when it is taken, and `aclose()` closes those still idle. Use it from the Trio
    thread only; its bookkeeping is synchronous, so it needs no lock.

    Args:
        connect_timeout: seconds allowed to open a TCP connection.
        read_timeout: longest silence tolerated from an engine, while sending the request,
            waiting for the head, or between two body chunks.
        max_idle_per_origin: idle connections kept per engine; more are closed on release.
        max_idle_s: an idle connection older than this is closed rather than reused. Keep it
            below the engines' keep-alive timeout (5 s for vLLM/uvicorn and Hypercorn).
        connect: opens a connected stream socket to (host, port), raising OSError; the
            default is TCP (`open_tcp_socket`). Tests pass one end of a socket pair.
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_idle_per_origin: int = 64,
        max_idle_s: float = 4.0,
        connect: Connector = open_tcp_socket,
    ) -> None:
        if connect_timeout <= 0 or read_timeout <= 0 or max_idle_s < 0:
            raise ValueError("connect_timeout and read_timeout must be > 0, max_idle_s >= 0")
        if max_idle_per_origin < 0:
            raise ValueError(f"max_idle_per_origin must be >= 0, got {max_idle_per_origin}")
        self._connect_timeout = connect_timeout
        self.read_timeout = read_timeout  # seconds of silence tolerated from an engine
        self._max_idle = max_idle_per_origin
        self._max_idle_s = max_idle_s
        self._open = connect
        self._origins: dict[str, Origin] = {}
        self._origins_cap = MAX_ORIGINS  # the size at which unused origins are swept
        self._closed = False
        self.connections_opened = 0  # total TCP connections opened; for metrics and tests

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (see `close`), with a checkpoint."""
        self.close()
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """Close every idle connection. Exchanges still running keep their connection and
        close it when they end; nothing is pooled after this. Synchronous: it completes in
        a cancelled task too."""
        self._closed = True
        for origin in self._origins.values():
            idle, origin.idle = origin.idle, []
            for conn in idle:
                conn.close_now()
        self._origins.clear()

    def sweep(self) -> int:
        """Close the idle connections the engine has closed (or that sent stray bytes) and
        those idle for longer than `max_idle_s`, so none lingers half-closed until its engine
        is used again. Returns how many were closed."""
        closed = 0
        oldest_allowed = trio.current_time() - self._max_idle_s
        for origin in self._origins.values():
            if not origin.idle:
                continue
            keep = []
            for conn in origin.idle:
                if conn.idle_since < oldest_allowed or conn.readable():
                    conn.close_now()
                    closed += 1
                else:
                    keep.append(conn)
            origin.idle = keep
        return closed

    def idle_count(self, base_url: str | None = None) -> int:
        """Idle connections for one origin, or for all."""
        if base_url is not None:
            origin = self._origins.get(base_url)
            return 0 if origin is None else len(origin.idle)
        return sum(len(o.idle) for o in self._origins.values())

    def request(
        self,
        base_url: str,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """One exchange with the engine at `base_url` (like "http://10.0.0.7:8000").

        `target` is the path with its query string. `headers` are the end-to-end headers to
        forward; Host, Content-Length and hop-by-hop headers in it are dropped and the pool
        sets Host and Content-Length itself. Entering the returned context sends the request
        and returns the `UpstreamResponse` once its head has arrived (raising the errors of
        this module's docstring). Leaving it returns the connection to the pool if the body
        was read to the end, and closes it otherwise -- also when the task is cancelled, so a
        client that goes away closes the engine's connection at once.
        """
        return UpstreamResponse(self, base_url, method, target, headers, body)

    # -- the checkout interface of an exchange (synchronous bookkeeping: no await between
    # -- a read and a write) -------------------------------------------------------------
    def origin(self, base_url: str) -> Origin:
        """The origin of `base_url`, remembered (with its idle connections) from now on."""
        origin = self._origins.get(base_url)
        if origin is None:
            if len(self._origins) >= self._origins_cap:  # engines come and go: forget
                self._origins = {k: o for k, o in self._origins.items() if o.idle}
                # Next time only after as many again: with more engines than MAX_ORIGINS
                # holding idle connections, the sweep stays amortized O(1) per origin.
                self._origins_cap = max(MAX_ORIGINS, 2 * len(self._origins))
            origin = self._origins[base_url] = Origin(base_url)
        return origin

    def checkout(self, origin: Origin) -> Connection | None:
        """Take the most recently used idle connection that still looks alive."""
        idle = origin.idle
        if not idle:
            return None
        oldest_allowed = trio.current_time() - self._max_idle_s
        while idle:
            conn = idle.pop()
            if conn.idle_since < oldest_allowed:
                # The newest idle connection is too old, so all are: the engine may be about
                # to close them (keep-alive timeout), which would cost a retry each.
                conn.close_now()
                self.discard_idle(origin)
                return None
            # Readable while idle means EOF (the engine closed it) or stray bytes: unusable.
            if conn.readable():
                conn.close_now()
                continue
            return conn
        return None

    def release(self, origin: Origin, conn: Connection) -> None:
        """Pool `conn` (its exchange ended cleanly), unless the pool is closed or full."""
        if not self._closed and len(origin.idle) < self._max_idle:
            conn.idle_since = trio.current_time()
            origin.idle.append(conn)
        else:
            conn.close_now()

    def discard_idle(self, origin: Origin) -> None:
        """Close every idle connection of `origin` (one of them was found stale)."""
        idle, origin.idle = origin.idle, []
        for conn in idle:
            conn.close_now()

    async def connect(self, origin: Origin) -> Connection:
        """A new connection to `origin`; EngineUnreachableError on refusal or timeout."""
        with trio.move_on_after(self._connect_timeout):
            try:
                raw = await self._open(origin.host, origin.port)
            except socket.gaierror as exc:
                raise EngineUnreachableError(
                    f"cannot resolve engine {origin.url}: {exc}", connect_failed=True
                ) from exc
            except OSError as exc:
                if exc.errno in _LOCAL_LIMITS:  # the router's own limit, not the engine's fault
                    raise LocalLimitError(
                        f"the router cannot open a connection to engine {origin.url} now: {exc}"
                    ) from exc
                raise EngineUnreachableError(
                    f"cannot connect to engine {origin.url}: {exc}", connect_failed=True
                ) from exc
            self.connections_opened += 1
            return Connection(trio.socket.from_stdlib_socket(raw), raw)
        raise EngineUnreachableError(
            f"cannot connect to engine {origin.url}: no answer within "
            f"{self._connect_timeout:g} s (proxy.connect_timeout_s)"
        )


@dataclass(frozen=True, slots=True)
class RelaySource:
    """The engine's side of a response handed to a relay (`UpstreamResponse.relay_source`)."""

    conn: Connection
    parser: ResponseParser
    url: str
    read_timeout: float
    stall: Stall | None = None  # the silence allowed once body bytes came (None: read_timeout)
    started: bool = False  # body bytes were handed out before the relay took over


class UpstreamResponse:
    """The engine's answer: `status`, `headers` (names lowercase, hop-by-hop ones dropped,
    Content-Length kept), and the body as an async iterator of non-empty byte chunks, each
    holding what had arrived from the socket when it was asked for.

    Iterating raises `EngineTimeoutError` after `read_timeout` of silence (once the body has
    begun, `EngineStalledError` past the `stall` bound, when one is set),
    `EngineBrokeOffError` if the connection breaks before the body is complete, and the
    error given to `break_off` once the router has given up on the engine. A chunk already in
    the socket buffer is returned without a trip through the scheduler (no checkpoint); waiting
    for one is a checkpoint, and so is every CHECKPOINT_EVERY-th chunk returned without one, so
    that a body that is always there at once (a fast engine, a fast client) neither starves
    other tasks nor delays a cancellation. Cancelling the iterating task makes the enclosing
    `async with` close the connection.
    """

    __slots__ = (
        "_base_url",
        "_body",
        "_breaker",
        "_broken",
        "_conn",
        "_done",
        "_gap",
        "_method",
        "_origin",
        "_parser",
        "_peeked",
        "_pool",
        "_req_headers",
        "_started",
        "_target",
        "_unchecked",
        "_waiting",
        "headers",
        "received_at",
        "stall",
        "status",
    )

    def __init__(
        self,
        pool: UpstreamPool,
        base_url: str,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
    ) -> None:
        self._pool = pool
        self._base_url = base_url
        self._method = method
        self._target = target
        self._req_headers = headers
        self._body = body
        self._conn: Connection | None = None
        self._origin: Origin | None = None
        self._parser: ResponseParser | None = None
        self._done = False
        self._unchecked = 0  # chunks returned since the last checkpoint
        self._started = False  # body bytes have been handed out
        # The silence allowed between two pieces of the body once it has begun (None: the
        # pool's read_timeout): a stream's stall bound, set by the caller after the head.
        self.stall: Stall | None = None
        self._gap = 0.0  # the longest wait for the engine since the body began, seconds
        self.received_at = 0.0  # when the engine's last bytes were received (Trio time)
        self._broken: TransportError | None = None  # given to break_off
        self._breaker: Callable[[TransportError], None] | None = None  # a relay's, meanwhile
        self._waiting: trio.CancelScope | None = None  # a wait for the engine's next bytes
        self._peeked: bytes | ProtocolError = b""  # what at_hand() read: the next chunk
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    # -- the exchange ------------------------------------------------------------------------
    async def __aenter__(self) -> UpstreamResponse:
        pool = self._pool
        origin = self._origin = pool.origin(self._base_url)
        try:
            head = encode_request_head(
                self._method, self._target, origin.host_header, self._req_headers, len(self._body)
            )
        except ValueError as exc:
            raise InvalidRequestError(f"cannot send request to engine {origin.url}: {exc}") from exc
        conn = pool.checkout(origin)
        if conn is not None:
            try:
                await self._exchange(conn, head)
                return self
            except _StaleConnectionError:
                # The engine closed this kept-alive connection before our request reached it
                # (keep-alive timeout, restart). Nothing was processed: retry on a fresh one.
                pool.discard_idle(origin)
        conn = await pool.connect(origin)
        try:
            await self._exchange(conn, head)
        except _StaleConnectionError as exc:
            raise EngineUnreachableError(
                f"engine {origin.url} closed the connection before answering: "
                f"{exc.__cause__ or 'EOF'}"
            ) from exc.__cause__
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, parser = self._conn, self._parser
        if conn is None or parser is None:
            return
        self._conn = None
        if not parser.done and exc_type is None:
            try:  # an unread body may already be here whole (or be empty): then it can end
                while parser.read_body():
                    pass
            except ProtocolError:
                pass
        if parser.reusable:
            assert self._origin is not None
            self._pool.release(self._origin, conn)
        else:  # partially read, failed, cancelled or not kept alive: close now
            conn.close_now()

    async def _exchange(self, conn: Connection, head: bytes) -> None:
        """Send the request on `conn` and read up to the response head. Owns `conn` until it
        returns: on any failure (or cancellation) `conn` is closed before the error leaves."""
        assert self._origin is not None
        url = self._origin.url
        parser = ResponseParser(head_request=self._method == b"HEAD")
        read_timeout = self._pool.read_timeout
        ok = False
        try:
            body = self._body
            try:
                if len(body) <= INLINE_BODY_BYTES:
                    sent = await conn.send_all(head + body if body else head, read_timeout)
                else:
                    sent = await conn.send_all(head, read_timeout) and await conn.send_all(
                        body, read_timeout
                    )
            except OSError as exc:
                raise _StaleConnectionError from exc
            if not sent:
                raise EngineTimeoutError(
                    f"engine {url} stopped taking the request for {read_timeout:g} s "
                    "(proxy.read_timeout_s)"
                )
            received = False
            while True:
                data = None
                try:
                    with trio.move_on_after(read_timeout):
                        data = await conn.recv()
                except OSError as exc:
                    if not received:
                        raise _StaleConnectionError from exc
                    raise EngineBrokeOffError(
                        f"engine {url} reset the connection while sending the response head: {exc}"
                    ) from exc
                if data is None:
                    raise EngineTimeoutError(
                        f"engine {url} sent no response within {read_timeout:g} s "
                        "(proxy.read_timeout_s)"
                    )
                if not data:
                    if not received:
                        raise _StaleConnectionError
                    raise EngineBrokeOffError(
                        f"engine {url} closed the connection in the response head"
                    )
                received = True
                parser.feed(data)
                if parser.read_head():
                    break
            self.status = parser.status
            self.headers = parser.headers
            self.received_at = trio.current_time()
            self._parser = parser
            self._conn = conn
            ok = True
        except ProtocolError as exc:
            raise MalformedResponseError(f"engine {url} sent a malformed response: {exc}") from exc
        finally:
            if not ok:
                conn.close_now()

    # -- the body ----------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """The whole body has been handed out: the chunk just returned was the last one (so
        the caller can end its own response with it)."""
        return self._parser is not None and self._parser.done

    @property
    def relayable(self) -> bool:
        """The rest of the body is chunked and not over: `Relay.relay` can move it."""
        return self._conn is not None and self._parser is not None and self._parser.chunked

    def relay_source(self) -> RelaySource:
        """What a relay needs to move the rest of the body: the connection (still owned by
        this exchange, which closes or pools it when its block ends), the parser positioned
        in the body, and the engine's URL and silence budget. ValueError unless `relayable`."""
        if self._conn is None or self._parser is None or not self._parser.chunked:
            raise ValueError("only the rest of a chunked body that is not over can be relayed")
        return RelaySource(
            self._conn,
            self._parser,
            self._base_url,
            self._pool.read_timeout,
            self.stall,
            self._started,
        )

    def break_off(self, error: TransportError) -> None:
        """The router gives up on the rest of the body (its engine is going away): its reader
        gets `error` at its next clean point instead of waiting for the engine (a relay's: see
        `relayed_by`). Synchronous; the first error holds; nothing once the body is over."""
        if self._broken is not None or self._parser is None or self._parser.done:
            return
        self._broken = error
        if (breaker := self._breaker) is not None:
            breaker(error)
        elif (waiting := self._waiting) is not None:
            waiting.cancel()

    def relayed_by(self, breaker: Callable[[TransportError], None] | None) -> None:
        """A relay moves the body from now on, `breaker` taking `break_off`'s error (at once
        if it was given already); None: the relay is done."""
        self._breaker = breaker
        if breaker is not None and self._broken is not None:
            breaker(self._broken)

    def at_hand(self) -> bool:
        """The body's next chunk, or its end, is here already: the next step of the iteration
        returns (or raises) without waiting for the engine."""
        parser = self._parser
        if self._peeked:
            return True
        if self._conn is None or parser is None:
            return self._done
        try:
            self._peeked = parser.read_body()
        except ProtocolError as exc:
            self._peeked = exc  # raised by the iteration's next step
            return True
        return bool(self._peeked) or parser.done

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        parser = self._parser
        if self._conn is None or parser is None:
            if self._done:
                raise StopAsyncIteration
            raise trio.ClosedResourceError("the upstream response was already closed")
        try:
            if peeked := self._peeked:
                self._peeked = b""
                if isinstance(peeked, ProtocolError):
                    raise peeked
                self._started = True
                return peeked
            while True:
                data = parser.read_body()
                if data:
                    self._started = True
                    self._unchecked += 1
                    if self._unchecked >= CHECKPOINT_EVERY:
                        self._unchecked = 0
                        await trio.lowlevel.checkpoint()
                    return data
                if parser.done:
                    self._done = True
                    raise StopAsyncIteration
                if await self._receive(parser):
                    self._unchecked = 0
        except ProtocolError as exc:
            raise EngineBrokeOffError(
                f"engine {self._base_url} broke off the response body: {exc}"
            ) from exc

    async def _receive(self, parser: ResponseParser) -> bool:
        """Feed the parser what the socket holds, waiting for it if need be; True if it
        waited (a checkpoint)."""
        assert self._conn is not None
        conn = self._conn
        if self._broken is not None:
            raise self._broken
        waited = False
        try:
            data = conn.recv_nowait()
            if data is None:  # nothing there yet: wait, within the silence budget
                waited = True
                data = await self._wait(conn)
        except OSError as exc:
            raise EngineBrokeOffError(
                f"engine {self._base_url} reset the connection mid-response: {exc}"
            ) from exc
        self.received_at = trio.current_time()
        if data:
            parser.feed(data)
        else:
            parser.eof()
        return waited

    async def _wait(self, conn: Connection) -> bytes:
        """`conn`'s next bytes (b"" at EOF) within the silence allowed now: the read timeout
        until the body has begun, then `stall`'s bound for the longest wait so far; else
        EngineStalledError or EngineTimeoutError (`break_off`'s error when it ends the wait)."""
        stall = self.stall if self._started else None
        silence = stall.allowed(self._gap) if stall is not None else self._pool.read_timeout
        began = trio.current_time()
        with trio.move_on_after(silence) as waiting:
            self._waiting = waiting
            try:
                data = await conn.recv()
            finally:
                self._waiting = None
        if self._broken is not None:
            raise self._broken
        if waiting.cancelled_caught:
            if stall is not None:
                raise stalled(self._base_url, silence, self._gap)
            raise EngineTimeoutError(
                f"engine {self._base_url} was silent for {silence:g} s mid-response "
                "(proxy.read_timeout_s)"
            )
        if stall is not None:
            self._gap = max(self._gap, trio.current_time() - began)
        return data
