"""The endpoint picker for Gateway API gateways (`[picker]`): the router's discovery,
policies, admission and tenants decide which engine each of the gateway's requests goes to;
the gateway (Envoy) moves the bytes.

`serve_picker` runs it beside the proxy, in the same process and on the same Trio thread:
`service.PickerServer` (the gRPC side) hands each request to `choose.Picker` (the decision).
Its readiness follows the router's `/health`.
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
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the picker on `config.bind` until cancelled (decisions still being made are
    refused, 503 `picker_stopping`); `task_status` gets the port it listens on. Raises
    ConfigError when it cannot listen there."""
    host, port = parse_bind(config.bind, "picker.bind")
    picker = Picker(runtime, endpoints=config.endpoints)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"picker.bind: cannot listen on {config.bind}: {exc}") from exc
    async with trio.open_nursery() as calls:
        server = PickerServer(picker, calls, max_body_bytes=runtime().config.server.max_body_bytes)
        async with trio.open_nursery() as own:
            await own.start(trio.serve_listeners, server.serve_connection, listeners)
            logger.info("endpoint picker listening on %s (gRPC, ext_proc)", config.bind)
            task_status.started(listeners[0].socket.getsockname()[1])
            table = runtime().services.table
            while True:
                server.set_ready(ready())
                with trio.move_on_after(READINESS_INTERVAL_S):  # or at once on a change
                    await table.wait_changed()
