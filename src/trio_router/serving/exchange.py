"""The proxy exchange: one proxied request, from its head to its last byte.

`ProxyExchange.run` reads the request (`intake`), routes it through admission and the policy,
tries engines until one answers (failover only while nothing has reached the client), and
streams the engine's answer back, relayed when it can be. The exchange owns what the request
leaves behind: its status, timings and bytes (metrics), the engine's health (outlier
ejection), its trace spans, and its access record, each written once however
the request ends.

The request runs in its own cancel scope. The server's disconnect hook (`DisconnectHook`)
cancels it when the client goes away, at any await: in the body, in the router's queue, while
the engine is awaited or its answer relayed; leaving the scope closes the engine's connection
(vLLM then aborts the generation), and the request is counted with status 499. No task per
request watches for that, and nothing below the exchange takes a "client gone" check.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from ..asgi import Message, Receive, Scope, Send
from ..discovery.outliers import Outliers
from ..errors import (
    BadRequestError,
    EngineFailedError,
    NoEngineError,
    RequestError,
    UnknownModelError,
)
from ..http import (
    ClientGoneError,
    EngineUnreachableError,
    LocalLimitError,
    Relay,
    RelayTarget,
    TransportError,
    UpstreamResponse,
    read_whole,
)
from ..kv.tokens import Tokenizer
from ..limits.local import Limits, Ticket
from ..limits.tenants import Tenant, Tenants
from ..metrics import NO_LABEL, Metrics
from ..routing.policy import Policy, RequestInfo, request_info
from ..table import Engine, RoutingTable
from ..tracing import Tracing
from .admission import Admission
from .disaggregation import (
    MAX_PREFILL_ANSWER_BYTES,
    PD_PATHS,
    Disaggregation,
    Roles,
    decode_body,
    prefill_body,
    transfer_params,
)
from .errors import (
    CLIENT_CLOSED,
    ENGINE_HEADER,
    MODEL_HEADER,
    PREFILL_ENGINE_HEADER,
    REQUEST_ID_HEADER,
    error_response,
    from_transport,
    http_date,
)
from .forms import FORM_PATHS, FormModel
from .intake import BodyBudget, BodyParser, Held, read_body, read_head
from .runtime import Settings
from .stored import (
    ResponseNotFoundError,
    holder,
    new_response_id,
    stored_response_id,
    with_request_id,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["ClientConnection", "DisconnectHook", "ProxyExchange", "Services"]

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("trio_router.access")  # one record per proxied request

# Response headers of the engine replaced by the router's own (the pool already dropped the
# hop-by-hop ones). The engine's Date passes through, as a gateway's should; the router dates
# only the answers it makes itself, or an engine's answer that came without one.
_RESPONSE_REPLACED: Final = frozenset(
    {ENGINE_HEADER, PREFILL_ENGINE_HEADER, MODEL_HEADER, REQUEST_ID_HEADER}
)
_FALLBACK_REASONS: Final = {"no_routable_engine": "no_engine"}  # else the error's code
MAX_REFUSAL_BYTES: Final = 64 * 1024  # an engine's 429/503 read whole while a fallback is left
# Which engines of a model a step may go to.
Step = Callable[[Roles], Sequence[Engine]]
_END_BODY: Final[Message] = {"type": "http.response.body", "body": b"", "more_body": False}
_USAGE: Final = re.compile(
    rb'"usage"\s*:\s*\{[^{}]*"prompt_tokens"\s*:\s*(\d+)[^{}]*'
    rb'"completion_tokens"\s*:\s*(\d+)'
)


class ClientConnection(RelayTarget, Protocol):
    """The client socket of the request being handled, as the server tells it: where a
    relayed body is written."""

    def writes_pending(self) -> bool: ...

    def hold_next(self) -> None: ...

    def write_with_next(self, data: bytes) -> None: ...


class DisconnectHook(Protocol):
    """Cancels a request's scope when its client goes away (the server's own detection)."""

    def arm(self, scope: trio.CancelScope) -> None: ...

    def disarm(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Services:
    """The router-wide collaborators of every exchange (built once by the app)."""

    table: RoutingTable
    admission: Admission
    outliers: Outliers
    metrics: Metrics
    tracing: Tracing | None
    relay: Relay | None
    client_socket: Callable[[], ClientConnection | None]
    bodies: BodyBudget
    parser: BodyParser
    missing_model: Callable[[str], RequestError]
    new_request_id: Callable[[], bytes]
    tokenizer: Tokenizer  # a request's token ids, for the policies that route on them
    limits: Limits  # where a tenant's request is admitted and left ([limits] store)
    tenants: Tenants  # who a request is, by its key


def request_ids() -> Callable[[], bytes]:
    """Request ids for requests that came without one: this process's random prefix and a
    counter."""
    prefix, counter = secrets.token_hex(4).encode(), itertools.count(1)
    return lambda: b"%s-%d" % (prefix, next(counter))


@dataclass(frozen=True, slots=True)
class _Refusal:
    """An engine's 429 or 503, read whole: the client's answer if no fallback model takes
    the request."""

    engine: Engine
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class _Refused(Exception):
    """An engine refused the request (429, 503) while a fallback model is left."""

    def __init__(self, refusal: _Refusal) -> None:
        self.refusal = refusal


class _Failed(Exception):
    """An attempt ended the exchange with this error answered (or the response cut).
    `fallback`: the model could not take the request (no engine, the queue, every engine
    refused), so a fallback model may; `refused`: the last engine's refusal, answered
    instead of `error` when none does."""

    def __init__(
        self, error: RequestError, *, fallback: bool = False, refused: _Refusal | None = None
    ) -> None:
        self.error, self.fallback, self.refused = error, fallback, refused


class ProxyExchange:
    """One proxied request (see the module's docstring). Build one per request and `run` it
    in the request's task; every field is the request's own."""

    def __init__(
        self,
        services: Services,
        settings: Settings,
        scope: Scope,
        send: Send,
        hook: DisconnectHook | None,
    ) -> None:
        self._services, self._settings = services, settings
        self._scope, self._send, self._hook = scope, send, hook
        self.started = trio.current_time()
        self.request_id = ""  # decoded, for logs and records
        self._request_id = b""  # as sent on
        self.tenant_name = ""
        self.model = ""  # as the client asked for it
        self.served_model = ""  # the model it went to (what an alias names, or a fallback)
        self.model_label = NO_LABEL  # the metrics' label: client-chosen unknown names are not one
        self.engine = ""  # the engine that answered (or was tried last)
        self.prefill_engine = ""  # disaggregated: the engine that took the prefill step
        self.status = 0  # 0: no answer (cancelled: the drain deadline)
        self.attempts = 0  # engines tried
        self.sent = 0  # response body bytes handed on
        self.ttfb: float | None = None
        self._span: Span | None = None  # the server span, with tracing on
        self._ticket: Ticket | None = None  # admitted: left at the end
        self._method = scope["method"].encode()
        self._form: FormModel | None = None  # a form upload: where its model field is
        self._pinned: Engine | None = None  # the engine that holds the stored response
        self._name_responses = False  # /v1/responses: the router names the response
        self._refusable = False  # a fallback model is left: engines' 429/503 are not final

    async def run(self, receive: Receive) -> None:
        """Serve the request to its end. A cancellation from outside (the drain deadline)
        propagates; the client leaving ends it quietly with status 499."""
        tracing = self._services.tracing
        scope = self._scope
        if tracing is not None:
            self._span = tracing.start_request(scope["method"], scope["path"], scope["headers"])
        held = Held(self._services.bodies)
        try:
            with trio.CancelScope() as cancel:
                if self._hook is not None:
                    self._hook.arm(cancel)
                await self._serve(receive, held)
            if cancel.cancelled_caught:  # only the client leaving cancels this scope
                self.status = CLIENT_CLOSED
        finally:
            self._disarm()
            held.release()
            if self._ticket is not None:
                self._services.limits.leave(self._ticket)
            self._finish()

    def _disarm(self) -> None:
        """From now on the client leaving no longer cancels the request: its last message is
        about to go out (the server reports the end of every exchange as a disconnect too)."""
        if self._hook is not None:
            self._hook.disarm()
            self._hook = None

    async def _end(self, message: Message, client: ClientConnection | None = None) -> None:
        """Send the last message of the answer (with body bytes and `client`, the HTTP/1.1
        client connection, in one write with the end of the response)."""
        self._disarm()
        if client is not None and message["body"]:
            client.hold_next()
        await self._send(message)

    def _http11_client(self) -> ClientConnection | None:
        """The client connection, when it speaks HTTP/1.1 (bytes can then be written around
        the server and joined to its writes)."""
        if self._scope["http_version"] != "1.1":
            return None
        return self._services.client_socket()

    # -- intake -------------------------------------------------------------------------------
    async def _serve(self, receive: Receive, held: Held) -> None:
        """Read the request, route it, and go on to the next fallback model while the one
        before cannot take it."""
        services, settings = self._services, self._settings
        head = read_head(
            self._scope["headers"], services.new_request_id, settings.upstream_authorization
        )
        request_id = self._request_id = head.request_id
        self.request_id = request_id.decode(errors="replace")
        services.bodies.limit = settings.max_buffered_body_bytes
        body = None
        try:
            if head.invalid is not None:
                raise head.invalid
            tenant = services.tenants.authenticate(head.authorization)
            self.tenant_name = tenant.name
            body = await read_body(
                receive,
                head.content_length,
                settings.max_body_bytes,
                stall_s=settings.body_timeout,
                held=held,
            )
            if body is None:
                self.status = CLIENT_CLOSED  # the client left while sending
                return
            payload, chain = await self._intake(body)
            index = self._next_model(chain, -1)
            if index is None:
                raise self._missing(chain)
            for skipped in chain[:index]:  # no routable engine: the next model at once
                self._fell_back(skipped, chain[index], "no_engine", "no routable engine")
            payload, body = await self._as_model(chain[index], payload, body)
            info = self._route_info(payload)
            self._ticket = await services.limits.admit(tenant)
            info = await self._tokens_for(info, payload, head.authorization)
        except RequestError as exc:
            held.release()
            # Answered before the body was read: the connection cannot carry another one.
            await self._answer_error(exc, close=body is None)
            return
        target = self._scope["raw_path"]
        if query := self._scope["query_string"]:
            target += b"?" + query
        while True:
            self._refusable = self._next_model(chain, index) is not None
            try:
                await self._route(tenant, info, payload, target, head.headers, body, request_id)
                return
            except _Failed as failed:
                nxt = self._next_model(chain, index) if failed.fallback else None
                if nxt is None:
                    await self._answer_failure(failed)
                    return
                if failed.refused is not None:
                    reason = "engines_refused"
                else:
                    reason = _FALLBACK_REASONS.get(failed.error.code, failed.error.code)
                self._fell_back(chain[index], chain[nxt], reason, str(failed.error))
                index = nxt
            try:
                payload, body = await self._as_model(chain[index], payload, body)
                info = await self._tokens_for(
                    self._route_info(payload), payload, head.authorization
                )
            except RequestError as exc:
                await self._answer_error(exc)
                return

    def _fell_back(self, model: str, fallback: str, reason: str, why: str) -> None:
        logger.info(
            "request %s: model %s cannot take it (%s); fallback model %s",
            self.request_id,
            model,
            why,
            fallback,
        )
        self._services.metrics.model_fallback(model, fallback, reason)

    async def _intake(self, body: bytes | bytearray) -> tuple[dict[str, Any], tuple[str, ...]]:
        """What routing reads of the body (its JSON object, or a form's model field), and the
        models to try in order (the asked one, or what its alias names, then its fallbacks).
        A stored response's request goes to the engine that holds it, with no fallback."""
        services, settings, scope = self._services, self._settings, self._scope
        path = scope["path"]
        if (stored := stored_response_id(scope["method"], path)) is not None:
            pinned = holder(services.table, stored)
            if pinned is None:
                raise ResponseNotFoundError(
                    f"response {stored!r} is not found: it was not created through this router"
                )
            self._pinned = pinned
            model = next((m.id for m in pinned.models if m.parent is None), pinned.models[0].id)
            return {"model": model}, (model,)
        if path in FORM_PATHS:
            content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
            self._form = await services.parser.form(body, content_type)
            payload: dict[str, Any] = {"model": self._form.model}
        else:
            pd = settings.disaggregation
            payload = await services.parser.parse(
                body, model_only=not (settings.policy.needs_request_info or pd is not None)
            )
        self.model = asked = payload["model"]
        chain = settings.names.chain(asked)
        if path == "/v1/responses":
            previous = payload.get("previous_response_id")
            if isinstance(previous, str) and (pinned := holder(services.table, previous)):
                if chain[0] not in pinned.model_ids:
                    raise BadRequestError(
                        f"response {previous!r} is held by engine {pinned.name}, which does "
                        f"not serve model {chain[0]!r}"
                    )
                self._pinned, chain = pinned, chain[:1]
            self._name_responses = "request_id" not in payload
        return payload, chain

    def _next_model(self, chain: tuple[str, ...], index: int) -> int | None:
        """The index of the first model after `index` in `chain` that a routable engine
        serves (of the one pinned engine, when the request has one), or None."""
        table, pinned = self._services.table, self._pinned
        for i in range(index + 1, len(chain)):
            engines = table.routable(chain[i])
            if engines and (pinned is None or pinned in engines):
                return i
        return None

    def _missing(self, chain: tuple[str, ...]) -> RequestError:
        """The error for a request no model of `chain` has a routable engine for."""
        if self._pinned is not None:
            return NoEngineError(
                f"engine {self._pinned.name} does not serve model {chain[0]!r} right now"
            )
        error = self._services.missing_model(chain[0])
        if not isinstance(error, UnknownModelError):
            self.model_label = chain[0]  # clients choose unknown names: those get no label
        if len(chain) > 1:
            error.args = (f"{error} (nor its fallbacks: {', '.join(chain[1:])})",)
        return error

    async def _as_model(
        self, model: str, payload: dict[str, Any], body: bytes | bytearray
    ) -> tuple[dict[str, Any], bytes | bytearray]:
        """The request for `model`: unchanged when it names it, else its "model" rewritten
        (the JSON member, or the form's field)."""
        self.served_model = self.model_label = model
        if payload["model"] == model:
            return payload, body
        if (form := self._form) is not None:
            self._form = FormModel(model, form.start, form.start + len(model.encode()))
            return {"model": model}, form.rewritten(body, model)
        return await self._services.parser.with_model(body, payload, model)

    def _route_info(self, payload: dict[str, Any]) -> RequestInfo:
        """What the policy may know of the request."""
        settings = self._settings
        if settings.policy.needs_request_info or settings.disaggregation is not None:
            return request_info(payload, self._scope["headers"], settings.config.routing)
        return RequestInfo(model=payload["model"])

    async def _tokens_for(
        self, info: RequestInfo, payload: dict[str, Any], authorization: bytes | None
    ) -> RequestInfo:
        """`info` with the prompt's token ids when the policy routes on them."""
        settings, pd = self._settings, self._settings.disaggregation
        needs_tokens = settings.policy.needs_tokens or (pd is not None and pd.needs_tokens)
        if needs_tokens and self._scope["path"] in PD_PATHS:  # what /tokenize renders
            return await self._with_tokens(info, payload, authorization)
        return info

    async def _route(
        self,
        tenant: Tenant,
        info: RequestInfo,
        payload: dict[str, Any],
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        request_id: bytes,
    ) -> None:
        """The request to an engine of the model it now names: the engine that holds its
        stored response, one of disaggregation's steps, or the policy's choice."""
        pd = self._settings.disaggregation
        if self._pinned is not None:
            await self._forward(
                tenant, info, target, headers, body, request_id, step=self._pinned_step
            )
        elif pd is None:
            await self._forward(tenant, info, target, headers, body, request_id)
        else:
            await self._disaggregated(pd, tenant, info, payload, target, headers, body, request_id)

    def _pinned_step(self, roles: Roles) -> Sequence[Engine]:
        return () if self._pinned is None else (self._pinned,)

    async def _with_tokens(
        self, info: RequestInfo, payload: dict[str, Any], authorization: bytes | None
    ) -> RequestInfo:
        """`info` with the prompt's token ids: from the router's own tokenizer when
        `routing.tokenizer_dir` names one and it can tell them, else asked of an engine under
        the tokenize deadline (unchanged when they cannot be had in time: the policy then
        routes without them)."""
        settings = self._settings
        if (local := settings.local_tokenizer) is not None:
            started = time.perf_counter()
            if (found := local.tokens(payload)) is not None:
                self._services.metrics.tokenized(time.perf_counter() - started)
                return dataclasses.replace(info, tokens=tuple(found))
        headers = []
        if (key := settings.upstream_authorization or authorization) is not None:
            headers.append((b"authorization", key))
        tokens = await self._services.tokenizer.tokens(
            settings.pool, payload, self._services.table.routable(self.served_model), headers
        )
        return info if tokens is None else dataclasses.replace(info, tokens=tuple(tokens))

    # -- attempts -----------------------------------------------------------------------------
    async def _forward(
        self,
        tenant: Tenant,
        info: RequestInfo,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        request_id: bytes,
        *,
        policy: Policy | None = None,
        step: Step | None = None,
        first: Engine | None = None,
    ) -> None:
        """Try engines until one answers: another after each that cannot be reached, up to
        `proxy.retries` more, and never once an engine has answered. `policy` (default: the
        routing policy) chooses among the engines `step` allows (default: all); `first`, when
        given, is the first engine to try, its admission slot already held."""
        tried: list[str] = []
        unreachable: EngineUnreachableError | None = None
        refused: _Refusal | None = None
        while True:
            if first is not None:
                engine, first = first, None
            else:
                try:
                    engine = await self._choose(tenant, info, tried, unreachable, policy, step)
                except _Failed as failed:
                    if refused is None:
                        raise
                    raise _Failed(failed.error, fallback=True, refused=refused) from None
            generation = engine.generation
            try:
                await self._attempt(engine, generation, target, headers, body, request_id)
                return
            except _Refused as exc:  # a fallback model is left: the next engine, then it
                tried.append(engine.uid)
                refused = exc.refusal
            except EngineUnreachableError as exc:
                self._services.outliers.report_unreachable(
                    engine, generation, str(exc), refused=exc.connect_failed
                )
                self._services.metrics.engine_unreachable(engine.name)
                tried.append(engine.uid)
                unreachable = exc
                if len(tried) > self._settings.retries:
                    raise _Failed(
                        EngineFailedError(
                            f"engine {engine.name} for model {self.served_model!r} could not be "
                            f"reached ({len(tried)} attempt(s)): {exc}",
                            status=502,
                            code="engine_unreachable",
                        )
                    ) from exc
            finally:
                self._services.admission.release(engine)

    async def _choose(
        self,
        tenant: Tenant,
        info: RequestInfo,
        tried: Collection[str],
        unreachable: EngineUnreachableError | None,
        policy: Policy | None = None,
        step: Step | None = None,
        *,
        phase: str = "",
    ) -> Engine:
        """An engine for the next attempt, its admission slot held; _Failed when there is none
        (every engine tried, the queue full or its wait over). `policy` (default: the routing
        policy) chooses among the engines `step` allows (default: all); `phase` "prefill"
        chooses the prefill step's engine."""
        services, model = self._services, self.served_model
        policy = policy if policy is not None else self._settings.policy
        if step is not None:  # the engines the step may not go to count as tried
            routable = services.table.routable(model)
            tried = [*tried, *Roles.others(routable, step(Roles.of(routable)))]
        why = ""

        def pick(exclude: Collection[str]) -> Engine:
            nonlocal why
            engine, why = policy.choose(services.table.routable(model), info, exclude=exclude)
            if info.tokens is not None and (decision := getattr(policy, "last_decision", None)):
                services.metrics.kv_prediction(engine.name, *decision)
            return engine

        try:
            engine = await services.admission.acquire(tenant, model, pick, tried=tried)
        except NoEngineError as exc:
            if unreachable is None:
                raise _Failed(exc, fallback=True) from exc
            raise _Failed(
                EngineFailedError(
                    f"no engine for model {model!r} could be reached after {self.attempts} "
                    f"attempt(s); last: {unreachable}",
                    status=502,
                    code="engine_unreachable",
                )
            ) from exc
        except RequestError as exc:  # the queue: full, or waited too long
            raise _Failed(exc, fallback=True) from exc
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s for %s (tenant %r): policy %s chose %s (excluded %s): %s",
                self.request_id,
                model,
                tenant.name,
                policy.name,
                engine.name,
                list(tried),
                why,
            )
        if phase:
            services.metrics.routed(policy.name, phase, engine.name)
            return engine
        services.metrics.routed(policy.name, "failover" if self.attempts else "first", engine.name)
        self.attempts += 1
        self.engine = engine.name
        return engine

    # -- prefill/decode disaggregation ----------------------------------------------------
    async def _disaggregated(
        self,
        pd: Disaggregation,
        tenant: Tenant,
        info: RequestInfo,
        payload: dict[str, Any],
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        request_id: bytes,
    ) -> None:
        """The request in two steps when it pays off: the decode engine chosen (its slot
        held), the prompt prefilled on a prefill engine, then the client's request with the
        prefill engine's `kv_transfer_params` to the decode engine, whose answer is the
        client's. Otherwise, or when the prefill step fails, one engine serves it whole."""
        services, metrics = self._services, self._services.metrics
        roles = Roles.of(services.table.routable(self.served_model))
        path = self._scope["path"]
        if (reason := pd.skip_reason(path, payload, roles)) is not None:
            metrics.pd_decision("direct", reason)
            await self._forward(tenant, info, target, headers, body, request_id, step=_whole)
            return
        decode = await self._choose(tenant, info, (), None, pd.decode_policy, _decode)
        try:
            reason = None
            if info.tokens is not None and pd.holds_most(decode, info.tokens):
                reason = "cached_on_decode"
            elif not [e for e in roles.prefill if e.uid != decode.uid]:
                reason = "same_engine"
            if reason is not None:
                metrics.pd_decision("direct", reason)
                sent: bytes | bytearray | None = body
            else:
                metrics.pd_decision("disaggregated", "")
                sent = await self._prefill(pd, tenant, info, payload, target, headers, body, decode)
        except BaseException:
            services.admission.release(decode)
            raise
        if sent is None:  # the prefill engine's answer went to the client
            services.admission.release(decode)
            return
        await self._forward(
            tenant,
            info,
            target,
            headers,
            sent,
            request_id,
            policy=pd.decode_policy,
            step=_decode,
            first=decode,
        )

    async def _prefill(
        self,
        pd: Disaggregation,
        tenant: Tenant,
        info: RequestInfo,
        payload: dict[str, Any],
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        decode: Engine,
    ) -> bytes | bytearray | None:
        """The prefill step on a prefill engine other than `decode`, under
        `disaggregation.prefill_timeout_s`. Returns the decode engine's body: the client's
        with the prefill engine's parameters, or `body` unchanged when the decode engine must
        prefill itself (no prefill engine free, the step failed, or its answer had no
        parameters; each counted as a fallback); None when the prefill engine refused the
        request (4xx) and that answer went to the client."""
        services, metrics, settings = self._services, self._services.metrics, self._settings
        timeout = pd.config.prefill_timeout_s
        deadline = trio.current_time() + timeout  # for the wait for a prefill engine
        engine = None
        why = f"none free within {timeout:g}s"
        with trio.move_on_at(deadline):
            try:
                engine = await self._choose(
                    tenant, info, [decode.uid], None, pd.prefill_policy, _prefill, phase="prefill"
                )
            except _Failed as failed:
                why = str(failed.error)
        if engine is None:
            logger.info(
                "request %s for %s: no prefill engine (%s); engine %s prefills itself",
                self.request_id,
                self.served_model,
                why,
                decode.name,
            )
            metrics.pd_fallback("no_prefill_engine")
            return body
        generation, started = engine.generation, trio.current_time()
        deadline = started + timeout  # the step's own: a wait in the queue is not its fault
        span = None
        if self._span is not None and services.tracing is not None:
            span, headers = services.tracing.start_attempt(
                self._span, engine.name, engine.url, 0, target, headers
            )
        status: int | None = None
        failure: str | None = "cancelled"
        answer, answer_headers = b"", []
        try:
            with trio.move_on_at(deadline) as step:
                async with settings.pool.request(
                    engine.url, b"POST", target, headers, prefill_body(payload)
                ) as response:
                    status, answer_headers = response.status, response.headers
                    answer = await read_whole(
                        response, MAX_PREFILL_ANSWER_BYTES, f"prefill engine {engine.name}"
                    )
            failure = None
            if step.cancelled_caught:
                failure = f"no answer within {timeout:g}s"
                reason = "prefill_timeout"
            elif status is not None and 400 <= status < 500:
                services.outliers.request_succeeded(engine)  # the request's fault, not its
            elif status != 200:
                failure, reason = f"answered {status}", "prefill_status"
            elif (params := transfer_params(answer)) is None:
                failure, reason = "no kv_transfer_params in its answer", "missing_params"
            else:
                services.outliers.request_succeeded(engine)
                self.prefill_engine = engine.name
                return decode_body(payload, params)
            if failure is not None and reason != "missing_params":  # it failed the step
                services.outliers.request_failed(engine, generation, f"prefill: {failure}")
        except EngineUnreachableError as exc:
            failure, reason = str(exc), "prefill_unreachable"
            services.outliers.report_unreachable(
                engine, generation, failure, refused=exc.connect_failed
            )
        except TransportError as exc:
            failure, reason = str(exc), "prefill_error"
            services.outliers.request_failed(engine, generation, f"prefill: {failure}")
        finally:
            services.admission.release(engine)
            metrics.pd_prefill(trio.current_time() - started)
            if span is not None and services.tracing is not None:
                services.tracing.end_attempt(span, status=status, error=failure)
        if failure is None and status is not None:  # a 4xx: the client's answer
            self.engine = engine.name
            metrics.pd_fallback("prefill_refused")
            await self._answer_buffered(status, answer_headers, answer, engine)
            return None
        logger.warning(
            "request %s for %s: prefill on engine %s failed (%s); engine %s prefills itself",
            self.request_id,
            self.served_model,
            engine.name,
            failure,
            decode.name,
        )
        metrics.pd_fallback(reason)
        return body

    async def _attempt(
        self,
        engine: Engine,
        generation: int,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        request_id: bytes,
    ) -> None:
        """One attempt at `engine`: the answer streamed back. EngineUnreachableError when the
        request never reached it (the caller may try another); _Failed for other failures."""
        services = self._services
        span = None
        failure: str | None = "cancelled"
        response: UpstreamResponse | None = None
        if self._span is not None and services.tracing is not None:
            span, headers = services.tracing.start_attempt(
                self._span, engine.name, engine.url, self.attempts, target, headers
            )
        if self._name_responses:
            body = with_request_id(body, new_response_id(engine))
        refusal = None
        try:
            async with self._settings.pool.request(
                engine.url, self._method, target, headers, body
            ) as response:
                if self._refusable and response.status in (429, 503):
                    what = f"engine {engine.name}'s {response.status} answer"
                    answer = await read_whole(response, MAX_REFUSAL_BYTES, what)
                    refusal = _Refusal(engine, response.status, response.headers, answer)
                else:
                    await self._respond(response, engine, request_id)
            failure = None
            self._record(engine, generation, response.status)
        except EngineUnreachableError as exc:
            failure = str(exc)
            raise
        except TransportError as exc:
            failure = str(exc)
            self._broken(engine, generation, exc, answered=response is not None)
        finally:
            if span is not None and services.tracing is not None:
                services.tracing.end_attempt(
                    span, status=response.status if response is not None else None, error=failure
                )
        if refusal is not None:
            logger.info(
                "request %s for %s: engine %s answered %d; a fallback model is left",
                self.request_id,
                self.served_model,
                engine.name,
                refusal.status,
            )
            raise _Refused(refusal)

    def _record(self, engine: Engine, generation: int, status: int) -> None:
        """An answer went out whole: the engine's figures and health."""
        engine.requests.record(self.ttfb, trio.current_time() - self.started, ok=status < 500)
        if status >= 500 and self._settings.eject_on_5xx:
            self._services.outliers.request_failed(engine, generation, f"answered {status}")
        else:
            self._services.outliers.request_succeeded(engine)

    def _broken(
        self, engine: Engine, generation: int, exc: TransportError, *, answered: bool
    ) -> None:
        """An attempt failed after the engine had the request (or the router could not open a
        connection, which is not the engine's fault). Before any byte of the answer: _Failed
        with what the client is told. After: the client's connection is cut (the answer
        cannot be ended cleanly), and the status counted is the error's."""
        if isinstance(exc, ClientGoneError):  # the relay found the client gone
            self.status = CLIENT_CLOSED
            return
        error = from_transport(exc)
        if not isinstance(exc, LocalLimitError):  # the router's own limits: not the engine's
            engine.requests.record(self.ttfb, trio.current_time() - self.started, ok=False)
            self._services.outliers.request_failed(engine, generation, str(exc))
        if not answered:
            raise _Failed(error) from exc
        logger.warning(
            "request %s for %s on engine %s broke off mid-response: %s",
            self.request_id,
            self.served_model,
            engine.name,
            exc,
        )
        self.status = error.status

    # -- the answer ---------------------------------------------------------------------------
    async def _respond(self, response: UpstreamResponse, engine: Engine, request_id: bytes) -> None:
        """Send the engine's answer to the client: its head, then its body as it comes. To an
        HTTP/1.1 client a chunked body is relayed (`_relay`): from its first byte when none
        came with the head (a stream before its first event), else after the first chunk,
        which then goes out with the head in one write."""
        services, send = self._services, self._send
        self.status = response.status
        echo = self._settings.names.echo(self.model, self.served_model)
        client = self._http11_client()
        at_hand = False  # the body's first bytes came with the head: one write for both
        if client is not None and response.at_hand():
            at_hand = True
            client.hold_next()
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": self._head(response.headers, engine, request_id, sized=echo is None),
            }
        )
        relay = services.relay if echo is None else None
        previous = chunk = b""
        ended = False  # the end of the response was sent
        if relay is not None and client is not None and not at_hand:
            tail = await self._relay(relay, response, client)
            if tail is not None:
                chunk, ended = tail, True
        if not ended:
            async for chunk in response:
                if self.ttfb is None:
                    self._first_byte(trio.current_time())
                ended = response.complete  # the last chunk ends the response
                if echo is not None:  # an alias: the engine's name for the model is not sent
                    chunk = echo.feed(chunk, final=ended)
                message = {"type": "http.response.body", "body": chunk, "more_body": not ended}
                await (self._end(message, client) if ended else send(message))
                self.sent += len(chunk)
                previous = chunk
                if relay is not None and client is not None and not ended:
                    tail = await self._relay(relay, response, client)
                    if tail is not None:
                        previous, chunk = b"", tail
                        ended = True
                        break
                    relay = None  # the general path, to the end
        if not ended:
            tail = b"" if echo is None else echo.feed(b"", final=True)
            await self._end({**_END_BODY, "body": tail} if tail else _END_BODY, client)
            self.sent += len(tail)
        if response.status == 200 and (usage := _usage(previous[-4096:] + chunk[-4096:])):
            services.metrics.tokens(self.served_model, *usage)

    def _first_byte(self, now: float) -> None:
        """The engine's first body bytes came (`now`): the time to first byte."""
        self.ttfb = now - self.started
        self._services.metrics.observe_ttfb(self.served_model, self.ttfb)

    def _head(
        self,
        headers: list[tuple[bytes, bytes]],
        engine: Engine,
        request_id: bytes,
        *,
        sized: bool = True,
    ) -> list[tuple[bytes, bytes]]:
        """The client's response headers from the engine's: the router's own replaced, a
        Date added when the engine sent none, the engines that served it and the model named.
        Not `sized`: the body is rewritten, its Content-Length left out."""
        out = []
        dated = False
        for header in headers:
            name = header[0]
            if name not in _RESPONSE_REPLACED and (sized or name != b"content-length"):
                out.append(header)
                dated = dated or name == b"date"
        if not dated:
            out.append((b"date", http_date()))
        out.append((ENGINE_HEADER, engine.name.encode()))
        out.append((MODEL_HEADER, self.served_model.encode()))
        if self.prefill_engine and self.prefill_engine != engine.name:
            out.append((PREFILL_ENGINE_HEADER, self.prefill_engine.encode()))
        out.append((REQUEST_ID_HEADER, request_id))
        return out

    async def _answer_buffered(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, engine: Engine
    ) -> None:
        """An engine's answer, read whole, to the client."""
        self.status = status
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": self._head(headers, engine, self._request_id),
            }
        )
        await self._end(
            {"type": "http.response.body", "body": body, "more_body": False},
            self._http11_client(),
        )
        self.sent += len(body)

    async def _relay(
        self, relay: Relay, response: UpstreamResponse, client: ClientConnection
    ) -> bytes | None:
        """The rest of the body relayed and the answer ended; the end of what was relayed
        (where a usage summary is), or None if this connection cannot be relayed to now. The
        head went out through the server, which frames the body as chunked (an HTTP/1.1
        client, no Content-Length): what follows can go around it."""
        if not response.relayable or client.writes_pending():
            return None
        first = self._first_byte if self.ttfb is None else None
        tail, relayed, held = await relay.relay(response, client, hold_last=True, on_first=first)
        self.sent += relayed
        if held:  # the read that ended the body: written with the response's end
            client.write_with_next(held)
        await self._end(_END_BODY)
        return tail

    # -- the end ------------------------------------------------------------------------------
    async def _answer_failure(self, failed: _Failed) -> None:
        """No engine (of any fallback model) took the request: the last engine's refusal
        when every engine refused it, else the error."""
        if (refusal := failed.refused) is not None:
            self.engine = refusal.engine.name
            await self._answer_buffered(
                refusal.status, refusal.headers, refusal.body, refusal.engine
            )
        else:
            await self._answer_error(failed.error)

    async def _answer_error(self, exc: RequestError, *, close: bool = False) -> None:
        self.status = exc.status
        logger.warning(
            "request %s for %s failed with %d: %s",
            self.request_id,
            self.model or "-",
            exc.status,
            exc,
        )
        self._disarm()
        await error_response(self._send, exc, self._request_id, self.engine, close=close)

    def _finish(self) -> None:
        """However the request ended: it is counted, traced and logged once."""
        duration = trio.current_time() - self.started
        engine = self.engine or NO_LABEL
        if self.status:
            self._services.metrics.observe_request(self.model_label, engine, self.status, duration)
        tracing = self._services.tracing
        if tracing is not None and self._span is not None:
            tracing.end_request(
                self._span,
                status=self.status,
                request_id=self.request_id,
                model=self.model,
                tenant=self.tenant_name,
                engine=self.engine,
                retries=max(0, self.attempts - 1),
            )
        if self._settings.access_log and access_logger.isEnabledFor(logging.INFO):
            self._log_access(duration)

    def _log_access(self, duration: float) -> None:
        """One access record: a line of text, or with `server.log_format = "json"` these
        fields in a JSON object."""
        scope = self._scope
        client = scope.get("client")
        fields = {
            "request_id": self.request_id,
            "method": scope["method"],
            "path": scope["path"],
            "tenant": self.tenant_name,
            "model": self.model,
            "served_model": self.served_model,
            "engine": self.engine,
            "prefill_engine": self.prefill_engine,
            "policy": self._settings.policy.name,
            "status": self.status,
            "duration_ms": round(duration * 1000, 2),
            "ttfb_ms": None if self.ttfb is None else round(self.ttfb * 1000, 2),
            "bytes": self.sent,
            "retries": max(0, self.attempts - 1),
            "client": f"{client[0]}:{client[1]}" if client else "",
        }
        access_logger.info(
            "%s %s %s %s %s -> %s %d in %.1f ms",
            fields["client"],
            self.request_id,
            scope["method"],
            scope["path"],
            _models_text(self.model, self.served_model),
            self.engine or "-",
            self.status,
            duration * 1000,
            extra={"fields": fields},
        )


def _models_text(asked: str, served: str) -> str:
    """The model of an access line: as asked, and the one that answered when another did."""
    if not served or served == asked:
        return asked or "-"
    return f"{asked or '-'}({served})"


def _whole(roles: Roles) -> Sequence[Engine]:
    return roles.whole


def _decode(roles: Roles) -> Sequence[Engine]:
    return roles.decode


def _prefill(roles: Roles) -> Sequence[Engine]:
    return roles.prefill


def _usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the `usage` summary at the end of an engine's answer
    (a JSON body, or a stream's last events), if it has one; only the last 4 KiB are read."""
    found = None
    for found in _USAGE.finditer(tail[-4096:]):  # noqa: B007 (the last one counts)
        pass
    return (int(found.group(1)), int(found.group(2))) if found is not None else None
