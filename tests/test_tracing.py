"""OpenTelemetry tracing: spans exported over OTLP/HTTP to a fake collector (a real HTTP
server on 127.0.0.1 that decodes the protobuf export requests), the client's trace continued,
the engine's request carrying the router's context. The SDK exports from its own thread, so
these tests run on the real clock."""

from __future__ import annotations

import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import hypercorn.config
import hypercorn.trio
import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from test_main import write_config
from trio_router.asgi import answer_lifespan
from trio_router.config import Config, TracingConfig
from trio_router.errors import ConfigError
from trio_router.server import check_keys
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router
from trio_router.testing.processes import open_process

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int  # 2 server, 3 client
    attributes: dict[str, Any]
    error: bool
    service: str


@dataclass
class Collector:
    """What an OTLP/HTTP collector received, span by span."""

    url: str = ""
    spans: list[Span] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)

    def receive(self, path: str, body: bytes) -> None:
        self.paths.append(path)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        Span(
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.name,
                            span.kind,
                            {a.key: _value(a.value) for a in span.attributes},
                            span.status.code == 2,
                            service,
                        )
                    )
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, count: int) -> list[Span]:
        while len(self.spans) < count:
            await self._changed.wait()
        return self.spans


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@asynccontextmanager
async def open_collector() -> AsyncIterator[Collector]:
    collector = Collector()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        collector.receive(scope["path"], body)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/x-protobuf"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        asgi: Any = app  # plain-dict ASGI typing, not hypercorn's TypedDicts
        (collector.url,) = await nursery.start(
            partial(hypercorn.trio.serve, asgi, config, mode="asgi")
        )
        yield collector
        nursery.cancel_scope.cancel()


def otel_env(collector: Collector) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "router-under-test",
    }


async def test_spans_reach_an_otlp_collector_continuing_the_clients_trace(tmp_path: Path) -> None:
    """The served process, tracing on: a request with a `traceparent` gives a server span in
    the client's trace and a client span for the engine attempt, whose context the engine
    receives."""
    engine = FakeEngine(tokens=2)
    with trio.fail_after(LIMIT):
        async with open_collector() as collector, open_fake_engines([engine]) as (engine_url,):
            config = write_config(
                tmp_path / "r.toml", engine_url, drain_s=1.0, extra="[tracing]\nenabled = true"
            )
            async with open_process("--config", str(config), env=otel_env(collector)) as (
                process,
                _,
                stderr,
            ):
                url = (await stderr.wait_for(r'Running on (http://[^ "]+)')).group(1)
                await stderr.wait_for(r"is routable")
                assert "tracing on" in stderr.text
                response = await _post(
                    url, {"traceparent": TRACEPARENT, "x-request-id": "traced-1"}
                )
                assert response[0] == 200
                spans = await collector.wait_for(2)
                process.send_signal(signal.SIGTERM)
                await process.wait()
    server, client = _server_and_client(spans)
    assert set(collector.paths) == {"/v1/traces"}
    assert server.trace_id == client.trace_id == TRACE_ID
    assert server.parent_id == CLIENT_SPAN_ID and client.parent_id == server.span_id
    assert server.service == "router-under-test"
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == "fake-model"
    assert server.attributes["trio_router.engine"] == engine_url.removeprefix("http://")
    assert server.attributes["trio_router.request_id"] == "traced-1"
    assert server.attributes["trio_router.retries"] == 0
    assert client.attributes["http.response.status_code"] == 200 and not client.error
    seen = engine.requests_to(CHAT)[-1]
    assert seen.header("traceparent") == f"00-{TRACE_ID}-{client.span_id}-01"


async def test_failover_gives_a_client_span_per_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that cannot be reached: its attempt span is an error, the next engine's
    attempt answers, both children of the one server span (a new trace: no traceparent)."""
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    with trio.fail_after(LIMIT):
        async with open_collector() as collector:
            for name, value in otel_env(collector).items():
                monkeypatch.setenv(name, value)
            monkeypatch.delenv("OTEL_SERVICE_NAME")
            async with open_router(engines, tracing=TracingConfig(enabled=True)) as router:
                router.stop_engine(0)  # still routable as far as the router knows
                statuses = [
                    (await router.client.post(CHAT, json=chat())).status_code for _ in range(2)
                ]
                assert statuses == [200, 200]
                spans = await collector.wait_for(5)  # 2 server spans, 3 attempts
    servers = [s for s in spans if s.kind == 2]
    failed_over = next(s for s in servers if s.attributes["trio_router.retries"] == 1)
    attempts = [s for s in spans if s.parent_id == failed_over.span_id]
    assert [a.attributes["trio_router.attempt"] for a in attempts] == [1, 2]
    assert attempts[0].error and "http.response.status_code" not in attempts[0].attributes
    assert not attempts[1].error and attempts[1].attributes["http.response.status_code"] == 200
    assert (
        attempts[0].attributes["trio_router.engine"] != attempts[1].attributes["trio_router.engine"]
    )
    assert all(s.service == "trio-router" for s in spans)  # no OTEL_SERVICE_NAME: ours
    assert len({s.trace_id for s in servers}) == 2  # each request its own new trace


async def test_without_tracing_the_clients_context_goes_to_the_engine_unchanged() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            await router.client.post(CHAT, json=chat(), headers={"traceparent": TRACEPARENT})
    assert engine.requests_to(CHAT)[-1].header("traceparent") == TRACEPARENT


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'",
        ),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
    ],
)
def test_unsupported_otel_settings_are_config_errors(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check-config (and starting) name the variable; with tracing off they are ignored."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_keys(Config())
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_keys(Config(tracing=TracingConfig(enabled=True)))


def _server_and_client(spans: list[Span]) -> tuple[Span, Span]:
    (server,) = [s for s in spans if s.kind == 2]
    (client,) = [s for s in spans if s.kind == 3]
    return server, client


async def _post(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(CHAT, json=chat(), headers=headers)
    return response.status_code, response.content


async def test_attempt_spans_of_pod_named_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines found through Kubernetes are named after their pods: the attempt span takes
    the address from the engine's URL, and every attempt gives its engine slot back."""
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_collector() as collector:
            for name, value in otel_env(collector).items():
                monkeypatch.setenv(name, value)
            async with open_router([engine], tracing=TracingConfig(enabled=True)) as router:
                (routed,) = router.table.routable("fake-model")
                routed.name = "vllm-7c9f-abcde"
                for _ in range(3):
                    response = await router.client.post(CHAT, json=chat())
                    assert response.status_code == 200
                assert routed.in_flight == 0
                spans = await collector.wait_for(6)
    attempts = [s for s in spans if s.kind == 3]
    host, port = router.engine_urls[0].removeprefix("http://").rsplit(":", 1)
    assert {(a.attributes["server.address"], a.attributes["server.port"]) for a in attempts} == {
        (host, int(port))
    }
    assert {a.attributes["trio_router.engine"] for a in attempts} == {"vllm-7c9f-abcde"}
