"""The ASGI application: dispatch only.

A POST to a proxied path, and a stored response's retrieval or cancellation, is a proxy
exchange (`exchange.run_exchange`: intake, routing, the engine's answer, everything it leaves
behind) of the request as data (`intake.Incoming`, built here from the ASGI scope), answered
through the writer the server built for the request (`answer.answer_of`), or, on a server
that builds none, through plain ASGI (`answer.open_asgi_answer`); every other
request goes to the admin endpoints (and GET /version asks the engines theirs); the lifespan
is answered; a WebSocket upgrade is refused. The app holds no tasks of its own (each request
runs in the task its server gives it) and no global state; `runtime` is swapped whole on a
reload, so a request keeps the runtime it started with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Final

from ..asgi import Receive, Scope, Send, answer_lifespan
from ..http import TransportError, fetch
from ..limits.tenants import Tenant
from ..table import Engine
from .admin import ADMIN_PATHS, PROXIED_PATHS, AdminEndpoints
from .answer import answer_of, open_asgi_answer
from .errors import error_body
from .exchange import run_exchange
from .intake import Incoming
from .names import ModelNames
from .runtime import Runtime
from .stored import stored_response_id

__all__ = ["PROXIED_PATHS", "RouterApp"]

logger = logging.getLogger(__name__)

VERSION_MAX_BYTES: Final = 4096


class RouterApp:
    """The ASGI callable, serving with `runtime` (swapped whole on a reload). `health` tells
    whether discovery is live and current (GET /health)."""

    def __init__(self, runtime: Runtime, *, health: Callable[[], tuple[bool, str, str]]) -> None:
        self.runtime = runtime
        services = runtime.services
        self._admin = AdminEndpoints(
            services.table,
            services.metrics,
            health,
            authenticate=self._authenticate,
            new_request_id=services.new_request_id,
            names=self._names,
            version_of=self._engine_version,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            rt = self.runtime
            path = scope["path"]
            if (
                scope["method"] == "POST"
                and (path in PROXIED_PATHS or (rt.proxy_unknown_paths and path not in ADMIN_PATHS))
            ) or stored_response_id(scope["method"], path) is not None:
                incoming = Incoming.of_scope(scope)
                if (answer := answer_of(scope)) is not None:
                    await run_exchange(incoming, receive, answer, rt)
                else:  # a server that builds no answer writer
                    async with open_asgi_answer(receive, send) as (answer, receive_body):
                        await run_exchange(incoming, receive_body, answer, rt)
            else:
                await self._admin(scope, send)
        elif kind == "lifespan":
            await answer_lifespan(receive, send)
        elif kind == "websocket":
            await _refuse_websocket(scope, receive, send)

    def _authenticate(self, authorization: bytes | None) -> Tenant:
        return self.runtime.services.tenants.authenticate(authorization)

    def _names(self) -> ModelNames:
        return self.runtime.names

    async def _engine_version(self, engine: Engine) -> str | None:
        """The version `engine`'s GET /version tells, or None (no answer, or not one)."""
        rt = self.runtime
        headers = []
        if rt.upstream_authorization is not None:
            headers.append((b"authorization", rt.upstream_authorization))
        try:
            status, body = await fetch(
                rt.pool, engine.url, b"/version", headers, max_bytes=VERSION_MAX_BYTES
            )
            version = json.loads(body).get("version") if status == 200 else None
        except (TransportError, ValueError, AttributeError) as exc:
            logger.debug("engine %s: no version: %s", engine.name, exc)
            return None
        return version if isinstance(version, str) and version else None


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """A WebSocket upgrade: the OpenAI API here is HTTP (streams are SSE). Answered with a 400
    that says so, where the server can send one, else refused (403)."""
    if (await receive())["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        body = error_body(
            "WebSocket is not supported: use HTTP (streaming answers are server-sent events)",
            type="invalid_request_error",
            code="websocket_not_supported",
        )
        await send(
            {
                "type": "websocket.http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1003})
