"""The router's own endpoints: GET /v1/models (and /v1/models/{id}), /engines, /health,
/metrics and /version, and the answers to a known path asked with the wrong method or an
unknown path."""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import trio

from .._version import __version__
from ..asgi import Scope, Send
from ..errors import AuthError, BadRequestError, NoEngineError, RequestError, UnknownModelError
from ..metrics import CONTENT_TYPE, Metrics
from ..table import Engine, EngineState, RoutingTable
from .errors import REQUEST_ID_HEADER, error_body, error_response, http_date, send_json
from .forms import FORM_PATHS
from .names import ModelNames

__all__ = [
    "ADMIN_PATHS",
    "PROXIED_PATHS",
    "UNAUTHENTICATED_PATHS",
    "AdminEndpoints",
    "missing_model",
]

logger = logging.getLogger(__name__)

ADMIN_PATHS: Final = frozenset({"/v1/models", "/engines", "/health", "/metrics", "/version"})
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

STATES: Final = tuple(state.value for state in EngineState)  # /engines?state=

# As vLLM's own server: only its /v1 paths ask for the key.
UNAUTHENTICATED_PATHS: Final = frozenset({"/health", "/metrics", "/version"})
VERSION_TIMEOUT_S: Final = 2.0  # GET /version waits this long for the engines' versions
VERSION_RETRY_S: Final = 60.0  # an engine that did not tell its version is asked again after
VERSIONS_AT_ONCE: Final = 32
# An engine's version, or None when it cannot tell (the engine's /version, under a deadline).
VersionOf = Callable[[Engine], Awaitable[str | None]]


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
        authenticate: Callable[[bytes | None], object],
        new_request_id: Callable[[], bytes],
        names: Callable[[], ModelNames],
        version_of: VersionOf,
    ) -> None:
        self._table, self._metrics, self._health = table, metrics, health
        self._authenticate = authenticate  # raises AuthError
        self._new_request_id = new_request_id
        self._names = names
        self._version_of = version_of
        # (uid, generation) -> (the version or None, when it was asked)
        self._versions: dict[tuple[str, int], tuple[str | None, float]] = {}
        self._models_key: tuple[int, ModelNames] | None = None
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
        if path in PROXIED_PATHS:
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
            await self._answer(send, path, model_id, request_id, scope["query_string"])

    def _engines(self, query: bytes) -> list[Engine]:
        """The engines `GET /engines?model=M&state=S` asks for (each filter optional, `state`
        one of EngineState's values); BadRequestError naming an unknown parameter or state."""
        model = state = None
        for name, value in urllib.parse.parse_qsl(query.decode("latin-1")):
            if name == "model":
                model = value
            elif name == "state":
                if value not in STATES:
                    raise BadRequestError(
                        f"state must be one of {', '.join(STATES)}, got {value!r}"
                    )
                state = EngineState(value)
            else:
                raise BadRequestError(f"/engines takes model and state, not {name!r}")
        return [
            engine
            for engine in self._table
            if (model is None or model in engine.model_ids)
            and (state is None or engine.state is state)
        ]

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

    async def _answer(
        self, send: Send, path: str, model_id: str | None, request_id: bytes, query: bytes
    ) -> None:
        rid = ((REQUEST_ID_HEADER, request_id),)
        if path == "/v1/models":
            await send_json(send, 200, self._models(), rid)
        elif model_id:
            await self._model(send, model_id, request_id)
        elif path == "/engines":
            try:
                chosen = self._engines(query)
            except BadRequestError as exc:
                await error_response(send, exc, request_id)
                return
            engines = [engine.describe() for engine in chosen]
            # msgspec: the table of a large fleet is encoded without building JSON in Python.
            await send_json(send, 200, msgspec.json.encode({"engines": engines}), rid)
        elif path == "/version":
            await send_json(send, 200, await self._version(), rid)
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
        for card in self._cards():
            if card.get("id") == model_id:
                body = json.dumps(card).encode()
                await send_json(send, 200, body, ((REQUEST_ID_HEADER, request_id),))
                return
        target = self._names().aliases.get(model_id, model_id)
        await error_response(send, missing_model(self._table, target), request_id)

    def _cards(self) -> list[dict[str, Any]]:
        """The model cards of routable engines, and one for each alias of a served model (its
        model's card under the alias's id)."""
        names = self._names()
        cards = []
        for model in self._table.models():
            card = model.as_openai()
            cards.append(card)
            cards += ({**card, "id": alias} for alias in names.aliases_of(model.id))
        return cards

    def _models(self) -> bytes:
        """GET /v1/models: the union over routable engines, rebuilt only after a change."""
        key = (self._table.version, self._names())
        if key != self._models_key:
            self._models_body = json.dumps({"object": "list", "data": self._cards()}).encode()
            self._models_key = key
        return self._models_body

    async def _version(self) -> bytes:
        """GET /version: the router's version, and how many routable engines run each
        version ("unknown": those that did not tell within VERSION_TIMEOUT_S). Each engine
        is asked once per generation (again after VERSION_RETRY_S when it did not tell)."""
        now = trio.current_time()
        engines = self._table.routable_engines()
        current = {(e.uid, e.generation) for e in engines}
        for key in [k for k in self._versions if k not in current]:
            del self._versions[key]
        ask = [
            e
            for e in engines
            if (known := self._versions.get((e.uid, e.generation))) is None
            or (known[0] is None and now - known[1] > VERSION_RETRY_S)
        ]
        if ask:
            limiter = trio.CapacityLimiter(VERSIONS_AT_ONCE)

            async def one(engine: Engine) -> None:
                async with limiter:
                    version = await self._version_of(engine)
                self._versions[engine.uid, engine.generation] = (version, now)

            with trio.move_on_after(VERSION_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    for engine in ask:
                        nursery.start_soon(one, engine)
            for engine in ask:  # no answer in time: asked again after VERSION_RETRY_S
                self._versions.setdefault((engine.uid, engine.generation), (None, now))
        counts: dict[str, int] = {}
        for engine in engines:
            known = self._versions.get((engine.uid, engine.generation))
            version = known[0] if known is not None and known[0] else "unknown"
            counts[version] = counts.get(version, 0) + 1
        return json.dumps(
            {"version": __version__, "engine_versions": dict(sorted(counts.items()))}
        ).encode()
