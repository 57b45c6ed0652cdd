"""The ASGI app called directly, with no server and no client socket (so it answers through
plain ASGI): dispatch, every error the router answers itself, how a failed exchange with an
engine maps to an answer, and a client leaving (`http.disconnect`). The router is built by
`server.open_router`, as the process builds it; engines are on the fake network (socket
pairs), so the exchange and its deadlines run on the autojump clock."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import pytest
import trio
import trio.testing

from trio_router import server
from trio_router._version import __version__
from trio_router.config import (
    AdmissionConfig,
    Config,
    DisaggregationConfig,
    ProxyConfig,
    ServerConfig,
)
from trio_router.errors import BadRequestError, EngineFailedError, OverloadedError
from trio_router.http import (
    ClientGoneError,
    EngineBrokeOffError,
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    LocalLimitError,
    MalformedResponseError,
)
from trio_router.metrics import Metrics
from trio_router.serving.admin import VERSION_RETRY_S, VERSION_TIMEOUT_S
from trio_router.serving.app import RouterApp
from trio_router.serving.errors import from_transport
from trio_router.table import Engine, Model, RoutingTable
from trio_router.testing.fake_network import CloseConnection, FakeNetwork, FakeReply, FakeRequest
from trio_router.testing.harness import sample

CHAT: Final = "/v1/chat/completions"
OK: Final = "10.0.0.1"  # answers every request
SILENT: Final = "10.0.0.2"  # never answers a POST
DOWN: Final = "10.0.0.3"  # refuses connections


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = json.loads(self.body)["error"]
        return error


@dataclass
class Bench:
    app: RouterApp
    table: RoutingTable
    metrics: Metrics
    network: FakeNetwork

    async def call(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: tuple[tuple[bytes, bytes], ...] = (),
        *,
        leave: trio.Event | None = None,
    ) -> Answer | None:
        """One request through the app; its answer, or None if it sent none. The client
        leaves (the server's `http.disconnect`) once `leave` is set."""
        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"content-length", b"%d" % len(body)), *headers],
            "client": ("127.0.0.1", 40000),
            "extensions": {},
        }
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            if leave is None:
                await trio.sleep_forever()
            else:
                await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        if not sent:
            return None
        head = sent[0]
        return Answer(
            head["status"],
            dict(head["headers"]),
            b"".join(m.get("body", b"") for m in sent[1:]),
        )

    async def chat(self, model: str = "m", **extra: Any) -> Answer:
        body = json.dumps({"model": model, "messages": [], **extra}).encode()
        answer = await self.call("POST", CHAT, body)
        assert answer is not None
        return answer


async def engine(request: FakeRequest) -> FakeReply:
    if request.host == DOWN:
        raise CloseConnection
    if request.path == "/version":
        if request.host == SILENT:
            await trio.sleep_forever()
        return FakeReply(200, b'{"version": "0.32.0"}', [("content-type", "application/json")])
    if request.method == "POST" and request.host == SILENT:
        await trio.sleep_forever()
    return FakeReply(200, b'{"ok": true}', [("content-type", "application/json")])


@asynccontextmanager
async def open_bench(
    hosts: tuple[str, ...] = (OK,), roles: tuple[str, ...] = (), **sections: Any
) -> AsyncIterator[Bench]:
    """The router as `server.open_router` builds it, engines `hosts` routable (serving model
    "m"), with `roles` (prefill/decode, in order) if given, its connections to engines on the
    fake network. `sections` update config sections."""
    config = Config()
    for name, values in sections.items():
        config = dataclasses.replace(config, **{name: values})
    table = RoutingTable()
    for i, host in enumerate(hosts):
        role = roles[i] if i < len(roles) else ""
        table.put(Engine(uid=f"uid-{i}", name=host, url=f"http://{host}:8000", role=role))
        table.mark_routable(f"uid-{i}", 0, [Model("m")])
    network = FakeNetwork(engine, refuses=lambda host: host == DOWN)
    async with (
        network.open(),
        server.open_router(config, table=table, connect=network.connect) as router,
    ):
        yield Bench(router.app, table, router.runtime.services.metrics, network)


def requests_total(bench: Bench, status: int, engine: str = "", model: str = "m") -> float:
    return sample(
        bench.metrics.render().decode(),
        "trio_router_requests_total",
        model=model,
        engine=engine,
        status=str(status),
    )


# -- dispatch ---------------------------------------------------------------------------------
async def test_dispatch_proxied_admin_unknown_and_wrong_method(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_bench() as bench:
        proxied = await bench.chat()
        models = await bench.call("GET", "/v1/models")
        wrong = await bench.call("GET", CHAT)
        unknown = await bench.call("GET", "/v2/nothing")
        post_admin = await bench.call("POST", "/engines")
    assert proxied.status == 200 and proxied.body == b'{"ok": true}'
    assert proxied.headers[b"x-trio-router-engine"] == OK.encode()
    assert b"x-request-id" in proxied.headers
    assert models is not None and [m["id"] for m in json.loads(models.body)["data"]] == ["m"]
    assert wrong is not None and (wrong.status, wrong.headers[b"allow"]) == (405, b"POST")
    assert unknown is not None and (unknown.status, unknown.error()["code"]) == (404, "not_found")
    assert post_admin is not None and post_admin.status == 405


async def test_version_waits_a_bounded_time_for_the_engines(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """GET /version: the router's version and its engines', asked of each engine once per
    generation; one that does not answer within VERSION_TIMEOUT_S is "unknown", asked again
    after VERSION_RETRY_S."""
    async with open_bench(hosts=(OK, SILENT, DOWN)) as bench:
        times, answers = [], []
        for wait in (0.0, 1.0, VERSION_RETRY_S + 1):
            await trio.sleep(wait)
            start = trio.current_time()
            answer = await bench.call("GET", "/version")
            times.append(trio.current_time() - start)
            assert answer is not None and answer.status == 200
            answers.append(json.loads(answer.body))
        bench.table.remove("uid-2")
        after_removal = await bench.call("GET", "/version")
    assert answers[0] == {
        "version": __version__,
        "engine_versions": {"0.32.0": 1, "unknown": 2},
    }
    assert answers[0] == answers[1] == answers[2]
    assert times == [VERSION_TIMEOUT_S, 0.0, VERSION_TIMEOUT_S]
    assert after_removal is not None
    assert json.loads(after_removal.body)["engine_versions"] == {"0.32.0": 1, "unknown": 1}


async def test_lifespan_and_websocket() -> None:
    async with open_bench() as bench:
        lifespan = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
        said: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return lifespan.pop(0)

        async def send(message: dict[str, Any]) -> None:
            said.append(message)

        await bench.app({"type": "lifespan"}, receive, send)
        lifespan = [{"type": "websocket.connect"}]
        await bench.app(
            {"type": "websocket", "extensions": {"websocket.http.response": {}}}, receive, send
        )
    assert [m["type"] for m in said] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
        "websocket.http.response.start",
        "websocket.http.response.body",
    ]
    assert said[2]["status"] == 400 and b"websocket_not_supported" in said[3]["body"]


# -- the errors the router answers itself -----------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "bad_request"),
        (b"[1]", 400, "bad_request"),
        (b'{"messages": []}', 400, "bad_request"),
        (b'{"model": "nope"}', 404, "model_not_found"),
    ],
)
async def test_a_request_the_router_refuses_gets_an_openai_error(
    body: bytes, status: int, code: str
) -> None:
    async with open_bench() as bench:
        answer = await bench.call("POST", CHAT, body)
    assert answer is not None and answer.status == status
    assert answer.error()["code"] == code and answer.headers[b"content-type"] == (
        b"application/json"
    )
    assert requests_total(bench, status, model="") == 1  # counted, with no model label


async def test_a_known_model_without_a_routable_engine_is_503_with_retry_after() -> None:
    async with open_bench() as bench:
        bench.table.mark_failed("uid-0", 0, "probe failed", eject=True)
        answer = await bench.chat()
    assert (answer.status, answer.error()["code"]) == (503, "no_routable_engine")
    assert answer.headers[b"retry-after"] == b"1"


async def test_missing_key_is_401_and_an_oversized_body_is_413_closing_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLIENT_KEY", "secret")
    server = ServerConfig(api_key_env="CLIENT_KEY", max_body_bytes=100)
    async with open_bench(server=server) as bench:
        missing = await bench.chat()
        big = await bench.call("POST", CHAT, b"x" * 200, ((b"authorization", b"Bearer secret"),))
    assert (missing.status, missing.error()["code"]) == (401, "invalid_api_key")
    assert missing.headers[b"www-authenticate"] == b"Bearer"
    assert big is not None and (big.status, big.error()["code"]) == (413, "body_too_large")
    assert big.headers[b"connection"] == b"close"  # its body was not read


# -- engine failures --------------------------------------------------------------------------
def test_transport_errors_map_to_what_a_client_is_told() -> None:
    answers = {
        kind.__name__: from_transport(kind("engine x: what happened"))
        for kind in (
            EngineUnreachableError,
            EngineTimeoutError,
            EngineBrokeOffError,
            MalformedResponseError,
            LocalLimitError,
            InvalidRequestError,
        )
    }
    assert {name: (a.status, a.code) for name, a in answers.items()} == {
        "EngineUnreachableError": (502, "engine_unreachable"),
        "EngineTimeoutError": (504, "engine_timeout"),
        "EngineBrokeOffError": (502, "bad_engine_response"),
        "MalformedResponseError": (502, "bad_engine_response"),
        "LocalLimitError": (503, "router_overloaded"),
        "InvalidRequestError": (400, "bad_request"),
    }
    assert isinstance(answers["EngineTimeoutError"], EngineFailedError)
    assert isinstance(answers["LocalLimitError"], OverloadedError)
    assert isinstance(answers["InvalidRequestError"], BadRequestError)
    with pytest.raises(ValueError, match="answered nothing"):
        from_transport(ClientGoneError("gone"))


async def test_an_unreachable_engine_fails_over_and_one_left_unreachable_is_502(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_bench((DOWN, OK), proxy=ProxyConfig(retries=1)) as bench:
        answers = [await bench.chat() for _ in range(2)]  # round robin starts at DOWN
        assert [a.status for a in answers] == [200, 200]
        down = bench.table.get("uid-0")
        assert down is not None and not down.routable  # ejected by the failed attempt
    room_off = AdmissionConfig(wait_for_engine=False)
    async with open_bench((DOWN,), proxy=ProxyConfig(retries=1), admission=room_off) as bench:
        answer = await bench.chat()
    assert (answer.status, answer.error()["code"]) == (502, "engine_unreachable")
    assert answer.headers[b"x-trio-router-engine"] == DOWN.encode()


async def test_a_request_whose_only_engine_is_unreachable_waits_for_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The waiting room: the engine refused the connection and was ejected; the request
    waits for an engine (none comes here) and ends 503 `no_engine` at the queue's bound."""
    async with open_bench((DOWN,), proxy=ProxyConfig(retries=1)) as bench:
        started = trio.current_time()
        answer = await bench.chat()
        waited = trio.current_time() - started
    assert (answer.status, answer.error()["code"]) == (503, "no_engine")
    assert waited == pytest.approx(AdmissionConfig().queue_timeout_s)
    assert answer.headers[b"retry-after"] == b"30"


async def test_a_silent_engine_is_504_at_the_read_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_bench((SILENT,), proxy=ProxyConfig(read_timeout_s=3.0)) as bench:
        started = trio.current_time()
        answer = await bench.chat()
        assert trio.current_time() - started == pytest.approx(3.0)
    assert (answer.status, answer.error()["code"]) == (504, "engine_timeout")
    assert requests_total(bench, 504, SILENT) == 1


async def test_a_prefill_step_past_its_deadline_is_given_up_for_the_decode_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pd = DisaggregationConfig(enabled=True, prefill_timeout_s=2.5)
    async with open_bench((SILENT, OK), ("prefill", "decode"), disaggregation=pd) as bench:
        started = trio.current_time()
        answer = await bench.chat()
        waited = trio.current_time() - started
        text = bench.metrics.render().decode()
        prefill = bench.table.get("uid-0")
    assert answer.status == 200
    assert answer.headers[b"x-trio-router-engine"] == OK.encode()
    assert waited == pytest.approx(2.5)  # the prefill deadline, not the read timeout
    assert sample(text, "trio_router_pd_fallbacks_total", reason="prefill_timeout") == 1
    assert prefill is not None and prefill.request_failures == 1  # the engine's failure


async def test_a_client_leaving_cancels_the_exchange(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Over plain ASGI, the server's `http.disconnect` after the body cancels the request
    while the engine is awaited: nothing is answered, the engine's connection is closed, and
    the request is counted as 499."""
    async with open_bench((SILENT,)) as bench:
        leave = trio.Event()
        body = json.dumps({"model": "m", "messages": []}).encode()
        async with trio.open_nursery() as nursery:

            async def request() -> None:
                assert await bench.call("POST", CHAT, body, leave=leave) is None

            nursery.start_soon(request)
            await bench.network.wait_for(lambda: bench.network.open_now[SILENT] == 1)
            await trio.sleep(5)
            leave.set()
        await bench.network.wait_for(lambda: bench.network.open_now[SILENT] == 0)
        assert requests_total(bench, 499, SILENT) == 1
