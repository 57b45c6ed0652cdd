"""trio_router's seam into Hypercorn: Hypercorn's HTTP/1.1 and HTTP/2 protocol objects, driven
by trio_router's own connections (`connection.ClientConnection`), and the server around them.

The only module that imports Hypercorn's internals. Everything it uses of them is listed once,
in TOUCHPOINTS, with the parameters each was written against (Hypercorn 0.17 and 0.18, the
releases `pyproject.toml` allows); `fits()` checks them all. On a Hypercorn where one differs,
`serve` logs a warning and serves with `hypercorn.trio.serve` as released: correctly, with
the app answering through plain ASGI (`answer.open_asgi_answer`), but without the bounds and
the joined and relayed writes of trio_router's connections, at a higher CPU cost.

- `HypercornProtocol`: a Hypercorn protocol (`hypercorn.protocol.ProtocolWrapper`, which picks
  HTTP/1.1 or HTTP/2) behind the `connection.ServerProtocol` interface: bytes in, and its
  events (`RawData`, `Closed`, `Updated`) turned into the connection's `write`, `close` and
  `idle`.
- `RequestTasks`: the task group a protocol runs each request's app in (Hypercorn's
  `TaskGroup` protocol, constructed directly in the connection's nursery). Each HTTP request
  gets its answer writer in its scope's extensions (`answer.ANSWER_EXTENSION`), whose
  disconnect hook fires when the protocol queues the request's `http.disconnect`: no task per
  request watches for it.
- `serve(app, config, ...)`: what `hypercorn.trio.serve` does (lifespan, its state shared with
  requests, graceful shutdown), with trio_router's connections, a bound on open connections
  and the listen backlog drained in one turn (`connection.DrainingListener`). Plain TCP only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import hypercorn.config
import hypercorn.trio
import hypercorn.typing
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext

from ..asgi import Message, Receive, Scope, Send
from ..http import Relay
from .answer import ANSWER_EXTENSION, Disconnect
from .connection import (
    ClientConnection,
    ConnectionSettings,
    DrainingListener,
)

__all__ = ["TOUCHPOINTS", "HypercornProtocol", "RequestTasks", "ServeOptions", "fits", "serve"]

logger = logging.getLogger(__name__)

App = Callable[[Scope, Receive, Send], Awaitable[None]]

# What this module uses of Hypercorn's internals, and the parameters each was written against.
TOUCHPOINTS: Final = (
    (
        "hypercorn.protocol.ProtocolWrapper",
        (
            *("app", "config", "context", "task_group", "state", "ssl", "client", "server"),
            *("send", "alpn_protocol"),
        ),
    ),
    ("hypercorn.protocol.ProtocolWrapper.initiate", ("self",)),
    ("hypercorn.protocol.ProtocolWrapper.handle", ("self", "event")),
    ("hypercorn.events.RawData", ("data", "address")),
    ("hypercorn.events.Closed", ()),
    ("hypercorn.events.Updated", ("idle",)),
    ("hypercorn.trio.worker_context.WorkerContext", ("max_requests",)),
    ("hypercorn.trio.lifespan.Lifespan", ("app", "config", "state")),
    ("hypercorn.trio.lifespan.Lifespan.handle_lifespan", ("self", "task_status")),
    ("hypercorn.trio.lifespan.Lifespan.wait_for_startup", ("self",)),
    ("hypercorn.trio.lifespan.Lifespan.wait_for_shutdown", ("self",)),
    # What Hypercorn's protocols call on the task group they are given (RequestTasks).
    ("hypercorn.typing.TaskGroup.spawn_app", ("self", "app", "config", "scope", "send")),
    ("hypercorn.typing.TaskGroup.spawn", ("self", "func", "args")),
)


def _parameters(dotted: str) -> tuple[str, ...] | str:
    """The parameter names of the callable `dotted` names (of a class: its constructor's,
    without self), or why it has none."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                target = getattr(target, name)
            return tuple(inspect.signature(target).parameters)
        except (AttributeError, TypeError, ValueError) as exc:
            return f"not there: {exc}"
    return "no such module"


def fits() -> list[str]:
    """What this Hypercorn has otherwise than this module was written for: each touchpoint
    whose parameters differ, as text (empty: it fits)."""
    misfits = []
    for dotted, expected in TOUCHPOINTS:
        found = _parameters(dotted)
        if found != expected:
            misfits.append(f"{dotted}{found} (expected {expected})")
    return misfits


class HypercornProtocol:
    """A Hypercorn protocol driven by `connection` (see the module's docstring)."""

    __slots__ = ("_connection", "_protocol")

    def __init__(
        self,
        connection: ClientConnection,
        tasks: RequestTasks,
        *,
        app: App,
        config: hypercorn.config.Config,
        context: WorkerContext,
        state: dict[str, Any],
    ) -> None:
        self._connection = connection
        # Plain-dict ASGI and our task group where Hypercorn's types name its TypedDicts and
        # its own task group: the same protocol (TOUCHPOINTS), other static types.
        asgi: Any = app
        task_group: Any = tasks
        self._protocol = ProtocolWrapper(
            asgi,
            config,
            context,
            task_group,
            hypercorn.typing.ConnectionState(state),
            False,  # plain TCP
            connection.client,
            connection.server,
            self._event,
            "http/1.1",
        )

    async def initiate(self) -> None:
        await self._protocol.initiate()

    async def received(self, data: bytes) -> None:
        await self._protocol.handle(RawData(data))

    async def closed(self) -> None:
        await self._protocol.handle(Closed())

    async def _event(self, event: Any) -> None:
        kind = type(event)
        if kind is RawData:
            await self._connection.write(event.data)
        elif kind is Updated:
            await self._connection.idle(event.idle)
        elif kind is Closed:
            await self._connection.close()


class RequestTasks:
    """The task group of one connection's requests (Hypercorn's `TaskGroup` protocol), in the
    connection's nursery. An HTTP request's scope gets the connection's answer writer."""

    __slots__ = ("_connection", "_nursery")

    def __init__(self, connection: ClientConnection, nursery: trio.Nursery) -> None:
        self._connection, self._nursery = connection, nursery

    async def spawn_app(
        self,
        app: App,
        config: hypercorn.config.Config,
        scope: Scope,
        send: Callable[[Message | None], Awaitable[None]],
    ) -> Callable[[Message], Awaitable[None]]:
        hook = Disconnect()
        if scope["type"] == "http":
            scope["extensions"][ANSWER_EXTENSION] = self._connection.answer(
                send, hook, scope["http_version"]
            )
        put, get = trio.open_memory_channel[Message](config.max_app_queue_size)
        self._nursery.start_soon(_run_app, app, scope, partial(_receive, get), send)

        async def put_and_watch(message: Message) -> None:
            if message["type"] == "http.disconnect":
                hook.fire()
            try:  # room in the queue: no trip through the scheduler (see `_receive`)
                put.send_nowait(message)
            except trio.WouldBlock:
                await put.send(message)

        return put_and_watch

    def spawn(self, func: Callable[..., Awaitable[None]], *args: Any) -> None:
        self._nursery.start_soon(func, *args)

    async def __aenter__(self) -> RequestTasks:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


async def _receive(get: trio.MemoryReceiveChannel[Message]) -> Message:
    """The app's next message: at once when the protocol has queued it (a request's body
    and its end come with its head, queued in the same step as the head), else when it
    comes. Neither side of the queue passes through the scheduler when it need not wait:
    each pass is a turn of the event loop on every request's way."""
    try:
        return get.receive_nowait()
    except trio.WouldBlock:
        return await get.receive()


async def _run_app(
    app: App, scope: Scope, receive: Receive, send: Callable[[Message | None], Awaitable[None]]
) -> None:
    """One request's app, as Hypercorn runs it: an error is logged, and the protocol is told
    the app is done however it ended (a 500 if it had not answered). Its answer writer then
    leaves the scope: the writer holds the protocol's stream (its `send`), which holds the
    scope, and that cycle would leave the request's objects to the garbage collector where
    reference counting frees them as soon as the request ends."""
    try:
        await app(scope, receive, send)
    except trio.Cancelled:
        raise
    except BaseExceptionGroup as error:
        cancelled, others = error.split(trio.Cancelled)
        if others is None:
            raise
        logger.error("error in the ASGI app", exc_info=others)
        if cancelled is not None:
            raise cancelled from None
    except Exception:
        logger.exception("error in the ASGI app")
    finally:
        try:
            await send(None)
        finally:
            if (extensions := scope.get("extensions")) is not None:
                extensions.pop(ANSWER_EXTENSION, None)


def _lifespan_app(app: App) -> Callable[..., Awaitable[None]]:
    """`app` as Hypercorn's lifespan calls it (with two more arguments it does not need)."""

    async def call(scope: Scope, receive: Receive, send: Send, *_: object) -> None:
        await app(scope, receive, send)

    return call


def _listeners(
    config: hypercorn.config.Config, slots: trio.Semaphore | None
) -> tuple[list[DrainingListener], list[str]]:
    sockets = config.create_sockets()
    if sockets.secure_sockets or sockets.quic_sockets:
        raise RuntimeError("trio_router's server serves plain TCP only")
    listeners, binds = [], []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        listeners.append(DrainingListener(listener, sock, slots))
        host, port = sock.getsockname()[:2]
        binds.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return listeners, binds


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What trio_router's server adds to Hypercorn's config."""

    max_connections: int = 0  # open at once (0: no bound); beyond, the listen backlog
    write_timeout_s: float = math.inf  # a client taking nothing this long is dropped
    relay: Relay | None = None  # engine bodies relayed to HTTP/1.1 clients
    drain_s: Callable[[], float] | None = None  # the drain, read when it starts


async def serve(
    app: App,
    config: hypercorn.config.Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    options: ServeOptions = ServeOptions(),
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` as `hypercorn.trio.serve(app, config, ...)` does (lifespan,
    HTTP/1.1 and HTTP/2, graceful shutdown: `shutdown_trigger` returning starts it, and
    in-flight requests get `options.drain_s()` seconds, read then, or
    `config.graceful_timeout`), each connection a `ClientConnection`: at most
    `options.max_connections` open at once (beyond it, new connections wait in the listen
    backlog of `config.backlog`), client writes bounded by `options.write_timeout_s`, engine
    bodies relayed by `options.relay`. Started (with the bound URLs) once it accepts
    connections. On a Hypercorn that does not fit, `hypercorn.trio.serve` serves instead,
    with a warning."""
    if misfits := fits():
        logger.warning(
            "this Hypercorn (%s) is not the one trio_router's connections were written for "
            "(%s); serving with Hypercorn's own",
            importlib.metadata.version("hypercorn"),
            "; ".join(misfits),
        )
        await hypercorn.trio.serve(
            app,  # type: ignore[arg-type]  # plain-dict ASGI, not Hypercorn's TypedDicts
            config,
            shutdown_trigger=shutdown_trigger,
            task_status=task_status,
        )
        return
    state: dict[str, Any] = {}
    lifespan_app: Any = _lifespan_app(app)  # plain-dict ASGI (see HypercornProtocol)
    lifespan = Lifespan(lifespan_app, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        bound = options.max_connections
        slots = trio.Semaphore(bound) if bound > 0 else None
        settings = ConnectionSettings(
            terminated=context.terminated,
            keep_alive_s=config.keep_alive_timeout,
            write_timeout_s=options.write_timeout_s,
            read_timeout_s=config.read_timeout,
            relay=options.relay,
            slots=slots,
        )
        shared = dict(state)  # what the lifespan left there, for every request's scope

        def protocol(connection: ClientConnection, nursery: trio.Nursery) -> HypercornProtocol:
            tasks = RequestTasks(connection, nursery)
            return HypercornProtocol(
                connection, tasks, app=app, config=config, context=context, state=shared
            )

        async def handle(stream: trio.SocketStream) -> None:
            await ClientConnection(stream, settings, protocol).run()

        async with trio.open_nursery() as server_nursery:
            listeners, binds = _listeners(config, slots)
            for bind in binds:
                await config.log.info(f"Running on {bind} (CTRL + C to quit)")
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners, handle, listeners, handler_nursery=server_nursery
                        )
                    )
                    task_status.started(binds)
                    await shutdown_trigger()
                    nursery.cancel_scope.cancel(reason="shutting down: no new connections")
            finally:
                await context.terminated.set()
                drain_s = options.drain_s
                drain = drain_s() if drain_s is not None else config.graceful_timeout
                server_nursery.cancel_scope.deadline = trio.current_time() + drain
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
