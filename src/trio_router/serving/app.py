"""The ASGI application: dispatch only.

A POST to a proxied path, and a stored response's retrieval or cancellation, becomes a
`ProxyExchange` (intake, routing, the engine's answer, everything it leaves behind); every
other request goes to the admin endpoints (and GET /version asks the engines theirs); the lifespan
is answered; a WebSocket upgrade is refused. The app holds no tasks of its own (each request
runs in the task its server gives it) and no global state; `settings` is swapped whole on a
reload, so a request keeps the settings it started with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Final

from ..asgi import Receive, Scope, Send, answer_lifespan
from ..config import Config
from ..discovery.supervision import Supervisors
from ..http import Relay, TransportError, fetch
from ..kv.tokens import Tokenizer
from ..limits.local import Limits, LocalLimits
from ..limits.tenants import Tenant, Tenants
from ..metrics import Metrics
from ..table import Engine, RoutingTable
from ..tracing import Tracing
from .admin import ADMIN_PATHS, AdminEndpoints, missing_model
from .admission import Admission
from .errors import error_body
from .exchange import ClientConnection, DisconnectHook, ProxyExchange, Services, request_ids
from .forms import FORM_PATHS
from .intake import BodyBudget, BodyParser
from .names import ModelNames
from .runtime import Settings
from .stored import stored_response_id

__all__ = ["PROXIED_PATHS", "DisconnectHooks", "RouterApp", "no_disconnect_hook"]

logger = logging.getLogger(__name__)

# The POST endpoints routed by the model their body names (JSON, or a form for audio). Also
# routed: GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, to the engine that holds
# the response (`stored`).
PROXIED_PATHS: Final = FORM_PATHS | frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/v1/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/v1/messages",  # the Anthropic Messages API
        "/v1/messages/count_tokens",
        "/invocations",  # SageMaker
        "/pooling",
        "/classify",
        "/v2/rerank",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/render",
    }
)

VERSION_MAX_BYTES: Final = 4096

# The server's disconnect detection for one request's scope, or None where it has none.
DisconnectHooks = Callable[[Scope], DisconnectHook | None]


def no_disconnect_hook(scope: Scope) -> None:
    """For a server that gives no way to see a client leave while the app waits: the exchange
    then runs to its end."""
    return None


class RouterApp:
    """The ASGI callable. Built by `server.run` with every collaborator."""

    def __init__(
        self,
        *,
        settings: Settings,
        table: RoutingTable,
        supervisors: Supervisors,
        metrics: Metrics,
        health: Callable[[], tuple[bool, str, str]],
        admission: Admission,
        tenants: Tenants,
        relay: Relay | None = None,
        client_socket: Callable[[], ClientConnection | None] = lambda: None,
        disconnect_hook: DisconnectHooks = no_disconnect_hook,
        tracing: Tracing | None = None,
        tokenizer: Tokenizer | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.tenants = tenants
        new_request_id = request_ids()
        self._services = Services(
            table=table,
            admission=admission,
            outliers=supervisors.outliers,
            metrics=metrics,
            tracing=tracing,
            relay=relay,
            client_socket=client_socket,
            bodies=BodyBudget(settings.max_buffered_body_bytes),
            parser=BodyParser(),
            missing_model=lambda model: missing_model(table, model),
            new_request_id=new_request_id,
            tokenizer=tokenizer if tokenizer is not None else Tokenizer(timeout=0.1),
            limits=limits if limits is not None else LocalLimits(on_reject=metrics.rejected),
            tenants=tenants,
        )
        self._disconnect_hook = disconnect_hook
        self._admin = AdminEndpoints(
            table,
            metrics,
            health,
            proxied=PROXIED_PATHS,
            authenticate=self._authenticate,
            new_request_id=new_request_id,
            names=self._names,
            version_of=self._engine_version,
        )

    @property
    def config(self) -> Config:
        return self.settings.config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if (
                scope["method"] == "POST"
                and (
                    path in PROXIED_PATHS
                    or (self.settings.proxy_unknown_paths and path not in ADMIN_PATHS)
                )
            ) or stored_response_id(scope["method"], path) is not None:
                exchange = ProxyExchange(
                    self._services, self.settings, scope, send, self._disconnect_hook(scope)
                )
                await exchange.run(receive)
            else:
                await self._admin(scope, send)
        elif kind == "lifespan":
            await answer_lifespan(receive, send)
        elif kind == "websocket":
            await _refuse_websocket(scope, receive, send)

    def _authenticate(self, authorization: bytes | None) -> Tenant:
        return self.tenants.authenticate(authorization)

    def _names(self) -> ModelNames:
        return self.settings.names

    async def _engine_version(self, engine: Engine) -> str | None:
        """The version `engine`'s GET /version tells, or None (no answer, or not one)."""
        settings = self.settings
        headers = []
        if settings.upstream_authorization is not None:
            headers.append((b"authorization", settings.upstream_authorization))
        try:
            status, body = await fetch(
                settings.pool, engine.url, b"/version", headers, max_bytes=VERSION_MAX_BYTES
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
