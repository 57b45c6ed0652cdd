"""trio_router's HTTP server connections: each client connection's socket, read loop, write
path and keep-alive timer, driving an HTTP protocol object through its event interface
(`ServerProtocol`: bytes in, bytes and state changes out). `hypercorn_seam` builds those
objects from Hypercorn's HTTP/1.1 and HTTP/2 protocols; nothing here knows Hypercorn.

- Writes are tried at once on the non-blocking socket and wait (in order, under a lock) only
  for what the socket did not take; an empty write is skipped. A write that makes no progress
  for `write_timeout_s` (a client that stopped reading) closes the connection, and so does
  cancelling one (the drain deadline at shutdown): a response cut mid-write cannot go on.
- One keep-alive timer task per connection, whose deadline moves: a connection idle for
  `keep_alive_s` is closed; at shutdown an idle connection is closed at once and a busy one
  after its response (the protocol does that part). It ends with the connection.
- HTTP/1.1 status lines carry their reason phrase (`HTTP/1.1 200 OK`, as vLLM's server sends
  it): the protocol writes `HTTP/1.1 200 `, which some clients and log parsers take for a
  malformed line; the connection completes the status line of each response head it writes.
- `ConnectionAnswer`, the answer writer of an HTTP/1.1 request on such a connection: a head
  goes out in one write with the body bytes that follow it at once, an answer's last bytes
  with its end, and the chunked body of an engine's answer is relayed around the protocol
  (`http.Relay`: the engine's chunks written to the client's socket as they come).
- `DrainingListener`: a burst of connections waiting in the listen backlog is accepted in one
  turn, within a bound on open connections.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, Protocol

import trio

from ..asgi import Send
from ..http import Relay, UpstreamResponse
from .answer import Answer, AsgiAnswer, Disconnect, Rewrite

__all__ = [
    "MAX_RECV",
    "ClientConnection",
    "ConnectionAnswer",
    "ConnectionSettings",
    "DrainingListener",
    "ServerProtocol",
]

logger = logging.getLogger(__name__)

MAX_RECV: Final = 1 << 16  # bytes asked of the socket per read
_PHRASES: Final = {status.value: status.phrase.encode() for status in HTTPStatus}
_STATUS_LINE: Final = b"HTTP/1.1 "


class ServerProtocol(Protocol):
    """An HTTP protocol driven by a `ClientConnection`: it is told what the client sends and
    that the connection closed, and answers through the connection's `write`, `close` and
    `idle`."""

    async def initiate(self) -> None: ...

    async def received(self, data: bytes) -> None:
        """Bytes from the client (b"": it closed its side)."""
        ...

    async def closed(self) -> None:
        """The connection is gone."""
        ...


class Terminated(Protocol):
    """Set once the server is shutting down."""

    def is_set(self) -> bool: ...

    async def wait(self) -> None: ...


# Builds the protocol of `connection`, whose request tasks run in `nursery`.
ProtocolFactory = Callable[["ClientConnection", trio.Nursery], ServerProtocol]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionSettings:
    """What every connection of one server shares."""

    terminated: Terminated
    keep_alive_s: float
    write_timeout_s: float = math.inf
    read_timeout_s: float | None = None  # None: a connection may stay silent while busy
    relay: Relay | None = None  # engine bodies relayed to HTTP/1.1 clients, when given
    slots: trio.Semaphore | None = None  # released when a connection ends (the bound)


def address_of(family: int, address: object) -> tuple[str, int] | None:
    """The (host, port) of a socket address, as ASGI scopes carry it (None: not IP)."""
    if family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
        return str(address[0]), int(address[1])
    return None


class ClientConnection:
    """One client connection (see the module's docstring). `run` serves it to its end."""

    def __init__(
        self, stream: trio.SocketStream, settings: ConnectionSettings, protocol: ProtocolFactory
    ) -> None:
        self._stream, self._settings, self._open_protocol = stream, settings, protocol
        self._socket = stream.socket  # its fileno() is -1 once closed: no reused descriptor
        self._protocol: ServerProtocol | None = None
        self._send_lock = trio.Lock()
        self._held = b""  # bytes held for the next write
        self._hold_next = False  # the next write is held too
        self._expect_head = True  # the next response head's status line is to be completed
        self._nursery: trio.Nursery | None = None  # the connection's: requests and its timer
        self._timer = trio.CancelScope()
        self._timer_running = self._timer_closed = self._idle = False
        self.client: tuple[str, int] | None = None  # the peer's address, once it runs
        self.server: tuple[str, int] | None = None

    def fileno(self) -> int:
        """The socket's descriptor, -1 once it is closed (a relay's write target)."""
        return self._socket.fileno()

    async def run(self) -> None:
        """Serve the connection to its end, however it ends (a client gone before it is
        served, a reset: OSError), its socket closed and its slot given back."""
        try:
            sock = self._socket
            self.client = address_of(sock.family, sock.getpeername())
            self.server = address_of(sock.family, sock.getsockname())
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                protocol = self._protocol = self._open_protocol(self, nursery)
                await protocol.initiate()
                await self.idle(True)
                await self._read(protocol)
        except OSError:
            pass
        finally:
            await self._close_stream()
            if self._settings.slots is not None:
                self._settings.slots.release()

    async def _read(self, protocol: ServerProtocol) -> None:
        read_timeout = self._settings.read_timeout_s
        receive_some = self._stream.receive_some
        try:
            while True:
                try:
                    if read_timeout is None:  # no cancel scope per read when unbounded
                        data = await receive_some(MAX_RECV)
                    else:
                        with trio.fail_after(read_timeout):
                            data = await receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                    break
                await protocol.received(bytes(data))
                if not data:
                    break
            await protocol.closed()
        finally:
            self._stop_timer()

    # -- what the protocol calls ---------------------------------------------------------------
    async def write(self, data: bytes) -> None:
        """Bytes for the client, in order."""
        if self._expect_head and data.startswith(_STATUS_LINE):
            data = self._phrased(data)
        if self._hold_next:  # held: it goes out with the next write
            self._hold_next = False
            self._held += data
            return
        await self._write(data)

    async def close(self) -> None:
        """The protocol ends the connection (what is held goes out if the socket takes it)."""
        self._hold_next = False
        if self._held:
            self._write_held()
        await self._close_stream()
        if self._protocol is not None:
            await self._protocol.closed()

    async def idle(self, idle: bool) -> None:
        """The connection has no request in hand from now on (`idle`), or has one."""
        self._hold_next = False
        if self._held:
            await self._write(b"")
        self._idle = idle
        if not idle:
            self._timer.deadline = math.inf  # no timeout until it is answered
            return
        self._expect_head = True
        if self._settings.terminated.is_set():
            self._timer.deadline = -math.inf  # shutting down: close an idle connection now
        else:
            self._timer.deadline = trio.current_time() + self._settings.keep_alive_s
        if not self._timer_running and not self._timer_closed and self._nursery is not None:
            self._timer_running = True
            self._nursery.start_soon(self._keep_alive)

    def answer(self, send: Send, hook: Disconnect, http_version: str) -> Answer:
        """The answer writer of a request on this connection: a `ConnectionAnswer` for
        HTTP/1.1, plain ASGI for HTTP/2 (its streams share the connection)."""
        if http_version == "1.1":
            return ConnectionAnswer(send, hook, self, self._settings.relay)
        return AsgiAnswer(send, hook)

    # -- joined writes (ConnectionAnswer) ------------------------------------------------------
    def writes_pending(self) -> bool:
        """A write is still waiting for the socket, or bytes are held for the next one:
        nothing may be written around the protocol now."""
        return self._send_lock.locked() or bool(self._held)

    def hold_next(self) -> None:
        """What the protocol writes next goes out in one write with what it writes after it."""
        self._hold_next = True

    def write_with_next(self, data: bytes) -> None:
        """`data` goes out in front of what the protocol writes next."""
        self._held += data

    # -- internals -----------------------------------------------------------------------------
    def _phrased(self, head: bytes) -> bytes:
        """A response head with its status line's reason phrase (when the protocol left it
        empty); the next head is expected after an informational one only."""
        status = head[9:12]
        if status[:1] != b"1":
            self._expect_head = False
        if head[12:15] != b" \r\n" or not status.isdigit():
            return head
        return head[:13] + _PHRASES.get(int(status), b"") + head[13:]

    async def _write(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
        if not data:
            return
        if not self._send_lock.locked():
            try:
                sent = os.write(self._socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe, or closed here (fileno() is then -1)
                await self._lost()
                return
            if sent == len(data):
                return
            data = data[sent:]
        async with self._send_lock:
            if not await self._send_rest(data):
                await self._lost()

    async def _lost(self) -> None:
        if self._protocol is not None:
            await self._protocol.closed()

    def _write_held(self) -> None:
        """The connection closes with bytes held: they go out if the socket takes them now
        (what the client would have had without the holding), else they are dropped (also
        behind a write still waiting, which they must not overtake)."""
        data, self._held = self._held, b""
        if not self._send_lock.locked():
            with suppress(OSError):
                os.write(self._socket.fileno(), data)

    async def _send_rest(self, data: bytes) -> bool:
        """Write `data`, waiting for the socket as needed; False (the connection closed) if
        the client is gone or took nothing for `write_timeout_s`. Cancellation closes the
        connection too."""
        sock, write_timeout = self._socket, self._settings.write_timeout_s
        done = False
        try:
            with memoryview(data) as view:
                sent = 0
                while sent < len(view):
                    with trio.move_on_after(write_timeout) as waited:
                        await trio.lowlevel.wait_writable(sock)
                    if waited.cancelled_caught:
                        logger.info(
                            "a client took no response bytes for %g s; closing its connection",
                            write_timeout,
                        )
                        return False
                    with suppress(BlockingIOError):
                        sent += os.write(sock.fileno(), view[sent:])
            done = True
            return True
        except OSError:
            return False
        finally:
            if not done:
                sock.close()  # synchronous: also when cancelled

    async def _close_stream(self) -> None:
        with suppress(trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
            await self._stream.send_eof()
        await self._stream.aclose()

    # -- the keep-alive timer ------------------------------------------------------------------
    def _stop_timer(self) -> None:
        self._timer_closed = True
        self._timer.cancel()

    async def _keep_alive(self) -> None:
        terminated = self._settings.terminated
        while True:
            with self._timer:
                await terminated.wait()
                if not self._idle:  # the protocol closes the connection after this response
                    await trio.sleep_forever()
            if self._timer_closed:
                return
            if self._idle:  # idle past the keep-alive timeout, or shutting down while idle
                break
            # The deadline passed just as a request began: keep serving it, with a new scope.
            self._timer = trio.CancelScope(deadline=math.inf)
        with trio.CancelScope(shield=True):  # close from the server's side
            if self._protocol is not None:
                await self._protocol.closed()
            await self._stream.aclose()


class ConnectionAnswer(AsgiAnswer):
    """The answer writer of an HTTP/1.1 request on a `ClientConnection` (see the module's
    docstring): the messages go through the protocol as ASGI ones, but the head waits for the
    bytes that follow it at once, an answer's last bytes go out with its end, and an engine's
    chunked body is relayed around the protocol while nothing else writes to the socket."""

    __slots__ = ("_connection", "_relay")

    def __init__(
        self, send: Send, hook: Disconnect, connection: ClientConnection, relay: Relay | None
    ) -> None:
        super().__init__(send, hook)
        self._connection, self._relay = connection, relay

    async def _flush_head(self, *, hold: bool = True) -> None:
        if (head := self._head) is not None:
            self._head = None
            if hold:
                self._connection.hold_next()
            await self._send(head)

    async def relay(
        self,
        response: UpstreamResponse,
        *,
        rewrite: Rewrite | None = None,
        on_first: Callable[[float], None] | None = None,
    ) -> bytes:
        at_hand = response.at_hand()  # the body's first bytes came with the head: one write
        await self._flush_head(hold=at_hand)
        if self._relay is None or not response.relayable:
            return await self._pass_on(response, rewrite, on_first)
        if at_hand or self._connection.writes_pending():
            # The general way until the rest can be relayed (the head goes with the first).
            tail = await self._pass_on(response, rewrite, on_first, until_relayable=self._free)
            if response.complete:
                return tail
            on_first = None
        tail, relayed, held = await self._relay.relay(
            response, self._connection, hold_last=True, on_first=on_first, transform=rewrite
        )
        self.sent += relayed
        if held:  # the read that ended the body: it goes out with what follows (the end)
            self._connection.write_with_next(held)
        return tail

    def _free(self) -> bool:
        """Nothing else writes to the client's socket now: the relay may."""
        return not self._connection.writes_pending()

    async def end(self, data: bytes = b"") -> None:
        if self._hook is not None:
            self._hook.disarm()
        self.sent += len(data)
        await self._flush_head()
        held, self._held = self._held, b""
        if held or data:  # the last bytes and the end of the response: one write
            self._connection.hold_next()
        await self._send({"type": "http.response.body", "body": held + data, "more_body": False})


class DrainingListener(trio.abc.Listener[trio.SocketStream]):
    """Accepts every connection waiting in the listen backlog in one turn: after one accept
    (Trio's, which waits and is a checkpoint), the rest that are already there are accepted at
    once without a trip through the scheduler each, and handed out by the next `accept()`
    calls. A burst of new connections (clients reconnecting after a rollout) then reaches the
    server in one go instead of one connection per scheduler turn. With `slots`, a connection
    is accepted only once one of them is free (the connection gives it back when it ends):
    beyond the bound, connections wait in the listen backlog."""

    def __init__(
        self, listener: trio.SocketListener, raw: socket.socket, slots: trio.Semaphore | None
    ) -> None:
        self._listener, self._raw, self._slots = listener, raw, slots
        self._accepted: deque[trio.SocketStream] = deque()

    async def accept(self) -> trio.SocketStream:
        if self._accepted:  # no checkpoint: the whole burst is handed out in this turn
            return self._accepted.popleft()
        if self._slots is not None:
            await self._slots.acquire()
        try:
            stream = await self._listener.accept()
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        self._drain()
        return stream

    def _drain(self) -> None:
        """Accept, without waiting, what else the backlog holds (while slots are free)."""
        while self._slots is None or self._slots.value > 0:
            try:
                sock, _ = self._raw.accept()
            except OSError:  # nothing more waiting, or an error the next accept() reports
                return
            if self._slots is not None:
                self._slots.acquire_nowait()
            self._accepted.append(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))

    async def aclose(self) -> None:
        while self._accepted:
            stream = self._accepted.popleft()
            await trio.aclose_forcefully(stream)
            if self._slots is not None:
                self._slots.release()
        await self._listener.aclose()
