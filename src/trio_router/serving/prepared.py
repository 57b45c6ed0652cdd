"""A request made ready to route: `Prepared`, a frozen value, from the one intake the proxy
and the endpoint picker share.

The request comes as data (`intake.Incoming`: the proxy's from its ASGI scope, the picker's
from the gateway's exchange) and grows into frozen values as it is resolved: `take_in` reads
its head and authenticates its tenant (`Intake`); once its body is in, `resolve` gives it its
band and first-token deadline (`Urgency`), reads what routing needs of the body (the body's
JSON object, or a form upload's model field), the models to try in order (the one asked for, or
what its alias names, then its fallbacks; a stored response's request goes to the engine that
holds it, with no fallback), and the first of them a routable engine serves. `for_model`
makes the request for another model of its chain (its body's "model" rewritten): a new value,
the old one unchanged. With `admission.priority_to_engines`, the body's vLLM `priority` is set
from the request's band (minus it: vLLM runs a lower value first). `with_tokens` adds the
prompt's token ids when the policy routes on them (`tokens.TokenIds`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from ..errors import BadRequestError, NoEngineError, RequestError, UnknownModelError
from ..limits.tenants import Tenant
from ..routing.disaggregation import PD_PATHS
from ..routing.policy import RequestInfo, request_info
from ..routing.request import request_reads
from ..table import Engine, RoutingTable
from .admin import missing_model
from .admission import Urgency
from .forms import FORM_PATHS, FormModel
from .intake import SERVING_READS, Incoming, Reads, RequestHead, read_head
from .record import ExchangeRecord
from .runtime import Runtime
from .stored import ResponseNotFoundError, holder, stored_response_id
from .tokens import TOKENIZE_READS

__all__ = [
    "PRIORITY_PATHS",
    "Intake",
    "Prepared",
    "for_model",
    "next_model",
    "resolve",
    "take_in",
    "with_tokens",
]

# The vLLM requests that take a `priority` (its scheduler's, with --scheduling-policy
# priority): generation, responses and the pooling family (SageMaker's /invocations carries
# one of those).
PRIORITY_PATHS: Final = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/invocations",
    }
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Intake:
    """A request taken in: as it came, what its headers say, and its tenant (`take_in`)."""

    incoming: Incoming
    head: RequestHead
    tenant: Tenant


def take_in(incoming: Incoming, rt: Runtime, record: ExchangeRecord) -> Intake:
    """The request `incoming` taken in, the proxy's and the picker's alike: its head read
    (`intake.read_head`: its id, written to its record at once), its tenant authenticated.
    Raises RequestError: the head is not valid, or the key names no tenant."""
    head = read_head(incoming.headers, rt.services.new_request_id, rt.upstream_authorization)
    record.request_id = head.request_id
    if head.invalid is not None:
        raise head.invalid
    tenant = rt.services.tenants.authenticate(head.authorization)
    record.tenant = tenant.name
    return Intake(incoming, head, tenant)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to route to one model of its chain (see the module's docstring)."""

    intake: Intake  # as it came, its head and its tenant
    urgency: Urgency  # its band and first-token deadline in the router's queue
    method: bytes
    path: str  # as sent on: as it came (a continuation has its own)
    target: bytes  # the path and query as sent on: as the client sent them (likewise)
    body: bytes | bytearray  # for the model it names now
    payload: dict[str, Any]  # what routing reads of the body
    chain: tuple[str, ...]  # the models to try, in order
    index: int  # the model it names now: chain[index]
    info: RequestInfo  # what the policy may know of it
    refusable: bool = False  # a fallback model is left: an engine's 429/503 is not final
    pinned: Engine | None = None  # the engine that holds its stored response
    form: FormModel | None = None  # a form upload: where its model field is
    name_responses: bool = False  # /v1/responses: the router names the response

    @property
    def model(self) -> str:
        return self.chain[self.index]

    @property
    def tenant(self) -> Tenant:
        return self.intake.tenant

    @property
    def request_id(self) -> bytes:
        """As sent on: the client's, or one the router made."""
        return self.intake.head.request_id

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The headers to forward to the engine."""
        return self.intake.head.headers

    @property
    def authorization(self) -> bytes | None:
        """The client's, as sent."""
        return self.intake.head.authorization


def _urgency(rt: Runtime, intake: Intake, record: ExchangeRecord) -> Urgency:
    """The request's band and first-token deadline (its tenant's, as the client lowered or
    set them), written to its record."""
    admission, head = rt.services.admission, intake.head
    urgency = admission.urgency(intake.tenant, head.priority, head.deadline_s, since=record.started)
    record.priority, record.band = urgency.priority, admission.band_label(urgency.priority)
    return urgency


def next_model(table: RoutingTable, prepared: Prepared, after: int) -> int | None:
    """The index of the first model after `after` in the chain that a routable engine
    serves (the pinned engine, when the request has one), or None."""
    return _next_index(table, prepared.chain, prepared.pinned, after)


def _next_index(
    table: RoutingTable, chain: tuple[str, ...], pinned: Engine | None, after: int
) -> int | None:
    for i in range(after + 1, len(chain)):
        engines = table.routable(chain[i])
        if engines and (pinned is None or pinned in engines):
            return i
    return None


async def resolve(
    intake: Intake, body: bytes | bytearray, rt: Runtime, record: ExchangeRecord
) -> Prepared:
    """The request taken in, whose body is `body`, with its rank in the queue, for the first
    model of its chain a routable engine serves (see the module's docstring). Raises
    RequestError: the client's answer (a body that is not valid, no engine for any model of
    its chain)."""
    urgency, incoming = _urgency(rt, intake, record), intake.incoming
    read = await _read(incoming, body, rt, record)
    index = _next_index(rt.services.table, read.chain, read.pinned, -1)
    if index is None:
        index = _waiting_room(read.chain, read.pinned, rt)
    if index is None:
        raise _missing(read.chain, read.pinned, rt, record)
    for skipped in read.chain[:index]:  # no routable engine: the next model at once
        fell_back(rt, record, skipped, read.chain[index], "no_engine", "no routable engine")
    asked = Prepared(
        intake=intake,
        urgency=urgency,
        method=incoming.method.encode(),
        path=incoming.path,
        target=incoming.target,
        body=body,
        payload=read.payload,
        chain=read.chain,
        index=index,
        info=RequestInfo(model=read.payload["model"]),  # for_model says what it is
        pinned=read.pinned,
        form=read.form,
        name_responses=read.name_responses,
    )
    return await for_model(asked, index, rt, record)


class _Read(NamedTuple):
    """What routing reads of a request's body."""

    payload: dict[str, Any]
    chain: tuple[str, ...]
    pinned: Engine | None = None
    form: FormModel | None = None
    name_responses: bool = False


async def _read(
    incoming: Incoming, body: bytes | bytearray, rt: Runtime, record: ExchangeRecord
) -> _Read:
    """What routing reads of the body and the models to try (the model the client asked for
    recorded)."""
    services, path = rt.services, incoming.path
    if (stored := stored_response_id(incoming.method, path)) is not None:
        pinned = holder(services.table, stored)
        if pinned is None:
            raise ResponseNotFoundError(
                f"response {stored!r} is not found: it was not created through this router"
            )
        model = next((m.id for m in pinned.models if m.parent is None), pinned.models[0].id)
        record.model = model
        return _Read({"model": model}, (model,), pinned)
    form = None
    if path in FORM_PATHS:
        content_type = next((v for k, v in incoming.headers if k == b"content-type"), None)
        form = await services.parser.form(body, content_type)
        payload: dict[str, Any] = {"model": form.model}
    else:
        payload = await services.parser.parse(body, reads=_reads(rt, path))
    record.model = payload["model"]
    chain = rt.names.chain(payload["model"])
    if path != "/v1/responses":
        return _Read(payload, chain, form=form)
    pinned = None
    previous = payload.get("previous_response_id")
    if isinstance(previous, str) and (pinned := holder(services.table, previous)):
        if chain[0] not in pinned.model_ids:
            raise BadRequestError(
                f"response {previous!r} is held by engine {pinned.name}, which does not "
                f"serve model {chain[0]!r}"
            )
        chain = chain[:1]
    return _Read(payload, chain, pinned, form, name_responses="request_id" not in payload)


def _reads(rt: Runtime, path: str) -> Reads | None:
    """What routing reads of a large body on `path` (`intake.Reads`): what the serving
    path, the policy and the tokenizer read, and what `resume` reads of a stream it may
    carry on; all of it with disaggregation, whose prefill request is made of it."""
    if rt.disaggregation is not None:
        return None
    members = SERVING_READS
    if rt.needs_request_info:
        members |= request_reads(rt.config.routing)
    if rt.needs_tokens:
        members |= TOKENIZE_READS
    return Reads(members, streamed=rt.resume is not None and path in PD_PATHS)


def _waiting_room(chain: tuple[str, ...], pinned: Engine | None, rt: Runtime) -> int | None:
    """With no routable engine for any model of the chain: the index of its first model
    whose request waits for an engine (`Admission.waits_for`: a known model), or None."""
    if pinned is not None:  # its engine, and no other, holds what the request continues
        return None
    waits = rt.services.admission.waits_for
    return next((i for i, model in enumerate(chain) if waits(model)), None)


def _missing(
    chain: tuple[str, ...], pinned: Engine | None, rt: Runtime, record: ExchangeRecord
) -> RequestError:
    """The error for a request no model of its chain has a routable engine for."""
    if pinned is not None:
        return NoEngineError(f"engine {pinned.name} does not serve model {chain[0]!r} right now")
    error = missing_model(rt.services.table, chain[0])
    if not isinstance(error, UnknownModelError):
        record.model_label = chain[0]  # clients choose unknown names: those get no label
    if len(chain) > 1:
        error.args = (f"{error} (nor its fallbacks: {', '.join(chain[1:])})",)
    return error


def fell_back(
    rt: Runtime, record: ExchangeRecord, model: str, fallback: str, reason: str, why: str
) -> None:
    """The request goes on to `fallback`: logged and counted."""
    logger.info(
        "request %s: model %s cannot take it (%s); fallback model %s",
        record.request_id_text,
        model,
        why,
        fallback,
    )
    rt.services.metrics.model_fallback(model, fallback, reason)


async def for_model(
    prepared: Prepared, index: int, rt: Runtime, record: ExchangeRecord
) -> Prepared:
    """The request for the model `chain[index]`: its body's "model" rewritten (the JSON
    member, or the form's field) unless it names it already, its vLLM priority set when the
    router passes its band on, and what the policy may know of it."""
    model = prepared.chain[index]
    record.served_model = record.model_label = model
    payload, body, form = prepared.payload, prepared.body, prepared.form
    members: dict[str, Any] = {}
    if payload["model"] != model:
        if form is not None:
            body = form.rewritten(body, model)
            form = FormModel(model, form.start, form.start + len(model.encode()))
            payload = {"model": model}
        else:
            members["model"] = model
    band = prepared.urgency.priority
    if (
        rt.config.admission.priority_to_engines
        and form is None
        and prepared.path in PRIORITY_PATHS
        and payload.get("priority", 0) != -band
    ):
        members["priority"] = -band
    if members:
        payload, body = await rt.services.parser.with_members(body, payload, members)
    if rt.needs_request_info or rt.disaggregation is not None:
        info = request_info(payload, prepared.headers, rt.config.routing)
    else:
        info = RequestInfo(model=payload["model"])
    refusable = _next_index(rt.services.table, prepared.chain, prepared.pinned, index) is not None
    return dataclasses.replace(
        prepared,
        body=body,
        payload=payload,
        index=index,
        info=info,
        refusable=refusable,
        form=form,
    )


async def with_tokens(prepared: Prepared, rt: Runtime) -> Prepared:
    """`prepared` with the prompt's token ids when the policy (or disaggregation) routes on
    them and its path is one /tokenize renders; unchanged when they cannot be had in time
    (the policy then routes without them)."""
    if not rt.needs_tokens or prepared.path not in PD_PATHS:
        return prepared
    tokens = await rt.token_ids(prepared.payload, prepared.model, prepared.authorization)
    if tokens is None:
        return prepared
    return dataclasses.replace(prepared, info=dataclasses.replace(prepared.info, tokens=tokens))
