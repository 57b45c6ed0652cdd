"""The router's own endpoints: GET /v1/models (and /v1/models/{id}), /engines, /health and
/metrics, and the answers to a known path asked with the wrong method or an unknown path."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Final

import msgspec

from ..asgi import Scope, Send
from ..errors import AuthError, NoEngineError, RequestError, UnknownModelError
from ..metrics import CONTENT_TYPE, Metrics
from ..table import RoutingTable
from .errors import REQUEST_ID_HEADER, error_body, error_response, http_date, send_json

__all__ = ["ADMIN_PATHS", "UNAUTHENTICATED_PATHS", "AdminEndpoints", "missing_model"]

ADMIN_PATHS: Final = frozenset({"/v1/models", "/engines", "/health", "/metrics"})
UNAUTHENTICATED_PATHS: Final = frozenset({"/health", "/metrics"})


def missing_model(table: RoutingTable, model: str) -> RequestError:
    """The error for a model no routable engine serves: 503 if one served it before, or if
    engines whose models are not known yet (not probed yet, or unreachable since they
    started) might; 404 only when every engine's models are known and none is it."""
    if table.is_known_model(model):
        return NoEngineError(f"no routable engine serves model {model!r} right now")
    if unknown := table.engines_with_unknown_models():
        return NoEngineError(
            f"no engine has confirmed model {model!r}: the models of {unknown} engine(s) "
            "are not known yet (not probed yet, or not reachable)"
        )
    return UnknownModelError(f"the model {model!r} does not exist")


class AdminEndpoints:
    """Answers every request that is not proxied."""

    def __init__(
        self,
        table: RoutingTable,
        metrics: Metrics,
        health: Callable[[], tuple[bool, str, str]],
        *,
        proxied: Collection[str],
        authenticate: Callable[[bytes | None], object],
        new_request_id: Callable[[], bytes],
    ) -> None:
        self._table, self._metrics, self._health = table, metrics, health
        self._proxied = proxied
        self._authenticate = authenticate  # raises AuthError
        self._new_request_id = new_request_id
        self._models_version = -1
        self._models_body = b""

    async def __call__(self, scope: Scope, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        request_id = authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-request-id":
                request_id = value
        if request_id is None:
            request_id = self._new_request_id()
        rid = ((REQUEST_ID_HEADER, request_id),)
        model_id = path.removeprefix("/v1/models/") if path.startswith("/v1/models/") else None
        if path in self._proxied:
            await self._wrong_method(send, path, b"POST", rid)
        elif path not in ADMIN_PATHS and not model_id:
            body = error_body(
                f"no such endpoint: {method} {path}",
                type="invalid_request_error",
                code="not_found",
            )
            await send_json(send, 404, body, rid)
        elif method not in ("GET", "HEAD"):
            await self._wrong_method(send, path, b"GET, HEAD", rid)
        else:
            if path not in UNAUTHENTICATED_PATHS:
                try:
                    self._authenticate(authorization)
                except AuthError as exc:
                    await error_response(send, exc, request_id)
                    return
            await self._answer(send, path, model_id, request_id)

    @staticmethod
    async def _wrong_method(
        send: Send, path: str, allowed: bytes, rid: tuple[tuple[bytes, bytes], ...]
    ) -> None:
        accepts = "POST" if allowed == b"POST" else "GET"
        body = error_body(
            f"{path} accepts only {accepts}",
            type="invalid_request_error",
            code="method_not_allowed",
        )
        await send_json(send, 405, body, [(b"allow", allowed), *rid])

    async def _answer(self, send: Send, path: str, model_id: str | None, request_id: bytes) -> None:
        rid = ((REQUEST_ID_HEADER, request_id),)
        if path == "/v1/models":
            await send_json(send, 200, self._models(), rid)
        elif model_id:
            await self._model(send, model_id, request_id)
        elif path == "/engines":
            engines = [engine.describe() for engine in self._table]
            # msgspec: the table of a large fleet is encoded without building JSON in Python.
            await send_json(send, 200, msgspec.json.encode({"engines": engines}), rid)
        elif path == "/health":
            ready, state, reason = self._health()
            routable = len(self._table.routable_engines())
            body = json.dumps({"status": state, "reason": reason, "routable_engines": routable})
            retry = () if ready else ((b"retry-after", b"5"),)
            await send_json(send, 200 if ready else 503, body.encode(), [*rid, *retry])
        else:
            body_bytes = self._metrics.render()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", CONTENT_TYPE),
                        (b"content-length", b"%d" % len(body_bytes)),
                        (b"date", http_date()),
                        *rid,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body_bytes})

    async def _model(self, send: Send, model_id: str, request_id: bytes) -> None:
        """GET /v1/models/{id} (the SDK's `models.retrieve`): one model of a routable engine,
        or an OpenAI-style 404 (503 while engines whose models are not known yet could
        serve it)."""
        for model in self._table.models():
            if model.id == model_id:
                body = json.dumps(model.as_openai()).encode()
                await send_json(send, 200, body, ((REQUEST_ID_HEADER, request_id),))
                return
        await error_response(send, missing_model(self._table, model_id), request_id)

    def _models(self) -> bytes:
        """GET /v1/models: the union over routable engines, rebuilt only after a change."""
        table = self._table
        if table.version != self._models_version:
            self._models_body = json.dumps(
                {"object": "list", "data": [m.as_openai() for m in table.models()]}
            ).encode()
            self._models_version = table.version
        return self._models_body
