"""The endpoint picker for Gateway API gateways (`[picker]`): the router's discovery,
policies, admission and tenants decide which engine each of the gateway's requests goes to;
the gateway (Envoy) moves the bytes.

`serve_picker` runs it beside the proxy, in the same process: `service.PickerServer` (the
gRPC side, on its own thread) hands each request to `choose.Picker` (the decision, on the
Trio thread). Its readiness follows the router's `/health`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import trio

from ..config import PickerConfig, parse_bind
from ..errors import ConfigError
from ..serving.runtime import Runtime
from .choose import Picker
from .service import PickerServer

__all__ = ["serve_picker"]

logger = logging.getLogger(__name__)

READINESS_INTERVAL_S: Final = 1.0  # how often the health service's readiness is brought up to date


async def serve_picker(
    config: PickerConfig,
    runtime: Callable[[], Runtime],
    ready: Callable[[], bool],
    *,
    grace_s: Callable[[], float],
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the picker on `config.bind` until cancelled (then calls in flight get
    `grace_s()` seconds); `task_status` gets the port it listens on. Raises ConfigError when
    it cannot listen there."""
    host, port = parse_bind(config.bind, "picker.bind")
    picker = Picker(runtime, endpoints=config.endpoints)
    token = trio.lowlevel.current_trio_token()
    listening = trio.Event()
    bound: list[int] = []

    def listen(port: int) -> None:  # the Trio thread
        bound.append(port)
        listening.set()

    def started(port: int) -> None:  # the server's thread
        token.run_sync_soon(listen, port)

    async with trio.open_nursery() as calls:
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        server = PickerServer(
            bind,
            picker,
            token,
            calls,
            max_body_bytes=runtime().config.server.max_body_bytes,
            grace_s=grace_s(),
        )
        async with trio.open_nursery() as own:
            own.start_soon(_run, server, started, config.bind)
            await listening.wait()
            logger.info("endpoint picker listening on %s (gRPC, ext_proc)", config.bind)
            task_status.started(bound[0])
            try:
                table = runtime().services.table
                while True:
                    server.set_ready(ready())
                    with trio.move_on_after(READINESS_INTERVAL_S):  # or at once on a change
                        await table.wait_changed()
            finally:
                server.stop()
        calls.cancel_scope.cancel(reason="the endpoint picker stopped")


async def _run(server: PickerServer, started: Callable[[int], None], bind: str) -> None:
    """The server's thread, to its end (`server.stop`)."""
    try:
        await trio.to_thread.run_sync(
            server.run, started, thread_name="trio-router picker", limiter=trio.CapacityLimiter(1)
        )
    except RuntimeError as exc:  # grpcio: the address could not be bound
        raise ConfigError(f"picker.bind: cannot listen on {bind}: {exc}") from exc
