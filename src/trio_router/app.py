"""The ASGI application: request routing, the proxy exchange, admin endpoints, errors -> HTTP.

`RouterApp` answers the lifespan protocol and every HTTP request. A proxied request is read
(bounded by `server.max_body_bytes`), its JSON parsed only to find `"model"` and what the policy
needs, sent to one routable engine through the `UpstreamPool`, and the engine's response is
streamed back chunk by chunk. The only place a `RouterError` becomes an HTTP response is here.

The hot path keeps to what it must do: one pass over the headers, one `json.loads`, one dict
lookup per metric, precomputed header bytes, and one access record per request at INFO
(`server.access_log`); other logging on it is at WARNING or debug level.
"""

from __future__ import annotations

import email.utils
import functools
import hmac
import itertools
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgspec
import trio

from .admission import Admission, Tenant
from .asgi import Message, Receive, Scope, Send, answer_lifespan
from .config import Config
from .errors import (
    AuthError,
    BadRequestError,
    BodyTooLargeError,
    NoEngineError,
    OverloadedError,
    QueueTimeoutError,
    RateLimitedError,
    RequestTimeoutError,
    RouterError,
    UnknownModelError,
    UpstreamError,
)
from .health import Supervisors
from .http11 import FIELD_VALUE_CHARS
from .metrics import CONTENT_TYPE, NO_LABEL, Metrics
from .policy import Policy, RequestInfo, request_info
from .table import Engine, RoutingTable
from .tracing import Tracing
from .upstream import (
    ClientGoneError,
    EngineUnreachableError,
    Relay,
    RelayTarget,
    UpstreamPool,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("trio_router.access")  # one record per proxied request


PROXIED_PATHS: Final = frozenset(
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
    }
)
ADMIN_PATHS: Final = frozenset({"/v1/models", "/engines", "/health", "/metrics"})
UNAUTHENTICATED_PATHS: Final = frozenset({"/health", "/metrics"})
MODEL_ONLY_POLICIES: Final = frozenset({"round_robin", "least_loaded"})  # no prompt rendering
LARGE_BODY_BYTES: Final = 1 << 20  # larger request bodies are parsed in a worker thread
LARGE_PARSES: Final = 2  # large bodies parsed at once, at most
CLIENT_CLOSED: Final = 499  # metrics status of a request whose client went away (nginx's code)

ENGINE_HEADER: Final = b"x-trio-router-engine"
REQUEST_ID_HEADER: Final = b"x-request-id"
# Response headers of the engine replaced by the router's own (the pool already dropped the
# hop-by-hop ones). The engine's Date passes through, as a gateway's should; the router dates
# only the answers it makes itself, or an engine's answer that came without one.
_RESPONSE_REPLACED: Final = frozenset({ENGINE_HEADER, REQUEST_ID_HEADER})
_JSON_HEADERS: Final = ((b"content-type", b"application/json"),)
_END_BODY: Final[Message] = {"type": "http.response.body", "body": b"", "more_body": False}


@dataclass(frozen=True, slots=True)
class Settings:
    """What a request reads from the config, precomputed (`runtime.build_runtime`). Swapped
    whole on a reload, so a request keeps the settings it started with."""

    config: Config
    policy: Policy
    pool: UpstreamPool
    retries: int
    max_body_bytes: int
    client_key: bytes | None  # the Bearer token clients must send, or None (no auth)
    upstream_authorization: bytes | None  # the Authorization value sent to engines, or None
    needs_request_info: bool  # the policy reads more of a request than its model
    body_timeout: float  # seconds a request body may stop arriving
    max_buffered_body_bytes: int  # request bodies held at once, in all
    eject_on_5xx: bool  # an engine's 5xx answer counts as a failed request
    access_log: bool  # an access record per proxied request (logger trio_router.access)


def error_body(message: str, *, type: str, code: str) -> bytes:
    """The OpenAI-style JSON error body."""
    return json.dumps({"error": {"message": message, "type": type, "code": code}}).encode()


DisconnectCheck = Callable[[Receive], Callable[[], bool] | None]


def no_disconnect_check(receive: Receive) -> None:
    """For a server that gives no way to see a client leave while the app waits: the exchange
    then runs to its end."""
    return None


class ClientConnection(RelayTarget, Protocol):
    """The client socket of the request being handled, as the server tells it
    (`connection.current_client`): where a relayed body is written."""

    def writes_pending(self) -> bool: ...


class RouterApp:
    """The ASGI callable. Built by `server.run` with every collaborator; holds no tasks of its
    own (each request runs in the task Hypercorn gives it) and no global state."""

    def __init__(
        self,
        *,
        settings: Settings,
        table: RoutingTable,
        supervisors: Supervisors,
        metrics: Metrics,
        health: Callable[[], tuple[bool, str, str]],
        relay: Relay | None = None,
        client_socket: Callable[[], ClientConnection | None] = lambda: None,
        disconnect_check: DisconnectCheck = no_disconnect_check,
        admission: Admission | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self._tracing = tracing
        self._admission = (
            admission
            if admission is not None
            else Admission(
                table,
                settings.config.admission,
                max_per_engine=settings.config.proxy.max_connections_per_engine,
            )
        )
        self._relay, self._client_socket = relay, client_socket
        self._disconnect_check = disconnect_check
        self._bodies = _BodyBudget(settings.max_buffered_body_bytes)
        self._parse_limiter = trio.CapacityLimiter(LARGE_PARSES)
        self._table, self._supervisors = table, supervisors
        self._metrics, self._health = metrics, health
        self._id_prefix = secrets.token_hex(4).encode()
        self._ids = itertools.count(1)
        self._models_version = -1
        self._models_body = b""

    # -- ASGI entry ----------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if scope["method"] == "POST" and scope["path"] in PROXIED_PATHS:
                if self._tracing is None:
                    await self._proxy(scope, receive, send, _Note())
                else:
                    await self._proxy_traced(self._tracing, scope, receive, send)
            else:
                await self._admin(scope, send)
        elif kind == "lifespan":
            await answer_lifespan(receive, send)
        elif kind == "websocket":
            await self._refuse_websocket(scope, receive, send)

    @staticmethod
    async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket upgrade: the OpenAI API here is HTTP (streams are SSE). Answered with a
        400 that says so, where the server can send one, else refused (403)."""
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

    # -- the proxy -----------------------------------------------------------------------
    async def _proxy_traced(
        self, tracing: Tracing, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """`_proxy` within a server span (ended however the request ends)."""
        note = _Note()
        note.span = tracing.start_request(scope["method"], scope["path"], scope["headers"])
        try:
            await self._proxy(scope, receive, send, note)
        finally:
            tracing.end_request(
                note.span,
                status=note.status,
                request_id=note.request_id,
                model=note.model,
                tenant=note.tenant,
                engine=note.engine,
                retries=max(0, note.attempts - 1),
            )

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, note: _Note) -> None:
        """Route one request and stream the engine's answer back; `note` gathers what the
        access record and the trace say of it. The client leaving (seen by polling the server's
        disconnect check while the engine is awaited) or a cancellation (the drain deadline)
        closes the engine connection."""
        started = trio.current_time()
        settings = self.settings
        request_id: bytes | None = None
        authorization: bytes | None = None
        content_length: bytes | None = None
        chunked = False
        bad_header: bytes | None = None
        headers: list[tuple[bytes, bytes]] = []
        for name, value in scope["headers"]:
            if value.translate(None, FIELD_VALUE_CHARS):
                bad_header = name
            if name == b"authorization":
                authorization = value
                continue  # replaced below
            if name == b"x-request-id":
                request_id = value
            elif name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                chunked = True
            headers.append((name, value))
        if request_id is None:
            request_id = b"%s-%d" % (self._id_prefix, next(self._ids))
            headers.append((REQUEST_ID_HEADER, request_id))
        note.request_id = request_id.decode(errors="replace")
        upstream_authorization = settings.upstream_authorization or authorization
        if upstream_authorization is not None:
            headers.append((b"authorization", upstream_authorization))

        model = NO_LABEL  # the metrics' label: client-chosen unknown names are not one
        body: bytes | bytearray | None = None
        self._bodies.limit = settings.max_buffered_body_bytes
        held = _Held(self._bodies)
        tenant: Tenant | None = None  # admitted: its admission is left at the end
        status, engine_name = 0, NO_LABEL  # 0: no answer (cancelled: the drain deadline)
        try:
            try:
                if chunked and content_length is not None:
                    # RFC 9112 §6.1: a request with both may be an attempt to smuggle another.
                    raise BadRequestError(
                        "a request must not have both Content-Length and Transfer-Encoding"
                    )
                if bad_header is not None:
                    raise BadRequestError(
                        f"header {bad_header.decode('latin-1')!r} has control characters in "
                        "its value"
                    )
                caller = self._authenticate(settings, authorization)
                note.tenant = caller.name
                body = await _read_body(
                    receive,
                    content_length,
                    settings.max_body_bytes,
                    stall_s=settings.body_timeout,
                    held=held,
                )
                if body is None:
                    status = CLIENT_CLOSED  # the client left while sending
                    return
                if len(body) > LARGE_BODY_BYTES:  # parsed in a worker thread
                    payload = await trio.to_thread.run_sync(
                        partial(_parse_large, body, model_only=not settings.needs_request_info),
                        limiter=self._parse_limiter,
                    )
                else:
                    payload = _parse(body)
                model = note.model = payload["model"]
                candidates = self._table.routable(model)
                if not candidates:
                    error = self._missing_model(model)
                    if isinstance(error, UnknownModelError):
                        model = NO_LABEL  # clients choose unknown names: no label
                    raise error
                info = (
                    request_info(payload, scope["headers"], settings.config.routing)
                    if settings.needs_request_info
                    else RequestInfo(model=model)
                )
                self._admission.admit(caller)
                tenant = caller
            except RouterError as exc:
                held.release()
                status = exc.status
                # Answered before the body was read: the connection cannot carry another one.
                await self._send_error(send, exc, request_id, close=body is None)
                return

            target = scope["raw_path"]
            if query := scope["query_string"]:
                target += b"?" + query
            status, engine_name = await self._forward(
                settings,
                send,
                self._disconnect_check(receive),
                scope["http_version"] == "1.1",
                tenant,
                model,
                candidates,
                info,
                target,
                headers,
                body,
                request_id,
                started,
                note,
            )
        finally:
            # However the request ended: the body budget and the admission are given back,
            # and the request is counted and logged once.
            held.release()
            if tenant is not None:
                self._admission.leave(tenant)
            duration = trio.current_time() - started
            if status:
                self._metrics.observe_request(model, engine_name, status, duration)
            note.status, note.engine = status, engine_name
            if settings.access_log and access_logger.isEnabledFor(logging.INFO):
                _log_access(scope, settings.policy.name, duration, note)

    async def _forward(
        self,
        settings: Settings,
        send: Send,
        client_gone: Callable[[], bool] | None,
        relay_ok: bool,
        tenant: Tenant,
        model: str,
        candidates: Sequence[Engine],
        info: RequestInfo,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        request_id: bytes,
        started: float,
        note: _Note,
    ) -> tuple[int, str]:
        """Try engines until one answers (at most `retries` more after the first unreachable
        one) and stream its response. Returns the status and engine for metrics (status 499
        when the client left: the engine's connection is closed then). An error after the
        response started cannot be reported: the client connection is cut instead (by
        returning without the final body message)."""
        table, policy, pool, admission = (
            self._table,
            settings.policy,
            settings.pool,
            self._admission,
        )
        tried: list[str] = []
        unreachable: EngineUnreachableError | None = None
        why = ""

        def pick(exclude: Collection[str]) -> Engine:
            nonlocal why
            engine, why = policy.choose(table.routable(model), info, exclude=exclude)
            return engine

        while True:
            try:
                engine = await admission.acquire(
                    tenant, model, pick, tried=tried, client_gone=client_gone
                )
            except NoEngineError as exc:
                return await self._fail(
                    send,
                    request_id,
                    exc
                    if unreachable is None
                    else UpstreamError(
                        f"no engine for model {model!r} could be reached after {len(tried)} "
                        f"attempt(s); last: {unreachable}"
                    ),
                    model,
                )
            except (RateLimitedError, QueueTimeoutError) as exc:
                return await self._fail(send, request_id, exc, model)
            except ClientGoneError:
                return CLIENT_CLOSED, NO_LABEL
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "request %s for %s (tenant %r): policy %s chose %s among %d "
                    "candidate(s) (excluded %s): %s",
                    request_id.decode(errors="replace"),
                    model,
                    tenant.name,
                    policy.name,
                    engine.name,
                    len(candidates),
                    tried,
                    why,
                )
            self._metrics.routed(policy.name, "failover" if tried else "first", engine.name)
            note.attempts = len(tried) + 1
            generation = engine.generation
            responded = False
            ttfb: float | None = None
            chunk = b""
            attempt: Span | None = None  # its client span, with tracing on
            failure: str | None = None
            sent_headers = headers
            try:
                if note.span is not None and self._tracing is not None:
                    attempt, sent_headers = self._tracing.start_attempt(
                        note.span, engine.name, engine.url, note.attempts, target, headers
                    )
                async with pool.request(
                    engine.url, b"POST", target, sent_headers, body, client_gone=client_gone
                ) as response:
                    responded = True
                    ended = False  # the end of the response was sent
                    out = []
                    dated = False
                    for header in response.headers:
                        name = header[0]
                        if name not in _RESPONSE_REPLACED:
                            out.append(header)
                            dated = dated or name == b"date"
                    if not dated:
                        out.append((b"date", http_date()))
                    out.append((ENGINE_HEADER, engine.name.encode()))
                    out.append((REQUEST_ID_HEADER, request_id))
                    status = response.status
                    await send({"type": "http.response.start", "status": status, "headers": out})
                    relay = self._relay if relay_ok else None
                    previous = b""
                    async for chunk in response:
                        if ttfb is None:
                            ttfb = trio.current_time() - started
                            self._metrics.observe_ttfb(model, ttfb)
                        ended = response.complete  # the last chunk ends the response
                        await send(
                            {"type": "http.response.body", "body": chunk, "more_body": not ended}
                        )
                        note.sent += len(chunk)
                        previous = chunk
                        if relay is not None and not ended:
                            # The head and the first chunk went out through the server,
                            # which frames the body as chunked; the rest can be relayed.
                            client = self._client_socket()
                            if (
                                client is not None
                                and response.relayable
                                and not client.writes_pending()
                            ):
                                chunk, relayed = await relay.relay(response, client, client_gone)
                                note.sent += relayed
                                ended = True
                                await send(_END_BODY)
                                break
                            relay = None  # the general path, to the end
                    if not ended:
                        await send(_END_BODY)
                    if status == 200 and (usage := _usage(previous[-4096:] + chunk[-4096:])):
                        self._metrics.tokens(model, *usage)
                note.ttfb = ttfb
                engine.requests.record(ttfb, trio.current_time() - started, ok=status < 500)
                if status >= 500 and settings.eject_on_5xx:
                    self._supervisors.request_failed(engine, generation, f"answered {status}")
                else:
                    self._supervisors.request_succeeded(engine)
                return status, engine.name
            except ClientGoneError:
                failure = "the client left"
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "request %s for %s on engine %s: the client left; engine connection closed",
                        request_id.decode(errors="replace"),
                        model,
                        engine.name,
                    )
                return CLIENT_CLOSED, engine.name
            except EngineUnreachableError as exc:
                failure = str(exc)
                if responded:  # cannot happen by the pool's contract; never resend then
                    raise
                self._supervisors.report_unreachable(
                    engine, generation, str(exc), refused=exc.connect_failed
                )
                self._metrics.engine_unreachable(engine.name)
                tried.append(engine.uid)
                unreachable = exc
                if len(tried) > settings.retries:
                    return await self._fail(
                        send,
                        request_id,
                        UpstreamError(
                            f"engine {engine.name} for model {model!r} could not be reached "
                            f"({len(tried)} attempt(s)): {exc}"
                        ),
                        model,
                        engine.name,
                    )
                candidates = table.routable(model)
            except OverloadedError as exc:  # the router's own limits: not the engine's fault
                failure = str(exc)
                return await self._fail(send, request_id, exc, model, engine.name)
            except RouterError as exc:
                failure = str(exc)
                engine.requests.record(ttfb, trio.current_time() - started, ok=False)
                self._supervisors.request_failed(engine, generation, str(exc))
                if not responded:
                    return await self._fail(send, request_id, exc, model, engine.name)
                logger.warning(
                    "request %s for %s on engine %s broke off mid-response: %s",
                    request_id.decode(errors="replace"),
                    model,
                    engine.name,
                    exc,
                )
                return exc.status, engine.name
            finally:
                admission.release(engine)
                if attempt is not None and self._tracing is not None:
                    self._tracing.end_attempt(
                        attempt, status=response.status if responded else None, error=failure
                    )

    @property
    def admission(self) -> Admission:
        return self._admission

    def _authenticate(self, settings: Settings, authorization: bytes | None) -> Tenant:
        """The tenant a request's key belongs to. With `[[tenants]]`, one of their keys (or
        `server.api_key_env`'s, for the anonymous tenant) is needed; with only
        `server.api_key_env`, that key; with neither, nothing. AuthError otherwise."""
        admission = self._admission
        if admission.tenants_configured:
            token = _bearer(authorization)
            if (tenant := admission.tenant_of_key(token)) is not None:
                return tenant
            if settings.client_key is None or not hmac.compare_digest(token, settings.client_key):
                raise AuthError("invalid API key")
        elif settings.client_key is not None:
            _check_key(settings.client_key, authorization)
        return admission.anonymous

    async def _fail(
        self, send: Send, request_id: bytes, exc: RouterError, model: str, engine: str = NO_LABEL
    ) -> tuple[int, str]:
        logger.warning(
            "request %s for %s failed with %d: %s",
            request_id.decode(errors="replace"),
            model,
            exc.status,
            exc,
        )
        await self._send_error(send, exc, request_id, engine)
        return exc.status, engine

    async def _send_error(
        self,
        send: Send,
        exc: RouterError,
        request_id: bytes | None,
        engine: str = NO_LABEL,
        *,
        close: bool = False,
    ) -> None:
        """The OpenAI-style error answer; names the engine when one had been chosen. `close`
        tells the client that the connection ends with it (its request body was not read)."""
        extra: list[tuple[bytes, bytes]] = [(b"connection", b"close")] if close else []
        if request_id is not None:
            extra.append((REQUEST_ID_HEADER, request_id))
        if engine != NO_LABEL:
            extra.append((ENGINE_HEADER, engine.encode()))
        if isinstance(exc, AuthError):
            extra.append((b"www-authenticate", b"Bearer"))
        if exc.headers:
            extra.extend(exc.headers)
        elif exc.status == 503:
            extra.append((b"retry-after", b"1"))
        await _send_json(
            send, exc.status, error_body(str(exc), type=exc.type, code=exc.code), extra
        )

    # -- admin endpoints -----------------------------------------------------------------
    async def _admin(self, scope: Scope, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        request_id = authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-request-id":
                request_id = value
        if request_id is None:
            request_id = b"%s-%d" % (self._id_prefix, next(self._ids))
        rid = ((REQUEST_ID_HEADER, request_id),)
        model_id = path.removeprefix("/v1/models/") if path.startswith("/v1/models/") else None
        if path in PROXIED_PATHS:
            await _send_json(
                send,
                405,
                error_body(
                    f"{path} accepts only POST",
                    type="invalid_request_error",
                    code="method_not_allowed",
                ),
                [(b"allow", b"POST"), *rid],
            )
            return
        if path not in ADMIN_PATHS and not model_id:
            await _send_json(
                send,
                404,
                error_body(
                    f"no such endpoint: {method} {path}",
                    type="invalid_request_error",
                    code="not_found",
                ),
                rid,
            )
            return
        if method not in ("GET", "HEAD"):
            await _send_json(
                send,
                405,
                error_body(
                    f"{path} accepts only GET",
                    type="invalid_request_error",
                    code="method_not_allowed",
                ),
                [(b"allow", b"GET, HEAD"), *rid],
            )
            return
        if path not in UNAUTHENTICATED_PATHS:
            try:
                self._authenticate(self.settings, authorization)
            except AuthError as exc:
                await self._send_error(send, exc, request_id)
                return
        if path == "/v1/models":
            await _send_json(send, 200, self._models(), rid)
        elif model_id:
            await self._model(send, model_id, request_id)
        elif path == "/engines":
            engines = [engine.describe() for engine in self._table]
            # msgspec encodes the table of 1,000 engines several times faster than json.
            await _send_json(send, 200, msgspec.json.encode({"engines": engines}), rid)
        elif path == "/health":
            ready, state, reason = self._health()
            routable = len(self._table.routable_engines())
            await _send_json(
                send,
                200 if ready else 503,
                json.dumps(
                    {"status": state, "reason": reason, "routable_engines": routable}
                ).encode(),
                [*rid, *(() if ready else ((b"retry-after", b"5"),))],
            )
        else:
            body = self._metrics.render()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", CONTENT_TYPE),
                        (b"content-length", b"%d" % len(body)),
                        (b"date", http_date()),
                        *rid,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})

    async def _model(self, send: Send, model_id: str, request_id: bytes) -> None:
        """GET /v1/models/{id} (the SDK's `models.retrieve`): one model of a routable engine,
        or an OpenAI-style 404 (503 while engines whose models are not known yet could
        serve it)."""
        for model in self._table.models():
            if model.id == model_id:
                await _send_json(
                    send,
                    200,
                    json.dumps(model.as_openai()).encode(),
                    ((REQUEST_ID_HEADER, request_id),),
                )
                return
        await self._send_error(send, self._missing_model(model_id), request_id)

    def _missing_model(self, model: str) -> RouterError:
        """The error for a model no routable engine serves: 503 if one served it before, or
        if engines whose models are not known yet (not probed yet, or unreachable since they
        started) might; 404 only when every engine's models are known and none is it."""
        table = self._table
        if table.is_known_model(model):
            return NoEngineError(f"no routable engine serves model {model!r} right now")
        if unknown := table.engines_with_unknown_models():
            return NoEngineError(
                f"no engine has confirmed model {model!r}: the models of {unknown} engine(s) "
                "are not known yet (not probed yet, or not reachable)"
            )
        return UnknownModelError(f"the model {model!r} does not exist")

    def _models(self) -> bytes:
        """GET /v1/models: the union over routable engines, rebuilt only after a change."""
        table = self._table
        if table.version != self._models_version:
            self._models_body = json.dumps(
                {"object": "list", "data": [m.as_openai() for m in table.models()]}
            ).encode()
            self._models_version = table.version
        return self._models_body


def http_date() -> bytes:
    """The Date header value for now (the wall clock, as HTTP wants), formatted once a
    second."""
    return _http_date_of(int(time.time()))


@functools.lru_cache(maxsize=2)
def _http_date_of(second: int) -> bytes:
    return email.utils.formatdate(second, usegmt=True).encode()


_USAGE: Final = re.compile(
    rb'"usage"\s*:\s*\{[^{}]*"prompt_tokens"\s*:\s*(\d+)[^{}]*'
    rb'"completion_tokens"\s*:\s*(\d+)'
)


def _usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the `usage` summary at the end of an engine's answer
    (a JSON body, or a stream's last events), if it has one; only the last 4 KiB are read."""
    found = None
    for found in _USAGE.finditer(tail[-4096:]):  # noqa: B007 (the last one counts)
        pass
    return (int(found.group(1)), int(found.group(2))) if found is not None else None


def _bearer(authorization: bytes | None) -> bytes:
    """The token of "Bearer <token>"; AuthError if there is none."""
    if authorization is None:
        raise AuthError("missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        raise AuthError("invalid API key")
    return token.strip()


def _check_key(expected: bytes, authorization: bytes | None) -> None:
    """Raise AuthError unless `authorization` is "Bearer <expected>" (constant-time)."""
    if authorization is None:
        raise AuthError("missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), expected):
        raise AuthError("invalid API key")


class _Note:
    """What the access record and the trace say of a proxied request."""

    __slots__ = (
        "attempts",
        "engine",
        "model",
        "request_id",
        "sent",
        "span",
        "status",
        "tenant",
        "ttfb",
    )

    def __init__(self) -> None:
        self.request_id = ""
        self.tenant = ""
        self.model = ""  # as the client asked for it
        self.engine = ""  # the engine that answered (or was tried last)
        self.status = 0  # 0: no answer (cancelled)
        self.attempts = 0  # engines tried
        self.sent = 0  # response body bytes handed on
        self.ttfb: float | None = None
        self.span: Span | None = None  # the server span, with tracing on


def _log_access(scope: Scope, policy: str, duration: float, note: _Note) -> None:
    """One access record: a line of text, or with `server.log_format = "json"` these fields
    in a JSON object."""
    client = scope.get("client")
    model, engine, status = note.model, note.engine, note.status
    fields = {
        "request_id": note.request_id,
        "method": scope["method"],
        "path": scope["path"],
        "tenant": note.tenant,
        "model": model,
        "engine": engine,
        "policy": policy,
        "status": status,
        "duration_ms": round(duration * 1000, 2),
        "ttfb_ms": None if note.ttfb is None else round(note.ttfb * 1000, 2),
        "bytes": note.sent,
        "retries": max(0, note.attempts - 1),
        "client": f"{client[0]}:{client[1]}" if client else "",
    }
    access_logger.info(
        "%s %s %s %s %s -> %s %d in %.1f ms",
        fields["client"],
        fields["request_id"],
        scope["method"],
        scope["path"],
        model or "-",
        engine or "-",
        status,
        duration * 1000,
        extra={"fields": fields},
    )


class _BodyBudget:
    """Bytes of request bodies held in memory at once, across all requests, at most
    `limit` (`server.max_buffered_body_bytes`): a request whose body would go beyond it gets
    503 instead, so many large bodies at once cannot exhaust memory."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0


class _Held:
    """The part of the body budget one request holds; `release()` gives it back."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: _BodyBudget) -> None:
        self._budget, self.size = budget, 0

    def grow(self, size: int) -> None:
        budget = self._budget
        if budget.used + size > budget.limit:
            raise OverloadedError(
                f"request bodies being handled already hold {budget.used} bytes; this one "
                f"would go beyond {budget.limit} (server.max_buffered_body_bytes)"
            )
        budget.used += size
        self.size += size

    def release(self) -> None:
        self._budget.used -= self.size
        self.size = 0


async def _read_body(
    receive: Receive, content_length: bytes | None, limit: int, *, stall_s: float, held: _Held
) -> bytes | bytearray | None:
    """The whole request body, or None if the client disconnected first. Raises
    BodyTooLargeError past `limit` (declared or counted), BadRequestError for a bad
    Content-Length, RequestTimeoutError when no part of it arrives for `stall_s` seconds, and
    OverloadedError when it would take the body budget past its limit (`held` records what
    it takes: all of a declared length at once, as it arrives otherwise)."""
    declared: int | None = None
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequestError(f"invalid Content-Length {content_length!r}") from None
        if declared > limit:
            raise BodyTooLargeError(
                f"request body of {declared} bytes exceeds the limit of "
                f"{limit} bytes (server.max_body_bytes)"
            )
        if declared < 0:
            raise BadRequestError(f"invalid Content-Length {content_length!r}")
        held.grow(declared)
    with trio.move_on_after(stall_s) as waited:
        message = await receive()
    if waited.cancelled_caught:
        raise RequestTimeoutError(
            f"the request body stopped arriving for {stall_s:g} s (server.request_body_timeout_s)"
        )
    if message["type"] != "http.request":
        return None
    first: bytes = message.get("body", b"")
    if len(first) > limit:
        raise BodyTooLargeError(
            f"request body exceeds the limit of {limit} bytes (server.max_body_bytes)"
        )
    if declared is None:
        held.grow(len(first))
    if not message.get("more_body", False):
        return first  # the common case: one message, no copy
    body = bytearray(first)
    while True:
        with trio.move_on_after(stall_s) as waited:
            message = await receive()
        if waited.cancelled_caught:
            raise RequestTimeoutError(
                f"the request body stopped arriving for {stall_s:g} s "
                "(server.request_body_timeout_s)"
            )
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if len(body) + len(chunk) > limit:
            raise BodyTooLargeError(
                f"request body exceeds the limit of {limit} bytes (server.max_body_bytes)"
            )
        if declared is None:
            held.grow(len(chunk))
        body += chunk  # grows in place: no second copy of a large body
        if not message.get("more_body", False):
            return body


class _ModelOnly(msgspec.Struct):
    model: str


def _parse_large(body: bytes | bytearray, *, model_only: bool) -> dict[str, Any]:
    """`_parse` for a large body, in a worker thread. When routing needs only the model, only
    that field is decoded (msgspec skips the rest without building it), so a 30 MB request
    costs no more than its bytes."""
    if not model_only:
        return _parse(body)
    try:
        model = _decode_model_only(body).model
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    except msgspec.ValidationError as exc:
        raise BadRequestError(f'request body has no "model" string: {exc}') from None
    if not model:
        raise BadRequestError('request body has no "model" string')
    return {"model": model}


_decode_model_only: Final = msgspec.json.Decoder(_ModelOnly).decode


def _parse(body: bytes | bytearray) -> dict[str, Any]:
    """The JSON object of a request; BadRequestError if it is not one or has no string model."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequestError(f"request body must be a JSON object, got {type(payload).__name__}")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError('request body has no "model" string')
    return payload


async def _send_json(
    send: Send, status: int, body: bytes, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *_JSON_HEADERS,
                (b"content-length", b"%d" % len(body)),
                (b"date", http_date()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
