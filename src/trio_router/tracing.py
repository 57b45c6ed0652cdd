"""OpenTelemetry tracing of proxied requests (`[tracing] enabled = true`).

A server span per proxied request continues the client's `traceparent` (W3C trace context,
or whatever `OTEL_PROPAGATORS` names) and carries the model, tenant, engine, status and
retries; a client span per engine attempt is its child, and its context replaces the
client's in the request sent to the engine, so the engine's own spans join the trace.

The standard `OTEL_*` variables configure the SDK: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME`
(default `trio-router`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and its argument,
`OTEL_BSP_*` for batching. Spans are exported over OTLP/HTTP (protobuf) by the SDK's batch
processor in its own thread; `OTEL_TRACES_EXPORTER=console` prints them instead.

Nothing here is imported while tracing is off: the SDK is loaded by `open_tracing` only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import urlsplit

from .config import TracingConfig
from .errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger(__name__)

SERVICE_NAME: Final = "trio-router"
EXPORTERS: Final = ("otlp", "console", "none")
PROTOCOL: Final = "http/protobuf"
# Trace context headers the client sent: replaced by the router's own in engine requests.
CONTEXT_HEADERS: Final = frozenset({b"traceparent", b"tracestate", b"baggage"})
FLUSH_S: Final = 5.0  # at exit: longest wait for the last spans to be exported


def check_environment(config: TracingConfig, environ: dict[str, str] | None = None) -> None:
    """Raise ConfigError, as starting would, if the OTEL_* variables ask for what is not
    supported (another protocol than OTLP/HTTP protobuf, an unknown exporter)."""
    if not config.enabled:
        return
    env = os.environ if environ is None else environ
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip() or "otlp"
    if exporter not in EXPORTERS:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={exporter!r} is not supported with "
            f"[tracing] enabled: use one of {list(EXPORTERS)}"
        )
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if (protocol := env.get(name, "").strip()) and protocol != PROTOCOL:
            raise ConfigError(
                f"{name}={protocol!r} is not supported: trio_router exports "
                f"spans over OTLP/HTTP ({PROTOCOL!r})"
            )
        if protocol:
            break


class RequestFacts(Protocol):
    """What the server span of a proxied request reports of it, once it has ended (its
    record: `serving.record.ExchangeRecord`)."""

    @property
    def status(self) -> int:
        """The answer's status; 0 when none was given (cancelled: the drain deadline)."""
        ...

    @property
    def request_id_text(self) -> str: ...

    @property
    def model(self) -> str:
        """The model as the client asked for it ("": not known)."""
        ...

    @property
    def tenant(self) -> str: ...

    @property
    def engine(self) -> str:
        """The engine that answered, or was tried last ("": none)."""
        ...

    @property
    def retries(self) -> int:
        """Engines tried after the first."""
        ...

    @property
    def resumes(self) -> int:
        """Times another engine carried on an answer whose engine failed mid-answer."""
        ...


class Tracing:
    """Starts and ends the spans of proxied requests; owns the SDK's provider."""

    def __init__(self, provider: TracerProvider, tracer: Tracer) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._provider, self._tracer = provider, tracer
        self._propagator = propagate.get_global_textmap()
        self._in_context = trace.set_span_in_context
        self._server, self._client = SpanKind.SERVER, SpanKind.CLIENT
        self._status, self._error = Status, Status(StatusCode.ERROR)
        self._error_code = StatusCode.ERROR

    def start_request(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]]) -> Span:
        """The server span of a proxied request, a child of the client's trace context."""
        parent = self._propagator.extract(
            {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
        )
        return self._tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self._server,
            attributes={"http.request.method": method, "url.path": path},
        )

    def end_request(self, span: Span, facts: RequestFacts) -> None:
        """End the server span of a proxied request with what its record reports of it."""
        status = facts.status
        attributes: dict[str, Any] = {
            "http.response.status_code": status,
            "trio_router.request_id": facts.request_id_text,
            "trio_router.retries": facts.retries,
        }
        if resumes := facts.resumes:
            attributes["trio_router.resumes"] = resumes
        if model := facts.model:
            attributes["gen_ai.request.model"] = model
        if tenant := facts.tenant:
            attributes["trio_router.tenant"] = tenant
        if engine := facts.engine:
            attributes["trio_router.engine"] = engine
        if not status:  # no answer: the request was cancelled (the drain deadline)
            del attributes["http.response.status_code"]
        span.set_attributes(attributes)
        if status >= 500 or not status:
            span.set_status(self._error)
        span.end()

    def start_attempt(
        self,
        parent: Span,
        engine: str,
        url: str,
        attempt: int,
        target: bytes,
        headers: Iterable[tuple[bytes, bytes]],
    ) -> tuple[Span, list[tuple[bytes, bytes]]]:
        """A client span for one attempt (the `attempt`th) at the engine named `engine`
        (its pod name, or host:port) at base `url`, and the request headers for it: the
        client's trace context headers replaced by this span's."""
        path = target.partition(b"?")[0].decode("latin-1")
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 80
        span = self._tracer.start_span(
            f"POST {path}",
            context=self._in_context(parent),
            kind=self._client,
            attributes={
                "http.request.method": "POST",
                "url.path": path,
                "server.address": host,
                "server.port": port,
                "trio_router.engine": engine,
                "trio_router.attempt": attempt,
            },
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        out = [h for h in headers if h[0] not in CONTEXT_HEADERS]
        out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        return span, out

    def end_attempt(self, span: Span, *, status: int | None, error: str | None) -> None:
        """`status`: the engine's answer, None if none came; `error`: why the attempt
        failed, if it did."""
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_status(self._status(self._error_code, error))
        elif status is not None and status >= 500:
            span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Export the spans still batched (at most FLUSH_S), then stop. Blocking: call it in
        a worker thread."""
        self._provider.force_flush(int(FLUSH_S * 1000))
        self._provider.shutdown()


def open_tracing(config: TracingConfig) -> Tracing | None:
    """The tracer `config` asks for, or None when tracing is off. Raises ConfigError for
    unsupported OTEL_* settings."""
    if not config.enabled:
        return None
    check_environment(config)
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip() == "none":
        logger.info("[tracing] is enabled but OTEL_TRACES_EXPORTER=none: no spans")
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    from ._version import __version__

    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    exporter: SpanExporter
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip() == "console":
        exporter, target = ConsoleSpanExporter(), "stdout"
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter, target = OTLPSpanExporter(), _otlp_endpoint(os.environ)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    logger.info(
        "tracing on: spans of proxied requests go to %s as service %r",
        target,
        resource.attributes["service.name"],
    )
    return Tracing(provider, provider.get_tracer("trio_router", __version__))


def _otlp_endpoint(env: dict[str, str] | os._Environ[str]) -> str:
    """Where the OTLP/HTTP exporter sends spans, as the SDK resolves it (for the log)."""
    if traces := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
    return base.rstrip("/") + "/v1/traces"
