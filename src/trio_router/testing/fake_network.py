"""Engines reached over socket pairs instead of TCP, for tests on the autojump clock.

`FakeNetwork.connect` is an `UpstreamPool` connector: each connection is one end of a
`socket.socketpair()`, and the other end is served in this process by a Trio task speaking
HTTP/1.1 (h11) that asks an async handler for each answer. The handler may sleep on the Trio
clock, so probes and scrapes of slow, hanging or dripping engines take virtual time; the
router's own HTTP client, deadlines and connection reuse run for real. A socket pair hands
bytes over inside the kernel at once, so the autojump clock never jumps while a request or an
answer is on its way (a TCP connect on loopback gives no such promise).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field

import h11
import trio


@dataclass(frozen=True, slots=True)
class FakeRequest:
    host: str
    method: str
    path: str
    headers: dict[str, str]


@dataclass(slots=True)
class FakeReply:
    """An answer: `body` is sent whole with a Content-Length, or, if it is an async
    iterator, chunk by chunk (chunked encoding) as the iterator yields."""

    status: int = 200
    body: bytes | AsyncIterator[bytes] = b""
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[FakeRequest], Awaitable[FakeReply]]


class CloseConnection(Exception):
    """Raised by a handler: the connection is closed without an answer (the engine died)."""


class FakeNetwork:
    """Hosts answered by `handler`; a host for which `refuses(host)` is true refuses
    connections (and the handler should raise CloseConnection for it, as a dead engine's
    open connections end too). Use inside `async with network.open():`, which owns the
    serving tasks."""

    def __init__(
        self, handler: Handler, *, refuses: Callable[[str], bool] = lambda host: False
    ) -> None:
        self._handler, self._refuses = handler, refuses
        self._nursery: trio.Nursery | None = None
        self.connections: Counter[str] = Counter()  # connections opened, by host
        self.open_now: Counter[str] = Counter()  # connections not yet closed, by host
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Block until `predicate()` holds, re-checked whenever a connection opens or ends."""
        while not predicate():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @asynccontextmanager
    async def open(self) -> AsyncIterator[FakeNetwork]:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            yield self
            nursery.cancel_scope.cancel()

    async def connect(self, host: str, port: int) -> socket.socket:
        await trio.lowlevel.checkpoint()
        try:
            ipaddress.ip_address(host)  # the network has addresses only, and no resolver
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        if self._refuses(host):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        assert self._nursery is not None, "use the network inside `async with network.open()`"
        ours, theirs = socket.socketpair()
        self.connections[host] += 1
        self.open_now[host] += 1
        self._notify()
        self._nursery.start_soon(self._serve, host, theirs)
        return ours

    async def _serve(self, host: str, raw: socket.socket) -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                await self._answer(host, stream, conn)
            finally:
                self.open_now[host] -= 1
                self._notify()

    async def _answer(self, host: str, stream: trio.SocketStream, conn: h11.Connection) -> None:
        try:
            while (request := await _next_request(stream, conn)) is not None:
                reply: FakeReply | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_close, stream, conn, nursery.cancel_scope)
                    with suppress(CloseConnection):
                        reply = await self._handler(
                            FakeRequest(
                                host,
                                request.method.decode(),
                                request.target.decode(),
                                {k.decode(): v.decode() for k, v in request.headers},
                            )
                        )
                    nursery.cancel_scope.cancel()
                if reply is None:  # closed by the client while it waited, or by the handler
                    return
                await _send_reply(stream, conn, reply)
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return


async def _cancel_on_close(
    stream: trio.SocketStream, conn: h11.Connection, scope: trio.CancelScope
) -> None:
    """While an answer is prepared: cancel it if the client closes the connection (as an
    engine aborts the request). Bytes that come meanwhile are kept for the next request."""
    with suppress(trio.BrokenResourceError):
        while data := await stream.receive_some():
            conn.receive_data(data)
    scope.cancel()


async def _next_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The next request, its body read and dropped; None when the client closed."""
    request: h11.Request | None = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some())
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _send_reply(stream: trio.SocketStream, conn: h11.Connection, reply: FakeReply) -> None:
    headers = list(reply.headers)
    body = reply.body
    if isinstance(body, bytes):
        headers.append(("content-length", str(len(body))))
        await stream.send_all(
            conn.send(h11.Response(status_code=reply.status, headers=headers))
            + conn.send(h11.Data(data=body))
            + conn.send(h11.EndOfMessage())
        )
        return
    headers.append(("transfer-encoding", "chunked"))
    await stream.send_all(conn.send(h11.Response(status_code=reply.status, headers=headers)))
    async with aclosing(body):  # type: ignore[type-var]  # an async generator in practice
        async for chunk in body:
            await stream.send_all(conn.send(h11.Data(data=chunk)))
    await stream.send_all(conn.send(h11.EndOfMessage()))
