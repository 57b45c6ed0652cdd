"""The upstream half of the serving path: a lean keep-alive HTTP/1.1 client for engines.

`UpstreamPool` speaks HTTP/1.1 with h11 over Trio TCP streams and keeps idle connections per
origin (`http://host:port`). One exchange is `async with pool.request(...) as response:`; the
block is entered once the response head has arrived, and the body is read chunk by chunk with
`async for chunk in response`, as the bytes arrive from the socket (no buffering, so a slow
reader slows the engine down through TCP backpressure).

Failures are translated into trio_router's errors here, and only here:

- `EngineUnreachableError` (502): the request was not delivered -- connect refused or timed out,
  or the connection was closed or reset before any byte of a response. A stale pooled
  keep-alive connection is retried once on a fresh connection before this is raised. This is
  the one error after which the request may be sent to another engine.
- `UpstreamTimeoutError` (504): the engine was silent for longer than `read_timeout` while the
  request was being sent, while the head was awaited, or between two body chunks.
- `UpstreamError` (502): anything else after the request was delivered (reset mid-body, a
  malformed response).

Timeouts are Trio cancel scopes, so a test clock and outer scopes see them.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Final
from urllib.parse import urlsplit

import h11
import trio

from .errors import UpstreamError, UpstreamTimeoutError

__all__ = ["EngineUnreachableError", "UpstreamPool", "UpstreamResponse"]

READ_SIZE: Final = 65536  # bytes asked of the socket per receive
MAX_HEAD_BYTES: Final = 64 * 1024  # largest response head accepted from an engine
CLOSE_TIMEOUT_S: Final = 1.0  # bound on closing a connection from a cancelled task
INLINE_BODY_BYTES: Final = 64 * 1024  # smaller bodies go out in the same write as the head
MAX_ORIGINS: Final = 1024  # origins remembered before those without idle connections are dropped

# Never forwarded to an engine: the pool sets Host and Content-Length itself, and hop-by-hop
# headers (RFC 9110 §7.6.1) describe the client's connection, not this one.
_REQUEST_DROP: Final = frozenset({
    b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"te",
    b"trailer", b"upgrade", b"proxy-connection", b"proxy-authorization", b"expect",
})
# Never handed back to the caller: they describe the engine's connection and framing, which
# the router's own server redoes for its client. Content-Length is end-to-end and is kept.
_RESPONSE_DROP: Final = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
    b"proxy-connection", b"proxy-authenticate",
})

_Data: Final = h11.Data
_EndOfMessage: Final = h11.EndOfMessage
_NEED_DATA: Final = h11.NEED_DATA
_DONE: Final = h11.DONE
_END: Final = h11.EndOfMessage()


class EngineUnreachableError(UpstreamError):
    """The request never reached the engine (connect failed, or the connection closed before
    any response byte); safe to send it to another engine."""


class _StaleConnectionError(Exception):
    """A connection closed or reset before any response byte: retried once, then unreachable."""


class _Connection:
    __slots__ = ("h11", "idle_since", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0

    def close_now(self) -> None:
        """Close the socket synchronously (a TCP stream's aclose does nothing more)."""
        self.stream.socket.close()

    async def aclose(self) -> None:
        """Close the socket; runs to completion even in a cancelled task, within a bound."""
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            await self.stream.aclose()


class _Origin:
    """One engine address: how to reach it and its idle connections (newest last)."""

    __slots__ = ("host", "host_header", "idle", "port", "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise EngineUnreachableError(
                f"engine URL {url!r} is not supported: expected http://host:port")
        try:
            port = parts.port or 80
        except ValueError as exc:
            raise EngineUnreachableError(f"engine URL {url!r} has a bad port: {exc}") from exc
        self.url = url
        self.host = parts.hostname
        self.port = port
        self.host_header = parts.netloc.encode("ascii")
        self.idle: list[_Connection] = []


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to engines, pooled per origin.

    Runs no background task: idle connections are checked (age, and whether the engine has
    closed them) when they are taken, and `aclose()` closes those still idle. The pool is
    used from the Trio thread only; its bookkeeping is synchronous, so it needs no lock.

    Args:
        connect_timeout: seconds allowed to open a TCP connection.
        read_timeout: longest silence tolerated from an engine, while sending the request,
            waiting for the head, or between two body chunks.
        max_idle_per_origin: idle connections kept per engine; more are closed on release.
        max_idle_s: an idle connection older than this is closed rather than reused. Keep it
            below the engines' keep-alive timeout (5 s for vLLM/uvicorn and Hypercorn).
    """

    def __init__(self, *, connect_timeout: float, read_timeout: float,
                 max_idle_per_origin: int = 64, max_idle_s: float = 4.0) -> None:
        if connect_timeout <= 0 or read_timeout <= 0 or max_idle_s < 0:
            raise ValueError("connect_timeout and read_timeout must be > 0, max_idle_s >= 0")
        if max_idle_per_origin < 0:
            raise ValueError(f"max_idle_per_origin must be >= 0, got {max_idle_per_origin}")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._max_idle = max_idle_per_origin
        self._max_idle_s = max_idle_s
        self._origins: dict[str, _Origin] = {}
        self._closed = False
        self.connections_opened = 0  # total TCP connections opened; for metrics and tests

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection. Exchanges still running keep their connection and
        close it when they end; nothing is pooled after this."""
        self._closed = True
        for origin in self._origins.values():
            idle, origin.idle = origin.idle, []
            for conn in idle:
                conn.close_now()
        self._origins.clear()
        await trio.lowlevel.checkpoint()

    def idle_count(self, base_url: str | None = None) -> int:
        """Idle connections for one origin, or for all."""
        if base_url is not None:
            origin = self._origins.get(base_url)
            return 0 if origin is None else len(origin.idle)
        return sum(len(o.idle) for o in self._origins.values())

    def request(self, base_url: str, method: bytes, target: bytes,
                headers: list[tuple[bytes, bytes]], body: bytes
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
                for older in idle:
                    older.close_now()
                idle.clear()
                return None
            # Readable while idle means EOF (the engine closed it) or stray bytes: unusable.
            if conn.stream.socket.is_readable():
                conn.close_now()
                continue
            return conn
        return None

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        """Pool `conn` if its exchange ended cleanly and it may be kept alive; else close it."""
        state = conn.h11
        if (state.our_state is _DONE and state.their_state is _DONE and not self._closed
                and len(origin.idle) < self._max_idle):
            state.start_next_cycle()
            conn.idle_since = trio.current_time()
            origin.idle.append(conn)
        else:
            conn.close_now()

    def _discard_idle(self, origin: _Origin) -> None:
        """A pooled connection turned out stale; the older idle ones are likely stale too."""
        idle, origin.idle = origin.idle, []
        for conn in idle:
            conn.close_now()

    async def _connect(self, origin: _Origin) -> _Connection:
        """A new connection to `origin`; EngineUnreachableError on refusal or timeout."""
        with trio.move_on_after(self._connect_timeout):
            try:
                stream = await trio.open_tcp_stream(origin.host, origin.port)
            except OSError as exc:
                raise EngineUnreachableError(
                    f"cannot connect to engine {origin.url}: {exc}") from exc
            self.connections_opened += 1
            return _Connection(stream)
        raise EngineUnreachableError(
            f"cannot connect to engine {origin.url}: no answer within "
            f"{self._connect_timeout:g} s (proxy.connect_timeout_s)")


class UpstreamResponse:
    """The engine's answer: `status`, `headers` (hop-by-hop ones dropped, names lowercase),
    and the body as an async iterator of chunks, each yielded as it arrives from the socket.

    Iterating raises `UpstreamTimeoutError` after `read_timeout` of silence and `UpstreamError`
    if the connection breaks before the body is complete. Cancelling the iterating task makes
    the enclosing `async with` close the connection.
    """

    __slots__ = ("_base_url", "_body", "_conn", "_done", "_method", "_origin", "_pool",
                 "_req_headers", "_target", "headers", "status")

    def __init__(self, pool: UpstreamPool, base_url: str, method: bytes, target: bytes,
                 headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self._pool = pool
        self._base_url = base_url
        self._method = method
        self._target = target
        self._req_headers = headers
        self._body = body
        self._conn: _Connection | None = None
        self._origin: _Origin | None = None
        self._done = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    # -- the exchange ------------------------------------------------------------------------
    async def __aenter__(self) -> UpstreamResponse:
        pool = self._pool
        origin = self._origin = pool._origin(self._base_url)
        request = self._build_request(origin)
        conn = pool._checkout(origin)
        if conn is not None:
            try:
                await self._exchange(conn, request)
                return self
            except _StaleConnectionError:
                # The engine closed this kept-alive connection before our request reached it
                # (keep-alive timeout, restart). Nothing was processed: retry on a fresh one.
                pool._discard_idle(origin)
        conn = await pool._connect(origin)
        try:
            await self._exchange(conn, request)
        except _StaleConnectionError as exc:
            raise EngineUnreachableError(
                f"engine {origin.url} closed the connection before answering: "
                f"{exc.__cause__ or 'EOF'}") from exc.__cause__
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if self._done or (exc_type is None and self._finish_nowait(conn)):
            assert self._origin is not None
            self._pool._release(self._origin, conn)
        else:  # partially read, failed or cancelled: the connection cannot be reused
            await conn.aclose()

    def _build_request(self, origin: _Origin) -> h11.Request:
        headers = [(b"host", origin.host_header),
                   (b"content-length", b"%d" % len(self._body))]
        connection_tokens: frozenset[bytes] = frozenset()
        for name, value in self._req_headers:
            lname = name.lower()
            if lname in _REQUEST_DROP:
                if lname == b"connection":  # headers it names are hop-by-hop too
                    connection_tokens = frozenset(
                        t.strip().lower() for t in value.split(b",")) | connection_tokens
                continue
            headers.append((name, value))
        if connection_tokens:
            headers = [h for h in headers if h[0].lower() not in connection_tokens
                       or h[0] in (b"host", b"content-length")]
        try:
            return h11.Request(method=self._method, target=self._target, headers=headers)
        except h11.LocalProtocolError as exc:
            raise UpstreamError(
                f"cannot send {self._method!r} {self._target!r} to engine {origin.url}: "
                f"{exc}") from exc

    async def _exchange(self, conn: _Connection, request: h11.Request) -> None:
        """Send the request on `conn` and read up to the response head. Owns `conn` until it
        returns: on any failure (or cancellation) `conn` is closed before the error leaves."""
        assert self._origin is not None
        url = self._origin.url
        state = conn.h11
        stream = conn.stream
        ok = False
        try:
            body = self._body
            head = state.send(request)
            assert head is not None
            if body:
                state.send_with_data_passthrough(_Data(data=body))
            state.send(_END)
            received = False
            read_timeout = self._pool._read_timeout
            with trio.move_on_after(read_timeout) as scope:
                try:
                    if len(body) <= INLINE_BODY_BYTES:
                        await stream.send_all(head + body if body else head)
                    else:
                        await stream.send_all(head)
                        await stream.send_all(body)
                except trio.BrokenResourceError as exc:
                    raise _StaleConnectionError from exc.__cause__
                while True:
                    event = state.next_event()
                    if event is _NEED_DATA:
                        try:
                            data = await stream.receive_some(READ_SIZE)
                        except trio.BrokenResourceError as exc:
                            if not received:
                                raise _StaleConnectionError from exc.__cause__
                            raise UpstreamError(
                                f"engine {url} reset the connection while sending the "
                                f"response head: {exc.__cause__ or exc}") from exc
                        if not data and not received:
                            raise _StaleConnectionError
                        received = True
                        state.receive_data(data)
                        scope.deadline = trio.current_time() + read_timeout
                        continue
                    if isinstance(event, h11.Response):
                        response = event
                        break
                    if type(event) is h11.InformationalResponse:
                        continue
                    raise UpstreamError(f"engine {url} sent an unexpected {event!r}")
            if scope.cancelled_caught:
                raise UpstreamTimeoutError(
                    f"engine {url} sent no response within {read_timeout:g} s "
                    "(proxy.read_timeout_s)")
            self.status = response.status_code
            self.headers = [(n, v) for n, v in response.headers if n not in _RESPONSE_DROP]
            self._conn = conn
            ok = True
        except h11.RemoteProtocolError as exc:
            raise UpstreamError(f"engine {url} sent a malformed response: {exc}") from exc
        finally:
            if not ok:
                await conn.aclose()

    @staticmethod
    def _finish_nowait(conn: _Connection) -> bool:
        """True if the body ends without more reading (HEAD, 204, 304, an unread empty body)."""
        try:
            return type(conn.h11.next_event()) is _EndOfMessage
        except h11.RemoteProtocolError:
            return False

    # -- the body ----------------------------------------------------------------------------
    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            if self._done:
                raise StopAsyncIteration
            raise trio.ClosedResourceError("the upstream response was already closed")
        state = conn.h11
        try:
            while True:
                event = state.next_event()
                if type(event) is _Data:
                    data = event.data
                    if data:
                        return data if type(data) is bytes else bytes(data)
                elif event is _NEED_DATA:
                    await self._receive(conn)
                elif type(event) is _EndOfMessage:
                    self._done = True
                    raise StopAsyncIteration
                else:
                    raise UpstreamError(f"engine {self._base_url} sent an unexpected {event!r}")
        except h11.RemoteProtocolError as exc:
            raise UpstreamError(
                f"engine {self._base_url} broke off the response body: {exc}") from exc

    async def _receive(self, conn: _Connection) -> None:
        read_timeout = self._pool._read_timeout
        with trio.move_on_after(read_timeout):
            try:
                data = await conn.stream.receive_some(READ_SIZE)
            except trio.BrokenResourceError as exc:
                raise UpstreamError(
                    f"engine {self._base_url} reset the connection mid-response: "
                    f"{exc.__cause__ or exc}") from exc
            conn.h11.receive_data(data)  # b"" is EOF: h11 decides if the body was complete
            return
        raise UpstreamTimeoutError(
            f"engine {self._base_url} was silent for {read_timeout:g} s mid-response "
            "(proxy.read_timeout_s)")
