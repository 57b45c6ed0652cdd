"""The upstream half of the serving path: a lean keep-alive HTTP/1.1 client for engines.

`UpstreamPool` speaks HTTP/1.1 over non-blocking TCP sockets driven by Trio, and keeps idle
connections per origin (`http://host:port`). One exchange is
`async with pool.request(...) as response:`; the block is entered once the response head has
arrived, and `async for chunk in response` yields the body as it arrives from the socket:
everything already received, de-chunked, in one piece. Nothing is buffered whole, so a slow
reader slows the engine down through TCP backpressure.

The wire format is the codec's (`trio_router.http11`); this module owns the sockets,
deadlines, reuse and the mapping of every failure to the router's errors.

Failures are translated into trio_router's errors here, and only here:

- `EngineUnreachableError` (502): the request was not delivered -- connect refused or timed out,
  or the connection was closed or reset before any byte of a response. A stale pooled
  keep-alive connection is retried once on a fresh connection before this is raised. This is
  the one error after which the request may be sent to another engine.
- `UpstreamTimeoutError` (504): the engine was silent for longer than `read_timeout` while the
  request was being sent, while the head was awaited, or between two body chunks.
- `UpstreamError` (502): anything else after the request was delivered (reset mid-body, a
  malformed response).

The caller may pass a `client_gone` check: it is asked before every wait for the engine and
every CLIENT_CHECK_S while waiting, and when it reports that the client left, the exchange
stops with `ClientGoneError` and its connection is closed (the engine sees the close). That
needs no extra task per request.

Timeouts are Trio cancel scopes, so a test clock and outer scopes see them.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from types import TracebackType
from typing import Final, Protocol
from urllib.parse import urlsplit

import trio

from .errors import OverloadedError, UpstreamError, UpstreamTimeoutError
from .http11 import TARGET_CHARS, ProtocolError, ResponseParser, encode_request_head

logger = logging.getLogger(__name__)

__all__ = [
    "ClientGoneError",
    "EngineUnreachableError",
    "Relay",
    "RelayTarget",
    "UpstreamPool",
    "UpstreamResponse",
    "fetch",
    "open_relay",
]

READ_SIZE: Final = 65536  # bytes asked of the socket per receive
CHECKPOINT_EVERY: Final = 16  # body chunks returned at once, at most, between two checkpoints
CLIENT_CHECK_S: Final = 0.25  # how often a long wait for the engine asks `client_gone`
INLINE_BODY_BYTES: Final = 64 * 1024  # smaller bodies go out in the same write as the head
MAX_ORIGINS: Final = 1024  # origins remembered before those without idle connections are dropped


class EngineUnreachableError(UpstreamError):
    """The request never reached the engine (connect failed, or the connection closed before
    any response byte); safe to send it to another engine. `connect_failed`: no connection
    could be opened at all (refused, unreachable, unresolvable)."""

    def __init__(self, message: str, *, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class ClientGoneError(Exception):
    """The caller's `client_gone` check said the client left: the exchange was dropped and
    its connection closed."""


# Out of descriptors, buffers or memory: the router's own limits when opening a connection.
_LOCAL_LIMITS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# Opens a connected stream socket to (host, port); raises OSError.
Connector = Callable[[str, int], Awaitable[socket.socket]]


class _StaleConnectionError(Exception):
    """A connection closed or reset before any response byte: retried once, then unreachable."""


class _Connection:
    """One TCP connection with exactly one user at a time.

    I/O is tried synchronously on the non-blocking socket first and waits on Trio
    (`wait_readable`/`wait_writable`) only when it would block: a receive that finds data
    already there costs no trip through the scheduler, which is most of the CPU of a small
    exchange. The waits are checkpoints, so cancellation and deadlines apply to them.
    """

    __slots__ = ("idle_since", "raw", "sock")

    def __init__(self, sock: trio.socket.SocketType, raw: socket.socket) -> None:
        self.sock = sock  # the Trio socket: closing it wakes any task waiting on it
        self.raw = raw  # the same socket, for synchronous non-blocking calls
        self.idle_since = 0.0

    async def send_all(self, data: bytes | bytearray, stall_s: float) -> bool:
        """Send all of `data`, waiting at most `stall_s` at a time for the socket to take more
        (a budget of silence, not of the whole send); False if it stalled that long. OSError
        if the connection is broken."""
        raw = self.raw
        try:
            sent = raw.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            with trio.move_on_after(stall_s) as scope, memoryview(data) as view:
                while sent < len(data):
                    await trio.lowlevel.wait_writable(raw)
                    with suppress(BlockingIOError):
                        sent += raw.send(view[sent:])
                    scope.deadline = trio.current_time() + stall_s
            return not scope.cancelled_caught
        return True

    def recv_nowait(self) -> bytes | None:
        """What the socket holds now (b"" at EOF), or None if nothing is there yet."""
        try:
            return self.raw.recv(READ_SIZE)
        except BlockingIOError:
            return None

    async def recv(self) -> bytes:
        """Wait for data (b"" at EOF); OSError if the connection is broken."""
        while True:
            await trio.lowlevel.wait_readable(self.raw)
            try:
                return self.raw.recv(READ_SIZE)
            except BlockingIOError:
                pass

    def readable(self) -> bool:
        """Data, EOF or an error is waiting: for an idle connection, that means it cannot be
        reused. A peek (one system call) rather than a poll object per check."""
        try:
            self.raw.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def close_now(self) -> None:
        """Close the socket. Synchronous, so it also completes in a cancelled task, at once,
        with nothing to shield or bound; the engine sees the connection end (FIN, or RST if
        unread data was pending)."""
        self.sock.close()


class _Origin:
    """One engine address: how to reach it and its idle connections (newest last)."""

    __slots__ = ("host", "host_header", "idle", "port", "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        host = parts.hostname
        try:
            if parts.scheme != "http" or not host:
                raise ValueError("expected http://host:port")
            port = parts.port  # ValueError if out of range or not a number
            authority = f"[{host}]" if ":" in host else host
            if port is not None:
                authority += f":{port}"
            host_header = authority.encode("ascii")
            if host_header.translate(None, TARGET_CHARS):
                raise ValueError("bad characters in the host")
        except ValueError as exc:  # UnicodeEncodeError is one too
            raise EngineUnreachableError(f"engine URL {url!r} is not usable: {exc}") from exc
        self.url = url
        self.host = host
        self.port = port or 80
        self.host_header = host_header
        self.idle: list[_Connection] = []


async def open_tcp_socket(host: str, port: int) -> socket.socket:
    """A TCP connection to `host`:`port` (each resolved address tried in turn), as a
    non-blocking socket with TCP_NODELAY. Raises OSError (socket.gaierror if `host` does not
    resolve). Cancellation closes the socket being connected."""
    addresses = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in addresses:
        raw = socket.socket(family, kind, proto)
        sock = trio.socket.from_stdlib_socket(raw)  # makes it non-blocking
        connected = False
        try:
            await sock.connect(address)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connected = True
        except OSError as exc:
            error = exc
        finally:
            if not connected:
                sock.close()
        if connected:
            return raw
    raise error or OSError(f"no address for {host}")


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
        self._read_timeout = read_timeout
        self._max_idle = max_idle_per_origin
        self._max_idle_s = max_idle_s
        self._open = connect
        self._origins: dict[str, _Origin] = {}
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
        *,
        client_gone: Callable[[], bool] | None = None,
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """One exchange with the engine at `base_url` (like "http://10.0.0.7:8000").

        `target` is the path with its query string. `headers` are the end-to-end headers to
        forward; Host, Content-Length and hop-by-hop headers in it are dropped and the pool
        sets Host and Content-Length itself. Entering the returned context sends the request
        and returns the `UpstreamResponse` once its head has arrived (raising the errors of
        this module's docstring). Leaving it returns the connection to the pool if the body
        was read to the end, and closes it otherwise -- also when the task is cancelled, so a
        client that goes away closes the engine's connection at once. `client_gone`, if
        given, is polled while waiting for the engine (ClientGoneError when it says so).
        """
        return UpstreamResponse(self, base_url, method, target, headers, body, client_gone)

    # -- internals (synchronous bookkeeping; no await between read and write) --------------
    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            if len(self._origins) >= MAX_ORIGINS:  # engines come and go: forget unused ones
                self._origins = {k: o for k, o in self._origins.items() if o.idle}
            origin = self._origins[base_url] = _Origin(base_url)
        return origin

    def _checkout(self, origin: _Origin) -> _Connection | None:
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
                self._discard_idle(origin)
                return None
            # Readable while idle means EOF (the engine closed it) or stray bytes: unusable.
            if conn.readable():
                conn.close_now()
                continue
            return conn
        return None

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        """Pool `conn` (its exchange ended cleanly), unless the pool is closed or full."""
        if not self._closed and len(origin.idle) < self._max_idle:
            conn.idle_since = trio.current_time()
            origin.idle.append(conn)
        else:
            conn.close_now()

    def _discard_idle(self, origin: _Origin) -> None:
        idle, origin.idle = origin.idle, []
        for conn in idle:
            conn.close_now()

    async def _connect(self, origin: _Origin) -> _Connection:
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
                    raise OverloadedError(
                        f"the router cannot open a connection to engine {origin.url} now: {exc}"
                    ) from exc
                raise EngineUnreachableError(
                    f"cannot connect to engine {origin.url}: {exc}", connect_failed=True
                ) from exc
            self.connections_opened += 1
            return _Connection(trio.socket.from_stdlib_socket(raw), raw)
        raise EngineUnreachableError(
            f"cannot connect to engine {origin.url}: no answer within "
            f"{self._connect_timeout:g} s (proxy.connect_timeout_s)"
        )


class UpstreamResponse:
    """The engine's answer: `status`, `headers` (names lowercase, hop-by-hop ones dropped,
    Content-Length kept), and the body as an async iterator of non-empty byte chunks, each
    holding what had arrived from the socket when it was asked for.

    Iterating raises `UpstreamTimeoutError` after `read_timeout` of silence and `UpstreamError`
    if the connection breaks before the body is complete. A chunk that is already in the
    socket buffer is returned without a trip through the scheduler (no checkpoint); waiting
    for one is a checkpoint, and so is every CHECKPOINT_EVERY-th chunk returned without one, so
    that a body that is always there at once (a fast engine, a fast client) neither starves
    other tasks nor delays a cancellation. Cancelling the iterating task makes the enclosing
    `async with` close the connection.
    """

    __slots__ = (
        "_base_url",
        "_body",
        "_client_gone",
        "_conn",
        "_done",
        "_method",
        "_origin",
        "_parser",
        "_pool",
        "_req_headers",
        "_target",
        "_unchecked",
        "headers",
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
        client_gone: Callable[[], bool] | None = None,
    ) -> None:
        self._pool = pool
        self._client_gone = client_gone
        self._base_url = base_url
        self._method = method
        self._target = target
        self._req_headers = headers
        self._body = body
        self._conn: _Connection | None = None
        self._origin: _Origin | None = None
        self._parser: ResponseParser | None = None
        self._done = False
        self._unchecked = 0  # chunks returned since the last checkpoint
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    # -- the exchange ------------------------------------------------------------------------
    async def __aenter__(self) -> UpstreamResponse:
        pool = self._pool
        origin = self._origin = pool._origin(self._base_url)
        try:
            head = encode_request_head(
                self._method, self._target, origin.host_header, self._req_headers, len(self._body)
            )
        except ValueError as exc:
            raise UpstreamError(f"cannot send request to engine {origin.url}: {exc}") from exc
        if self._client_gone is not None and self._client_gone():
            raise ClientGoneError  # e.g. an HTTP/2 stream reset before it was sent on
        conn = pool._checkout(origin)
        if conn is not None:
            try:
                await self._exchange(conn, head)
                return self
            except _StaleConnectionError:
                # The engine closed this kept-alive connection before our request reached it
                # (keep-alive timeout, restart). Nothing was processed: retry on a fresh one.
                pool._discard_idle(origin)
        conn = await pool._connect(origin)
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
            self._pool._release(self._origin, conn)
        else:  # partially read, failed, cancelled or not kept alive: close now
            conn.close_now()

    async def _exchange(self, conn: _Connection, head: bytes) -> None:
        """Send the request on `conn` and read up to the response head. Owns `conn` until it
        returns: on any failure (or cancellation) `conn` is closed before the error leaves."""
        assert self._origin is not None
        url = self._origin.url
        parser = ResponseParser(head_request=self._method == b"HEAD")
        read_timeout = self._pool._read_timeout
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
                raise UpstreamTimeoutError(
                    f"engine {url} stopped taking the request for {read_timeout:g} s "
                    "(proxy.read_timeout_s)"
                )
            received = False
            while True:
                try:
                    data = await self._recv(conn, read_timeout)
                except OSError as exc:
                    if not received:
                        raise _StaleConnectionError from exc
                    raise UpstreamError(
                        f"engine {url} reset the connection while sending the response head: {exc}"
                    ) from exc
                if data is None:
                    raise UpstreamTimeoutError(
                        f"engine {url} sent no response within {read_timeout:g} s "
                        "(proxy.read_timeout_s)"
                    )
                if not data:
                    if not received:
                        raise _StaleConnectionError
                    raise UpstreamError(f"engine {url} closed the connection in the response head")
                received = True
                parser.feed(data)
                if parser.read_head():
                    break
            self.status = parser.status
            self.headers = parser.headers
            self._parser = parser
            self._conn = conn
            ok = True
        except ProtocolError as exc:
            raise UpstreamError(f"engine {url} sent a malformed response: {exc}") from exc
        finally:
            if not ok:
                conn.close_now()

    async def _recv(self, conn: _Connection, silence_s: float) -> bytes | None:
        """Wait for `conn`'s next bytes (b"" at EOF) through at most `silence_s` of silence;
        None if none came. The `client_gone` check, if any, is asked before waiting and every
        CLIENT_CHECK_S while waiting: ClientGoneError when it says so."""
        gone = self._client_gone
        deadline = trio.current_time() + silence_s
        while gone is None or not gone():
            with trio.move_on_at(
                deadline if gone is None else min(deadline, trio.current_time() + CLIENT_CHECK_S)
            ):
                return await conn.recv()
            if trio.current_time() >= deadline:
                return None
        raise ClientGoneError

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

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        parser = self._parser
        if self._conn is None or parser is None:
            if self._done:
                raise StopAsyncIteration
            raise trio.ClosedResourceError("the upstream response was already closed")
        try:
            while True:
                data = parser.read_body()
                if data:
                    self._unchecked += 1
                    if self._unchecked >= CHECKPOINT_EVERY:
                        self._unchecked = 0
                        if self._client_gone is not None and self._client_gone():
                            raise ClientGoneError
                        await trio.lowlevel.checkpoint()
                    return data
                if parser.done:
                    self._done = True
                    raise StopAsyncIteration
                if await self._receive(parser):
                    self._unchecked = 0
        except ProtocolError as exc:
            raise UpstreamError(
                f"engine {self._base_url} broke off the response body: {exc}"
            ) from exc

    async def _receive(self, parser: ResponseParser) -> bool:
        """Feed the parser what the socket holds, waiting for it if need be; True if it
        waited (a checkpoint)."""
        assert self._conn is not None
        conn = self._conn
        waited = False
        try:
            data = conn.recv_nowait()
            if data is None:  # nothing there yet: wait, within the silence budget
                waited = True
                read_timeout = self._pool._read_timeout
                data = await self._recv(conn, read_timeout)
                if data is None:
                    raise UpstreamTimeoutError(
                        f"engine {self._base_url} was silent for {read_timeout:g} s "
                        "mid-response (proxy.read_timeout_s)"
                    )
        except OSError as exc:
            raise UpstreamError(
                f"engine {self._base_url} reset the connection mid-response: {exc}"
            ) from exc
        if data:
            parser.feed(data)
        else:
            parser.eof()
        return waited


async def fetch(
    pool: UpstreamPool,
    base_url: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    max_bytes: int,
) -> tuple[int, bytes]:
    """GET `target` from the engine at `base_url` on `pool`: the status and the whole body.

    For the router's own small requests to an engine (health probes, metrics scrapes): the
    connection is kept alive for the next one when the body was read to its end. Raises this
    module's errors, and `UpstreamError` for a body larger than `max_bytes` (its connection
    is closed). Bound it with a deadline: cancellation closes the connection.
    """
    async with pool.request(base_url, b"GET", target, headers, b"") as response:
        parts: list[bytes] = []
        size = 0
        async for chunk in response:
            size += len(chunk)
            if size > max_bytes:
                raise UpstreamError(
                    f"engine {base_url} answered {target.decode()!r} with "
                    f"more than {max_bytes} bytes"
                )
            parts.append(chunk)
        return response.status, b"".join(parts)


# -- the relay --------------------------------------------------------------------------------
class RelayTarget(Protocol):
    """Where a relayed body goes: a client connection speaking HTTP/1.1 with a chunked
    response body under way, whose socket nothing else writes to meanwhile (see
    `connection.ClientSocket`). `fileno()` is -1 once the socket is closed."""

    def fileno(self) -> int: ...


class Relay:
    """Moves the chunked bodies of engine answers to their clients, for every relayed stream
    at once, in one task: what a token stream costs per event is a `recv` from the engine and
    a `write` to the client, with nothing in between but the chunk framing check.

    An HTTP/1.1 client with a chunked response under way can take the engine's chunks as they
    are. `relay()` hands such a body over: the engine's socket joins this relay's own epoll
    set (level-triggered, registered once per stream), and when it is readable, what it holds
    is read, its chunk framing checked by the codec (`ResponseParser.read_body_framed`:
    complete chunks in h11's form pass as they came, anything else is framed anew) and written
    to the client's socket at once; the last chunk is left to the client connection's own
    codec. Every socket ready at a wake-up is served in the same pass, so a burst of events
    on many streams costs one trip through the scheduler.

    - Backpressure: when the client's socket does not take everything, the engine's socket is
      no longer read until the rest is written (the client's socket joins the set for
      writability meanwhile): at most one read of an engine's bytes is held per stream. A
      client that takes nothing for `write_timeout` ends its stream with ClientGoneError.
    - Every CLIENT_CHECK_S the relayed streams are checked: a client that left (the
      `client_gone` check) ends its stream with ClientGoneError; an engine silent for
      `read_timeout` with UpstreamTimeoutError. A write that fails (reset, closed) is a gone
      client; an engine that resets, closes early or breaks the framing ends its stream with
      UpstreamError.
    - The task that called `relay()` owns its stream: cancelling it takes the stream out of
      the set at once (and the exchange then closes the engine's connection).

    Use from the Trio thread; run it with `open_relay()`.
    """

    def __init__(self, *, write_timeout: float = math.inf) -> None:
        self.write_timeout = write_timeout  # a client taking nothing this long is dropped
        self._epoll = select.epoll()
        self._by_fd: dict[int, _Relayed] = {}  # engine sockets, and client sockets being waited on
        self._streams: set[_Relayed] = set()
        self._streams_changed = trio.Event()
        self.relayed = 0  # streams handed over in all; for metrics and tests

    def __len__(self) -> int:
        return len(self._streams)

    async def relay(
        self,
        response: UpstreamResponse,
        client: RelayTarget,
        client_gone: Callable[[], bool] | None = None,
    ) -> tuple[bytes, int]:
        """Move the rest of `response`'s body (`response.relayable`) to `client`. Returns
        when the engine's last chunk has been read and everything before it written (the
        caller then ends its response, which writes the last chunk), with the end of what
        was relayed (up to 8 KiB: where the engine's usage summary would be) and how many
        bytes were relayed. Raises
        ClientGoneError, UpstreamTimeoutError or UpstreamError (then the client's response
        cannot be ended cleanly). Cancellation takes the stream out of the relay at once."""
        stream = _Relayed(self, response, client, client_gone)
        self._streams.add(stream)
        self.relayed += 1
        self._wake_ticker()
        try:
            stream.start(trio.current_time())
            await stream.finished.wait()
        finally:
            stream.detach()
        if stream.error is not None:
            raise stream.error
        return stream.before_last[-4096:] + stream.last[-4096:], stream.sent

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve every relayed stream until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._check_forever)
            task_status.started()
            epoll, by_fd = self._epoll, self._by_fd
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                ready = epoll.poll(0)
                now = trio.current_time()
                for fd, flags in ready:
                    stream = by_fd.get(fd)
                    if stream is not None:  # None: its stream ended earlier in this pass
                        stream.ready(fd, flags, now)

    def close(self) -> None:
        """Release the epoll set (streams still relayed were ended by their owners)."""
        self._epoll.close()

    async def _check_forever(self) -> None:
        while True:
            if not self._streams:
                await self._streams_changed.wait()
            await trio.sleep(CLIENT_CHECK_S)
            now = trio.current_time()
            for stream in list(self._streams):
                stream.check(now)

    def _wake_ticker(self) -> None:
        self._streams_changed.set()
        self._streams_changed = trio.Event()


@asynccontextmanager
async def open_relay(*, write_timeout: float = math.inf) -> AsyncIterator[Relay]:
    """A running `Relay`; leaving the block stops it (streams still relayed end with their
    owners' cancellation)."""
    relay = Relay(write_timeout=write_timeout)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            yield relay
            nursery.cancel_scope.cancel()
    finally:
        relay.close()


class _Relayed:
    """One stream in a `Relay`: the engine's side (socket, parser), the client's socket, and
    the bytes read but not yet written."""

    __slots__ = (
        "_client",
        "_client_fd",
        "_client_gone",
        "_conn",
        "_engine_fd",
        "_parser",
        "_pending",
        "_read_timeout",
        "_relay",
        "_url",
        "before_last",
        "deadline",
        "error",
        "finished",
        "last",
        "sent",
        "write_deadline",
    )

    def __init__(
        self,
        relay: Relay,
        response: UpstreamResponse,
        client: RelayTarget,
        client_gone: Callable[[], bool] | None,
    ) -> None:
        if response._conn is None or response._parser is None or not response.relayable:
            raise ValueError("relay() needs a chunked response whose body is not over")
        self._relay = relay
        self._conn, self._parser = response._conn, response._parser
        self._url = response._base_url
        self._read_timeout = response._pool._read_timeout
        self._client, self._client_gone = client, client_gone
        self._engine_fd = -1
        self._client_fd = -1  # registered for writability while a write waits
        self._pending = b""
        self.deadline = math.inf  # the engine's silence budget
        self.write_deadline = math.inf  # the client's, while a write waits
        self.error: Exception | None = None
        self.finished = trio.Event()
        self.before_last = self.last = b""  # the last two pieces: where a usage summary is
        self.sent = 0  # bytes handed to the client's socket

    def start(self, now: float) -> None:
        """Watch the engine's socket, and relay what was already received."""
        self.deadline = now + self._read_timeout
        self._engine_fd = self._conn.raw.fileno()
        self._relay._epoll.register(self._engine_fd, select.EPOLLIN)
        self._relay._by_fd[self._engine_fd] = self
        self._forward(now)

    def ready(self, fd: int, flags: int, now: float) -> None:
        if fd == self._client_fd:
            self._flush(now)
            return
        try:
            data = self._conn.raw.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(
                UpstreamError(f"engine {self._url} reset the connection mid-response: {exc}")
            )
            return
        if data:
            self._parser.feed(data)
            self.deadline = now + self._read_timeout
            self._forward(now)
        else:
            self._finish(
                UpstreamError(
                    f"engine {self._url} broke off the response body: connection closed "
                    "before the end of the response body"
                )
            )

    def check(self, now: float) -> None:
        """The periodic check: a client that left, an engine silent for too long."""
        if self._client_gone is not None and self._client_gone():
            self._finish(ClientGoneError())
        elif now >= self.write_deadline:
            logger.info(
                "a client took nothing of a relayed stream for %g s; dropping it",
                self._relay.write_timeout,
            )
            self._finish(ClientGoneError())
        elif now >= self.deadline:
            self._finish(
                UpstreamTimeoutError(
                    f"engine {self._url} was silent for {self._read_timeout:g} s mid-response "
                    "(proxy.read_timeout_s)"
                )
            )

    def _forward(self, now: float) -> None:
        try:
            out = self._parser.read_body_framed()
        except ProtocolError as exc:
            self._finish(UpstreamError(f"engine {self._url} broke off the response body: {exc}"))
            return
        if out:
            self.before_last, self.last = self.last, out
            self.sent += len(out)
            self._pending = out
            self._flush(now)
        elif self._parser.done:
            self._finish(None)

    def _flush(self, now: float) -> None:
        """Write what is pending; wait for the client's socket if it does not take it all."""
        data = self._pending
        try:
            written = os.write(self._client.fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError:  # reset, broken pipe, or closed by the server (fileno() is -1)
            self._finish(ClientGoneError())
            return
        epoll = self._relay._epoll
        if written < len(data):
            self._pending = data[written:]
            self.deadline = math.inf  # the client is slow, not the engine
            if written or self.write_deadline == math.inf:
                self.write_deadline = now + self._relay.write_timeout
            if self._client_fd < 0:
                if self._engine_fd >= 0:
                    epoll.modify(self._engine_fd, 0)  # read no more until this is written
                self._client_fd = self._client.fileno()
                epoll.register(self._client_fd, select.EPOLLOUT)
                self._relay._by_fd[self._client_fd] = self
            return
        self._pending = b""
        self.write_deadline = math.inf
        if self._client_fd >= 0:
            self._unregister(self._client_fd)
            self._client_fd = -1
            if self._engine_fd >= 0:
                epoll.modify(self._engine_fd, select.EPOLLIN)
            self.deadline = now + self._read_timeout
        if self._parser.done:
            self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        if self.finished.is_set():
            return
        self.error = error
        self.detach()
        self.finished.set()

    def detach(self) -> None:
        """Leave the relay (synchronous; idempotent)."""
        for fd in (self._engine_fd, self._client_fd):
            if fd >= 0:
                self._unregister(fd)
        self._engine_fd = self._client_fd = -1
        self._relay._streams.discard(self)

    def _unregister(self, fd: int) -> None:
        relay = self._relay
        if relay._by_fd.get(fd) is self:
            del relay._by_fd[fd]
            with suppress(OSError, ValueError):  # closed meanwhile: the kernel dropped it
                relay._epoll.unregister(fd)
