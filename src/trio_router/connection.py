"""trio_router's seam into Hypercorn's trio worker: the connection class it serves with.

The only module that touches Hypercorn's internals (`hypercorn.trio.tcp_server.TCPServer`, its
keep-alive task, `hypercorn.trio.run.TCPServer`). Checked against Hypercorn 0.17 and 0.18,
the releases `pyproject.toml` allows; on any other layout `serve` logs a warning and serves
with Hypercorn's own class, correctly but at a higher CPU cost.

- `serve(app, config, ...)`: `hypercorn.trio.serve` with `KeepAliveConnection` for this one
  server. Hypercorn reads its connection class once, as it starts serving; the class is
  swapped in for that moment only and restored, so other servers in the same process (the
  fake engines of the tests and the demo) keep Hypercorn's own.
- `current_client()`: for the request being handled, its client connection's socket as a
  `ClientSocket` (plain TCP only), so that the app can write a relayed body to it without
  knowing how Hypercorn is built.
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import logging
import math
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import hypercorn.config
import hypercorn.trio
import hypercorn.trio.run
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

logger = logging.getLogger(__name__)

__all__ = ["ClientSocket", "KeepAliveConnection", "current_client", "serve"]


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
        once): the app must not write around it now."""
        return self._connection.send_lock.locked()


_client: contextvars.ContextVar[ClientSocket | None] = contextvars.ContextVar(
    "trio_router_client", default=None)


def current_client() -> ClientSocket | None:
    """The client socket of the request being handled (its task inherits the connection's
    context), or None: TLS, or a server that is not `serve`'s."""
    return _client.get()


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
            self._scope.deadline = (trio.current_time()
                                    + self._connection.config.keep_alive_timeout)
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
            await self._connection._initiate_server_close()


class KeepAliveConnection(TCPServer):
    """Hypercorn's trio connection (its HTTP/1.1 and HTTP/2 protocols and ASGI handling,
    unchanged) with a leaner drive of the socket, measured with bench/bench_proxy.py:

    - the keep-alive timer above: Hypercorn's cost about a quarter of its CPU per request;
    - a write is tried at once on the non-blocking socket and waits (under Hypercorn's send
      lock, shielded, as before) only for what the socket did not take; an empty write (the
      end of a Content-Length body) is skipped. Hypercorn's way cost a lock round trip and a
      shielded checkpoint per write, three writes per response;
    - reads have no timeout scope when `read_timeout` is unset (Hypercorn's default, ours).

    The timer ends with the connection, where Hypercorn's outlived a connection the client
    closed until the keep-alive timeout.
    """

    def __init__(self, app: Any, config: hypercorn.config.Config, context: Any, state: Any,
                 stream: Any) -> None:
        super().__init__(app, config, context, state, stream)
        self.idle_task = self.keep_alive = KeepAliveTimer(self)
        # The stream's socket, for writes tried at once (plain TCP only; TLS goes Hypercorn's
        # way). Its fileno() is -1 once it is closed, so a write never reaches a descriptor
        # number the process has reused since.
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None

    async def run(self) -> None:
        if self._socket is not None:  # the request tasks spawned from here inherit it
            _client.set(ClientSocket(self, self._socket))
        await super().run()

    async def protocol_send(self, event: Event) -> None:
        if type(event) is not RawData:
            await super().protocol_send(event)
            return
        data = event.data
        if not data:
            return
        sock = self._socket
        if sock is not None and not self.send_lock.locked():
            try:
                sent = os.write(sock.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe, or closed here (fileno() is then -1)
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            event = RawData(data=data[sent:])
        await super().protocol_send(event)

    async def _read_data(self) -> None:
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


def _installable() -> bool:
    current = getattr(hypercorn.trio.run, "TCPServer", None)
    if current is KeepAliveConnection:
        return True
    if current is not TCPServer or not hasattr(TCPServer, "_initiate_server_close"):
        logger.warning("this Hypercorn (%s) is not the one trio_router's connection class "
                       "was written for; serving with Hypercorn's own",
                       importlib.metadata.version("hypercorn"))
        return False
    return True


async def serve(app: Any, config: hypercorn.config.Config, *,
                shutdown_trigger: Callable[[], Awaitable[None]],
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """`hypercorn.trio.serve(app, config, ...)`, each connection driven by
    `KeepAliveConnection`; started (with the bound URLs) once it accepts connections. Runs
    until `shutdown_trigger` returns and in-flight requests are done (Hypercorn's graceful
    shutdown), or until cancelled."""
    async with trio.open_nursery() as nursery:
        run_module: Any = hypercorn.trio.run
        original = run_module.TCPServer
        installed = _installable()
        if installed:
            run_module.TCPServer = KeepAliveConnection
        try:
            # Hypercorn takes its class when it starts serving, before `start` returns here.
            binds = await nursery.start(partial(hypercorn.trio.serve, app, config,
                                                shutdown_trigger=shutdown_trigger))
        finally:
            if installed:
                run_module.TCPServer = original
        task_status.started(binds)
