"""trio_router's seam into Hypercorn's trio worker: how its own server is run.

The only module that touches Hypercorn's internals (its trio `TCPServer`, keep-alive task,
lifespan, worker context, per-connection task group and HTTP/1.1 protocol). Checked against
Hypercorn 0.17 and 0.18, the releases `pyproject.toml` allows; on any other layout `serve` logs
a warning and serves with `hypercorn.trio.serve` as released, correctly but without the bounds
below, the reason phrases and the disconnect hook, and at a higher CPU cost.

- `serve(app, config, ...)`: what `hypercorn.trio.serve` does, with trio_router's connection
  class (`KeepAliveConnection`) handed to the accept loop directly (nothing global is
  replaced: other servers in the process, such as the fake engines of the tests and the demo,
  are Hypercorn's own), a bound on open connections (beyond it, accepting waits), the listen
  backlog drained in one turn (a burst of new connections is accepted together), and a
  deadline on client writes.
- `current_client()`: for the request being handled, its client connection's socket as a
  `ClientSocket` (plain TCP only), so that the app can write a relayed body to it without
  knowing how Hypercorn is built, and have bytes go out in one write with Hypercorn's next.
- `disconnect_hook(scope)`: the request's `Disconnect`, which cancels the cancel scope the app
  arms it with when the client goes away, without a watcher task per request.
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import logging
import math
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import suppress
from functools import partial
from http import HTTPStatus
from typing import Any, Final

import h11
import hypercorn.config
import hypercorn.trio
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr

logger = logging.getLogger(__name__)

__all__ = [
    "ClientSocket",
    "Disconnect",
    "KeepAliveConnection",
    "current_client",
    "disconnect_hook",
    "serve",
]


class ClientSocket:
    """The socket of one client connection, for a body written around Hypercorn (the relay).

    Only for HTTP/1.1 over plain TCP, and only while the app is sending a response whose head
    Hypercorn has written: nothing else writes to the connection then. `fileno()` is -1 once
    Hypercorn has closed the socket, so a write never reaches a descriptor number the process
    has reused since."""

    __slots__ = ("_connection", "_socket")

    def __init__(self, connection: KeepAliveConnection, socket: trio.socket.SocketType) -> None:
        self._connection, self._socket = connection, socket

    def fileno(self) -> int:
        return self._socket.fileno()

    def writes_pending(self) -> bool:
        """Hypercorn is still writing to the connection (a write the socket did not take at
        once), or holds bytes for its next write: the app must not write around it now."""
        connection = self._connection
        return connection.send_lock.locked() or bool(connection.held)

    def hold_next(self) -> None:
        """What Hypercorn writes next for the app's next message is held back and goes out in
        one write with what it writes after it: a response head with the body's first bytes,
        the last body bytes with the end of the response. Call it just before sending that
        message, and only when the next message follows at once (the held bytes wait for
        it)."""
        self._connection.hold_next = True

    def write_with_next(self, data: bytes) -> None:
        """`data` (bytes of the response body, written around Hypercorn) goes out in front of
        what Hypercorn writes next (the end of the response): one write for both."""
        self._connection.held += data


_client: contextvars.ContextVar[ClientSocket | None] = contextvars.ContextVar(
    "trio_router_client", default=None
)


def current_client() -> ClientSocket | None:
    """The client socket of the request being handled (its task inherits the connection's
    context), or None: TLS, or a server that is not `serve`'s."""
    return _client.get()


class Disconnect:
    """One request's disconnect hook: `arm(scope)` makes the client's leaving cancel `scope`
    (Hypercorn queues `http.disconnect` for the request when its connection, or its HTTP/2
    stream, closes), at once if it has left already; `disarm()` ends that, before the
    request's last message goes out (Hypercorn reports the end of every exchange as a
    disconnect too)."""

    __slots__ = ("_gone", "_scope")

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self._gone = False

    def arm(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        if self._gone:
            self.fire()

    def disarm(self) -> None:
        self._scope = None

    def fire(self) -> None:
        """The client went away (called by the connection's task, synchronously)."""
        self._gone = True
        if (scope := self._scope) is not None:
            self._scope = None
            scope.cancel(reason="the client went away")


_HOOK: Final = "trio_router.disconnect"  # where a request's Disconnect is in its scope


def disconnect_hook(scope: dict[str, Any]) -> Disconnect | None:
    """The disconnect hook of a request served by `serve`, or None (another server)."""
    extensions = scope.get("extensions")
    return extensions.get(_HOOK) if extensions else None


class DisconnectingTaskGroup(TaskGroup):
    """Hypercorn's per-connection task group, whose requests each get a `Disconnect` (in
    their scope's extensions) fired when Hypercorn queues their `http.disconnect`: no task
    per request watches for it."""

    async def spawn_app(
        self, app: Any, config: hypercorn.config.Config, scope: Any, send: Any
    ) -> Callable[[Any], Awaitable[None]]:
        hook = Disconnect()
        scope["extensions"][_HOOK] = hook
        put = await super().spawn_app(app, config, scope, send)

        async def put_and_watch(message: Any) -> None:
            if message["type"] == "http.disconnect":
                hook.fire()
            await put(message)

        return put_and_watch


_PHRASES: Final = {status.value: status.phrase.encode() for status in HTTPStatus}


class PhrasedH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, with the reason phrase in the status line
    (`HTTP/1.1 200 OK`, as vLLM's server sends it: Hypercorn writes `HTTP/1.1 200 `, which
    some clients and log parsers take for a malformed line). HTTP/2 has no reason phrase."""

    async def _send_h11_event(self, event: Any) -> None:
        if type(event) is h11.Response and not event.reason:
            # h11's events are frozen dataclasses; building a new one would check every
            # header again.
            object.__setattr__(event, "reason", _PHRASES.get(event.status_code, b""))
        await super()._send_h11_event(event)


class KeepAliveTimer(TrioSingleTask):
    """A client connection's keep-alive timer: one task per connection whose cancel-scope
    deadline moves, in place of Hypercorn's `TrioSingleTask`, which starts a fresh timer task
    (and cancels the last one) around every request. Same behaviour: a connection idle for
    `keep_alive_timeout` is closed; on shutdown an idle connection is closed at once and a
    busy one when its response is complete (Hypercorn's protocol does that part).

    Hypercorn's connection calls `restart` when it goes idle (also once at the start) and
    `stop` when a request begins; `close` ends the timer with the connection.
    """

    def __init__(self, connection: KeepAliveConnection) -> None:
        super().__init__()
        self._connection = connection
        self._scope = trio.CancelScope()
        self._idle = False
        self._running = False
        self._closed = False

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        """The connection is idle from now on (`action`, Hypercorn's timer body, is not
        used: the timer task below does its job)."""
        self._idle = True
        if self._connection.context.terminated.is_set():
            self._scope.deadline = -math.inf  # shutting down: close an idle connection now
        else:
            self._scope.deadline = trio.current_time() + self._connection.config.keep_alive_timeout
        if not self._running:
            self._running = True
            task_group.spawn(self._run)

    async def stop(self) -> None:
        """A request has begun: no timeout until it is answered."""
        self._idle = False
        self._scope.deadline = math.inf

    def close(self) -> None:
        """The connection has ended: end the timer task."""
        self._closed = True
        self._scope.cancel()

    async def _run(self) -> None:
        while True:
            with self._scope:
                await self._connection.context.terminated.wait()
                if not self._idle:  # the protocol closes the connection after this response
                    await trio.sleep_forever()
            if self._closed:
                return
            if self._idle:  # idle past the keep-alive timeout, or shutting down while idle
                break
            # The deadline passed just as a request began: keep serving it, with a new scope.
            self._scope = trio.CancelScope(deadline=math.inf)
        with trio.CancelScope(shield=True):
            await self._connection.close_idle()


class KeepAliveConnection(TCPServer):
    """Hypercorn's trio connection (its HTTP/1.1 and HTTP/2 protocols and ASGI handling,
    unchanged) with a leaner and bounded drive of the socket:

    - the keep-alive timer above (Hypercorn's starts a task per request);
    - a write is tried at once on the non-blocking socket and waits (under Hypercorn's send
      lock) only for what the socket did not take; an empty write (the end of a
      Content-Length body) is skipped. Hypercorn's way cost a lock round trip and a shielded
      checkpoint per write, three writes per response;
    - the app can have bytes go out together (`ClientSocket.hold_next`, `write_with_next`):
      a response head with a body that is already there, the last body bytes (relayed or
      not) with the end of the response, one write instead of two or three;
    - a write that makes no progress for `write_timeout` seconds (a client that stopped
      reading) closes the connection, and a write can be cancelled (the drain deadline at
      shutdown): Hypercorn shields its writes, so a client that never reads held a shutdown
      for as long as it stayed connected;
    - reads have no timeout scope when `read_timeout` is unset (Hypercorn's default, ours);
    - HTTP/1.1 status lines carry their reason phrase (`PhrasedH11Protocol`).

    The timer ends with the connection, where Hypercorn's outlived a connection the client
    closed until the keep-alive timeout. `slots`, if given, is released when the connection
    ends (see `serve`'s connection bound).
    """

    def __init__(
        self,
        app: Any,
        config: hypercorn.config.Config,
        context: Any,
        state: Any,
        stream: Any,
        *,
        write_timeout: float = math.inf,
        slots: trio.Semaphore | None = None,
    ) -> None:
        super().__init__(app, config, context, state, stream)
        self.idle_task = self.keep_alive = KeepAliveTimer(self)
        self.write_timeout = write_timeout
        self._slots = slots
        # The stream's socket, for writes tried at once (plain TCP only; TLS goes Hypercorn's
        # way). Its fileno() is -1 once it is closed, so a write never reaches a descriptor
        # number the process has reused since.
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        # Bytes held for the next write (see ClientSocket.hold_next and write_with_next), and
        # whether the next write is itself held.
        self.held = b""
        self.hold_next = False

    async def close_idle(self) -> None:
        """Close the connection from the server's side (it is idle past its timeout, or the
        server is shutting down), as Hypercorn's own timer does."""
        await self._initiate_server_close()

    async def run(self) -> None:
        try:
            if self._socket is not None:  # the request tasks spawned from here inherit it
                _client.set(ClientSocket(self, self._socket))
            await super().run()
        finally:
            if self._slots is not None:
                self._slots.release()

    async def protocol_send(self, event: Event) -> None:
        if type(event) is not RawData:
            # Nothing stays held past a write: the end of every response is one, and so is
            # anything the connection does next.
            self.hold_next = False
            if self.held:
                if type(event) is Closed:
                    self._write_held()
                else:
                    await self._write(b"")
            await super().protocol_send(event)
            return
        if self.hold_next:  # held: it goes out with the next write
            self.hold_next = False
            self.held += event.data
            return
        await self._write(event.data)

    async def _write(self, data: bytes) -> None:
        if self.held:
            data, self.held = self.held + data, b""
        if not data:
            return
        sock = self._socket
        if sock is None:  # TLS: Hypercorn's own way
            await super().protocol_send(RawData(data=data))
            return
        if not self.send_lock.locked():
            try:
                sent = os.write(sock.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe, or closed here (fileno() is then -1)
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            data = data[sent:]
        async with self.send_lock:
            if not await self._send_rest(sock, data):
                await self.protocol.handle(Closed())

    def _write_held(self) -> None:
        """The connection closes with bytes held: they go out if the socket takes them now
        (what the client would have had without the holding), else they are dropped (also
        behind a write still waiting, which they must not overtake)."""
        data, self.held = self.held, b""
        if self._socket is not None and not self.send_lock.locked():
            with suppress(OSError):
                os.write(self._socket.fileno(), data)

    async def _send_rest(self, sock: trio.socket.SocketType, data: bytes) -> bool:
        """Write `data`, waiting for the socket as needed; False (the connection closed) if
        the client is gone or took nothing for `write_timeout`. Cancellation closes the
        connection too: a response cut mid-write cannot go on."""
        done = False
        try:
            with memoryview(data) as view:
                sent = 0
                while sent < len(view):
                    with trio.move_on_after(self.write_timeout) as waited:
                        await trio.lowlevel.wait_writable(sock)
                    if waited.cancelled_caught:
                        logger.info(
                            "a client took no response bytes for %g s; closing its connection",
                            self.write_timeout,
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

    async def _read_data(self) -> None:
        # Called once the connection's task group and protocol exist, before any request is
        # read: both become this seam's subclasses (no state of theirs changes).
        if type(self._task_group) is TaskGroup:
            self._task_group.__class__ = DisconnectingTaskGroup
        protocol = self.protocol.protocol
        if type(protocol) is H11Protocol:
            protocol.__class__ = PhrasedH11Protocol
        try:
            if self.config.read_timeout is not None:
                await super()._read_data()
                return
            receive_some, handle = self.stream.receive_some, self.protocol.handle
            while True:
                try:
                    data = await receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                await handle(RawData(bytes(data)))
                if not data:
                    break
            await handle(Closed())
        finally:
            self.keep_alive.close()


def _checked() -> bool:
    """This Hypercorn is one the connection class was written for (0.17, 0.18)."""
    if (
        not hasattr(TCPServer, "_initiate_server_close")
        or not hasattr(TCPServer, "_close")
        or not hasattr(H11Protocol, "_send_h11_event")
        or not hasattr(TaskGroup, "spawn_app")
    ):
        logger.warning(
            "this Hypercorn (%s) is not the one trio_router's connection class "
            "was written for; serving with Hypercorn's own",
            importlib.metadata.version("hypercorn"),
        )
        return False
    return True


class _DrainingListener(trio.abc.Listener[trio.SocketStream]):
    """Accepts every connection waiting in the listen backlog in one turn: after one accept
    (Trio's, which waits and is a checkpoint), the rest that are already there are accepted at
    once without a trip through the scheduler each, and handed out by the next `accept()`
    calls. A burst of new connections (clients reconnecting after a rollout) then reaches the
    server in one go instead of one connection per scheduler turn, each turn as long as
    whatever else is running. With `slots`, a connection is accepted only once one of them is
    free (the connection gives it back when it ends): beyond the bound, connections wait in
    the listen backlog."""

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


async def serve(
    app: Any,
    config: hypercorn.config.Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    max_connections: int = 0,
    write_timeout: float = math.inf,
    drain_s: Callable[[], float] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` as `hypercorn.trio.serve(app, config, ...)` does (lifespan,
    Hypercorn's HTTP/1.1 and HTTP/2 protocols, its graceful shutdown: `shutdown_trigger`
    returning starts it, and in-flight requests get `drain_s()` seconds, read then, or
    `config.graceful_timeout`), each connection
    driven by `KeepAliveConnection`, with at most `max_connections` open at once (0: no bound;
    beyond it, new connections wait in the listen backlog of `config.backlog`), and client
    writes bounded by `write_timeout`. Plain TCP only. Started (with the bound URLs) once it
    accepts connections. On a Hypercorn of another layout, `hypercorn.trio.serve` serves
    instead (without these bounds), with a warning."""
    if not _checked():
        await hypercorn.trio.serve(
            app, config, shutdown_trigger=shutdown_trigger, task_status=task_status
        )
        return
    wrapped = ASGIWrapper(app)
    lifespan = Lifespan(wrapped, config, {})
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            if sockets.secure_sockets or sockets.quic_sockets:
                raise RuntimeError("connection.serve serves plain TCP only")
            slots = trio.Semaphore(max_connections) if max_connections > 0 else None
            listeners: list[trio.abc.Listener[trio.SocketStream]] = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                listeners.append(_DrainingListener(listener, sock, slots))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
                await config.log.info(f"Running on {binds[-1]} (CTRL + C to quit)")
            handler = partial(
                KeepAliveConnection,
                wrapped,
                config,
                context,
                ConnectionState({}),
                write_timeout=write_timeout,
                slots=slots,
            )
            task_status.started(binds)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners, handler, listeners, handler_nursery=server_nursery
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other_errors = error.split((ShutdownError, KeyboardInterrupt))
                if other_errors is not None:
                    raise other_errors from None
            finally:
                await context.terminated.set()
                drain = drain_s() if drain_s is not None else config.graceful_timeout
                server_nursery.cancel_scope.deadline = trio.current_time() + drain
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
