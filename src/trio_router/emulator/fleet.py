"""A fleet of emulated engines in one process, each in its own cancel scope so that one can be
killed and served again, and the fleet scaled out and in (`Fleet`, `open_fleet`,
`serve_fleet`), and where they listen (`fleet_addresses`).

Engines that publish KV-cache events share one ZMQ context, ended with the fleet; each one's
endpoints are placed for its address (`KvEventsConfig.endpoints`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Final, Literal
from urllib.parse import urlsplit

import trio
import zmq

from ..errors import ConfigError
from .app import serve_engine
from .engine import EmulatedEngine, EngineConfig
from .kv_events import KvEndpoints

__all__ = ["Change", "Fleet", "fleet_addresses", "open_fleet", "serve_fleet"]

Change = Literal["killed", "restarted", "added", "removed"]  # what on_change hears
MAX_ENGINES: Final = 1024  # in one fleet
FLUSH_S: Final = 1.0  # seconds (Trio's clock) a terminated engine's answers get to be written

logger = logging.getLogger(__name__)


def fleet_addresses(
    host: str, port: int, engines: int, *, consecutive_ports: bool
) -> list[tuple[str, int]]:
    """Where each engine listens. Raises ConfigError for a fleet that cannot be laid out."""
    if not 1 <= engines <= MAX_ENGINES:
        raise ConfigError(f"--engines must be 1..{MAX_ENGINES}: {engines}")
    if not 0 <= port <= 65535 or (consecutive_ports and port and port + engines - 1 > 65535):
        raise ConfigError(f"--port {port} leaves no room for {engines} engine(s)")
    if consecutive_ports:
        return [(host, port + i if port else 0) for i in range(engines)]
    try:
        first = ipaddress.ip_address(host)
        return [(str(first + i), port) for i in range(engines)]
    except ValueError as exc:
        if engines == 1:
            return [(host, port)]
        raise ConfigError(
            f"--host {host}: {exc}; several engines need an IP address to count from "
            "(or --consecutive-ports)"
        ) from None


@dataclass(eq=False, slots=True)
class _Slot:
    """One engine's place in the fleet: what it serves and where, and while it runs, the
    engine and the scope that stops it."""

    config: EngineConfig
    host: str
    port: int  # once served, the port it bound (a restart binds it again)
    kv_endpoints: KvEndpoints
    url: str = ""
    engine: EmulatedEngine | None = None  # None: killed
    scope: trio.CancelScope | None = None
    listening: list[trio.SocketListener] = field(default_factory=list)  # its HTTP listeners


@dataclass(frozen=True, slots=True)
class Layout:
    """How the fleet places its engines, for those it adds: `fleet_addresses`'s arguments
    and the config of each."""

    config: EngineConfig
    host: str
    port: int
    consecutive_ports: bool


class Fleet:
    """The engines of one process (see the module). `kill` is synchronous; `add`, `restart`
    and `scale` return once the engines serve, `terminate` once the engine is gone."""

    def __init__(
        self,
        nursery: trio.Nursery,
        context: zmq.Context[zmq.Socket[bytes]] | None,
        layout: Layout | None = None,
    ) -> None:
        self._nursery, self._context, self._layout = nursery, context, layout
        self._slots: list[_Slot] = []
        self._listeners: list[Callable[[int, Change], None]] = []
        self._scaling = trio.Lock()

    def on_change(self, listener: Callable[[int, Change], None]) -> None:
        """Call `listener(index, change)` after each kill, restart, engine added by `scale`
        and engine removed."""
        self._listeners.append(listener)

    def _tell(self, index: int, change: Change) -> None:
        for listener in self._listeners:
            listener(index, change)

    @property
    def urls(self) -> list[str]:
        """Each engine's base URL, in order."""
        return [slot.url for slot in self._slots]

    def __len__(self) -> int:
        return len(self._slots)

    def engine(self, index: int) -> EmulatedEngine | None:
        """Engine `index` as it runs now (None while killed)."""
        return self._slots[index].engine

    async def add(self, config: EngineConfig, host: str, port: int, where: KvEndpoints) -> str:
        """Serve one more engine; its URL. It joins the fleet once it serves. On addresses of
        their own the engines share one port, as pods: the first one to bind port 0 fixes
        it, and port 0 means it from then on. Raises OSError if its address is taken."""
        layout = self._layout
        pods = layout if layout is not None and not layout.consecutive_ports else None
        if pods is not None and port == 0:
            port = pods.port
        slot = _Slot(config, host, port, where)
        try:
            await self._start(slot)
        except BaseExceptionGroup as exc:
            failed, others = exc.split(OSError)
            if failed is not None and others is None:  # the bind's, out of the nurseries
                raise _leaves(failed)[0] from None
            raise
        self._slots.append(slot)
        if pods is not None and pods.port == 0:
            self._layout = dataclasses.replace(pods, port=slot.port)
        return slot.url

    def kill(self, index: int) -> None:
        """Stop engine `index` at once: its listener and every connection close, its
        requests are dropped, its KV-event sockets close."""
        slot = self._slots[index]
        _stop(slot, f"engine {index} killed")
        logger.info("engine %d at %s killed", index, slot.url)
        self._tell(index, "killed")

    async def restart(self, index: int) -> None:
        """Serve a fresh engine (an empty cache, counters at 0) where engine `index` was
        killed; nothing if it runs."""
        slot = self._slots[index]
        if slot.engine is None:
            await self._start(slot)
            if slot not in self._slots:  # removed by `scale` meanwhile
                _stop(slot, f"engine {index} removed")
                return
            logger.info("engine %d at %s restarted", index, slot.url)
            self._tell(index, "restarted")

    async def terminate(self, index: int) -> None:
        """Stop engine `index` as vLLM stops on SIGTERM with `--shutdown-timeout 0`: its
        requests in flight, and those that come meanwhile, are aborted (a stream ends with
        finish reason abort and [DONE]); once their answers are written (FLUSH_S at most),
        `kill`. Nothing if it is killed."""
        slot = self._slots[index]
        if (engine := slot.engine) is not None:
            await _terminated([engine])
            if slot.engine is engine and slot in self._slots:  # not killed or removed since
                self.kill(self._slots.index(slot))

    async def scale(self, engines: int) -> None:
        """Serve engines until there are `engines`, each placed and configured as the fleet's
        first ones (the next address, or the next port), or drop the last ones beyond
        `engines` from the fleet and stop them as `terminate` does (as Kubernetes sends a
        scaled-in pod SIGTERM). Raises ConfigError for a size the fleet's layout cannot take,
        OSError for an address taken (the engines served until then stay), RuntimeError for
        a fleet without a layout."""
        if self._layout is None:
            raise RuntimeError("this fleet was not opened with a layout to scale by")
        layout = self._layout
        addresses = fleet_addresses(
            layout.host, layout.port, max(engines, 1), consecutive_ports=layout.consecutive_ports
        )
        async with self._scaling:
            removed = self._slots[engines:]
            del self._slots[engines:]
            for index in reversed(range(engines, engines + len(removed))):
                logger.info("engine %d at %s removed", index, removed[index - engines].url)
                self._tell(index, "removed")
            await _terminated([slot.engine for slot in removed if slot.engine is not None])
            for slot in removed:
                _stop(slot, "removed by scale")
            while len(self._slots) < engines:
                index = len(self._slots)
                host, port = addresses[index]
                where = layout.config.kv_events.endpoints(
                    index, host, consecutive=layout.consecutive_ports
                )
                url = await self.add(layout.config, host, port, where)
                logger.info("engine %d at %s added", index, url)
                self._tell(index, "added")

    async def _start(self, slot: _Slot) -> None:
        engine = EmulatedEngine(slot.config, rng=random.Random())
        scope = trio.CancelScope()
        serve = partial(serve_engine, kv_endpoints=slot.kv_endpoints, zmq_context=self._context,
                        listening=slot.listening)  # fmt: skip
        slot.url = await self._nursery.start(_in_scope, scope, serve, engine, slot.host, slot.port)
        slot.port = urlsplit(slot.url).port or slot.port
        slot.engine, slot.scope = engine, scope


async def _terminated(engines: Sequence[EmulatedEngine]) -> None:
    """`EmulatedEngine.terminate` each of `engines`, then wait until their answers are
    written, FLUSH_S at most."""
    for engine in engines:
        engine.terminate()
    with trio.move_on_after(FLUSH_S):
        for engine in engines:
            await engine.answered()


def _stop(slot: _Slot, reason: str) -> None:
    """Stop the engine of `slot` at once: its listener and every connection close, its
    requests are dropped, its KV-event sockets close."""
    if slot.scope is not None:
        slot.scope.cancel(reason=reason)
    for http_listener in slot.listening:  # now: a connection from here on is refused
        http_listener.socket.close()
    slot.listening.clear()
    slot.scope = slot.engine = None


def _leaves(group: BaseExceptionGroup[OSError]) -> list[OSError]:
    """The exceptions a group holds, through nested groups."""
    found: list[OSError] = []
    for exc in group.exceptions:
        found += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


async def _in_scope(
    scope: trio.CancelScope,
    serve: Callable[..., Awaitable[None]],
    engine: EmulatedEngine,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await serve(engine, host, port, task_status=task_status)


@asynccontextmanager
async def open_fleet(
    configs: Sequence[EngineConfig],
    addresses: Sequence[tuple[str, int]],
    *,
    consecutive_ports: bool = False,
) -> AsyncIterator[Fleet]:
    """Serve one engine per config at the address beside it; yields once all serve, and
    stops every engine when the block ends. Engines on addresses of their own at port 0 all
    take the port the first one got (one port, as pods). `consecutive_ports`: the engines
    share one address, so each binds the next KV-event port. Raises OSError if an address
    is taken."""
    with ExitStack() as stack:
        context: zmq.Context[zmq.Socket[bytes]] | None = None
        if any(config.kv_events.enabled for config in configs):
            context = zmq.Context()
            stack.callback(context.destroy, linger=0)
        async with trio.open_nursery() as nursery:
            host, port = addresses[0] if addresses else ("127.0.0.1", 0)
            layout = Layout(configs[0], host, port, consecutive_ports) if configs else None
            fleet = Fleet(nursery, context, layout)
            for i, (config, (host, port)) in enumerate(zip(configs, addresses, strict=True)):
                where = config.kv_events.endpoints(i, host, consecutive=consecutive_ports)
                url = await fleet.add(config, host, port, where)
                logger.info("engine %d (%s) at %s", i, config.profile.name, url)
            yield fleet
            nursery.cancel_scope.cancel(reason="fleet closed")


async def serve_fleet(
    configs: Sequence[EngineConfig],
    addresses: Sequence[tuple[str, int]],
    *,
    consecutive_ports: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`open_fleet` until cancelled; reports the engines' URLs, in order, once all serve."""
    async with open_fleet(configs, addresses, consecutive_ports=consecutive_ports) as fleet:
        task_status.started(fleet.urls)
        await trio.sleep_forever()
