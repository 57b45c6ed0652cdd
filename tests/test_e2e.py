"""End to end: the official openai SDK through the router, Kubernetes discovery feeding the
router (a wire-level fake API server), and Hypothesis-generated malformed requests against a
router in its own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, Final

import anthropic
import httpx
import openai
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_router import server
from trio_router.config import (
    Config,
    DiscoveryConfig,
    KubernetesConfig,
    ProbeConfig,
    ServerConfig,
    StatsConfig,
)
from trio_router.discovery.kubernetes import LIST_THREAD_NAME, WATCH_THREAD_NAME
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.harness import CHAT, LIMIT, chat, kubernetes_config, open_router


# -- the openai SDK ---------------------------------------------------------------------------
def use_sdk(url: str) -> dict[str, Any]:
    """What a typical script does with the synchronous SDK (run in a worker thread)."""
    out: dict[str, Any] = {}
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=LIMIT) as client:
        out["models"] = sorted(m.id for m in client.models.list())
        messages: Any = [{"role": "user", "content": "hi"}]
        chat_reply = client.chat.completions.create(model="base", messages=messages)
        out["chat"] = chat_reply.choices[0].message.content
        stream = client.chat.completions.create(
            model="lora-a", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        out["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        out["usage"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else None
        out["completion"] = client.completions.create(model="other", prompt="x").choices[0].text
        out["embedding"] = len(client.embeddings.create(model="base", input="x").data[0].embedding)
        out["response"] = client.responses.create(model="base", input="hi").output_text
        try:
            client.chat.completions.create(model="missing", messages=messages)
        except openai.NotFoundError as exc:
            out["missing"] = (exc.status_code, exc.code)
    return out


async def test_openai_sdk_through_the_router() -> None:
    engines = [
        FakeEngine(name="a", models=["base"], adapters={"lora-a": "base"}, tokens=3),
        FakeEngine(name="b", models=["base", "other"], tokens=3),
    ]
    with trio.fail_after(LIMIT):
        async with open_router(engines, wait_models=["base", "other", "lora-a"]) as router:
            out = await trio.to_thread.run_sync(use_sdk, router.url)
    assert out["models"] == ["base", "lora-a", "other"]
    assert out["chat"] == out["streamed"] == out["completion"] == "Hello from a"
    assert out["usage"] == 3
    assert out["embedding"] == 8
    assert out["response"] == "Hello from a"
    assert out["missing"] == (404, "model_not_found")
    assert [r.json()["model"] for r in engines[0].requests_to(CHAT) if r.json().get("stream")] == [
        "lora-a"
    ]  # only engine a serves the adapter


def use_anthropic_sdk(url: str) -> dict[str, Any]:
    """A Claude-compatible client: the Anthropic SDK's messages.create, whole and streamed,
    and count_tokens (run in a worker thread)."""
    out: dict[str, Any] = {}
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=LIMIT) as client:
        messages: Any = [{"role": "user", "content": "hi there"}]
        message = client.messages.create(model="chat", max_tokens=8, messages=messages)
        out["text"] = "".join(block.text for block in message.content if block.type == "text")
        out["model"], out["stop"] = message.model, message.stop_reason
        out["usage"] = (message.usage.input_tokens, message.usage.output_tokens)
        events = list(
            client.messages.create(model="chat", max_tokens=8, messages=messages, stream=True)
        )
        out["event_types"] = [e.type for e in events]
        out["streamed"] = "".join(
            e.delta.text
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "text_delta"
        )
        with client.messages.stream(model="chat", max_tokens=8, messages=messages) as stream:
            out["helper"] = stream.get_final_text()
        out["tokens"] = client.messages.count_tokens(model="chat", messages=messages).input_tokens
    return out


async def test_anthropic_sdk_through_the_router() -> None:
    engine = FakeEngine(tokens=3)
    with trio.fail_after(LIMIT):
        async with open_router([engine], routing={"aliases": {"chat": "fake-model"}}) as router:
            out = await trio.to_thread.run_sync(use_anthropic_sdk, router.url)
    assert out["text"] == out["streamed"] == out["helper"] == "Hello from a"
    assert out["model"] == "chat"  # the alias the client asked for, not the engine's name
    assert out["stop"] == "end_turn"
    assert out["usage"][1] == 3
    assert out["event_types"][0] == "message_start"
    assert out["event_types"][-1] == "message_stop"
    assert out["tokens"] == out["usage"][0] > 0
    assert {r.json()["model"] for r in engine.requests_to("/v1/messages")} == {"fake-model"}


# -- Kubernetes discovery into the router -----------------------------------------------------
def discovery_threads() -> list[str]:
    return [
        t.name for t in threading.enumerate() if t.name in (WATCH_THREAD_NAME, LIST_THREAD_NAME)
    ]


async def test_kubernetes_discovery_routes_to_pods_and_stops_at_deletion(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    # Two engine "pods" on 127.0.1.1 and 127.0.1.2, same port, as pods of a Deployment are.
    engines = [FakeEngine(name="pod-a"), FakeEngine(name="pod-b")]
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            url_a = await nursery.start(serve_fake_engine, engines[0], "127.0.1.1", 0)
            port = int(url_a.rsplit(":", 1)[1])
            await nursery.start(serve_fake_engine, engines[1], "127.0.1.2", port)
            apiserver.add_pod("pod-a", ip="127.0.1.1")
            apiserver.add_pod("pod-b", ip="127.0.1.2")
            config = Config(
                server=ServerConfig(bind="127.0.0.1:0"),
                discovery=DiscoveryConfig(
                    mode="kubernetes",
                    kubernetes=KubernetesConfig(
                        namespace=apiserver.namespace, port=port, kubeconfig=str(kubeconfig)
                    ),
                ),
                probe=ProbeConfig(interval_s=60.0),
                stats=StatsConfig(interval_s=0.0),
            )
            table = RoutingTable()
            async with trio.open_nursery() as router_nursery:
                (url,) = await router_nursery.start(
                    partial(server.run, config, table=table, handle_signals=False)
                )
                while len(table.routable("fake-model")) < 2:
                    await table.wait_changed()
                async with httpx.AsyncClient(base_url=url) as client:
                    await exercise_kubernetes_router(client, apiserver, table, engines)
                assert discovery_threads()  # the watch is running in its thread
                router_nursery.cancel_scope.cancel()
            # server.run has returned: its discovery threads have ended.
            assert discovery_threads() == []
            nursery.cancel_scope.cancel()


async def exercise_kubernetes_router(
    client: httpx.AsyncClient,
    apiserver: FakeApiServer,
    table: RoutingTable,
    engines: list[FakeEngine],
) -> None:
    names = {
        (await client.post(CHAT, json=chat())).headers["x-trio-router-engine"] for _ in range(4)
    }
    assert names == {"pod-a", "pod-b"}  # engines are named after their pods
    assert (await client.get("/health")).json()["status"] == "ok"
    metrics = (await client.get("/metrics")).text
    assert "trio_router_discovery_synced 1.0" in metrics

    apiserver.delete_pod("pod-a")
    while len(table.routable("fake-model")) != 1:
        await table.wait_changed()
    before = len(engines[0].requests_to(CHAT))
    for _ in range(4):
        response = await client.post(CHAT, json=chat())
        assert response.headers["x-trio-router-engine"] == "pod-b"
    assert len(engines[0].requests_to(CHAT)) == before


# -- malformed requests never get a 500 (Hypothesis) ------------------------------------------
SERVE_SCRIPT: Final = """
import sys
from functools import partial
import trio
from trio_router import server
from trio_router.config import (Config, DiscoveryConfig, ProbeConfig, RoutingConfig,
                                ServerConfig, StaticConfig, StatsConfig)
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine

async def main():
    async with trio.open_nursery() as engines:
        url = await engines.start(serve_fake_engine, FakeEngine(tokens=2), "127.0.0.1", 0)
        config = Config(
            server=ServerConfig(bind="127.0.0.1:0", max_body_bytes=4096, drain_s=1.0),
            discovery=DiscoveryConfig(mode="static", static=StaticConfig.from_urls([url])),
            routing=RoutingConfig(policy=sys.argv[1]),
            probe=ProbeConfig(interval_s=60.0), stats=StatsConfig(interval_s=0.0))
        table = RoutingTable()
        async with trio.open_nursery() as router:  # until SIGTERM has drained the router
            bound = await router.start(partial(server.run, config, table=table))
            while not table.routable("fake-model"):
                await table.wait_changed()
            print(bound[0], flush=True)
        engines.cancel_scope.cancel()

trio.run(main)
"""


@pytest.fixture(scope="module", params=["prefix_aware", "session"])
def fuzz_router(request: pytest.FixtureRequest) -> Iterator[str]:
    """A router and a fake engine in a subprocess, shared by every example; it must still be
    serving (and exit 0 on SIGTERM) after all of them."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, request.param],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://"), url
        yield url
        assert process.poll() is None, "the router died"
        assert httpx.get(f"{url}/health", timeout=LIMIT).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=LIMIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_model = st.sampled_from(["fake-model", "other"]) | _json
_request_object = st.fixed_dictionaries(
    {},
    optional={
        "model": _model,
        "messages": _json,
        "prompt": _json,
        "stream": _json,
        "user": _json,
        "max_tokens": _json,
        "input": _json,
        "tokens": _json,
        "documents": _json,
    },
)
_body = (
    st.binary(max_size=300)
    | _json.map(lambda v: json.dumps(v).encode())
    | _request_object.map(lambda v: json.dumps(v).encode())
    | st.builds(
        lambda n: b'{"model": "fake-model", "x": "' + b"y" * n + b'"}', st.integers(4000, 6000)
    )
)
_header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.strip
)
_header_name = st.sampled_from(
    [
        "authorization",
        "x-request-id",
        "x-session-id",
        "content-type",
        "accept",
        "connection",
        "te",
        "keep-alive",
        "upgrade",
        "proxy-authorization",
        "x-trio-router-engine",
        "cookie",
    ]
) | st.from_regex(r"\Ax-[a-z0-9-]{1,12}\Z")
_path = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/tokenize",
        "/score",
        "/v1/models",
        "/engines",
        "/nope",
        "/metrics",
    ]
)


@settings(max_examples=120, deadline=None)
@given(
    path=_path,
    body=_body,
    headers=st.dictionaries(_header_name, _header_value, max_size=5),
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
)
def test_malformed_requests_never_get_a_500(
    fuzz_router: str, path: str, body: bytes, headers: dict[str, str], method: str
) -> None:
    response = httpx.request(
        method, fuzz_router + path, content=body, headers=headers, timeout=LIMIT
    )
    from_engine = "x-fake-engine" in response.headers  # an engine's own answer passes through
    assert response.status_code < 500 or from_engine, response.text
    if not from_engine and response.status_code >= 400:
        assert response.headers["content-type"] == "application/json"
        assert "error" in response.json()


async def test_an_api_outage_leaves_the_router_serving(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """The API server answers 503 for many times `stale_after_s`: `/health` stays 200
    ("degraded"), requests keep being served, an engine that dies meanwhile is ejected by its
    probes; once the API server is back, the changes made meanwhile (a pod deleted, one
    added) reach the table."""
    engines = [FakeEngine(name="pod-a"), FakeEngine(name="pod-b"), FakeEngine(name="pod-c")]
    scopes = [trio.CancelScope() for _ in engines]

    async def serve(i: int, port: int, *, task_status: trio.TaskStatus[str]) -> None:
        with scopes[i]:
            await serve_fake_engine(engines[i], f"127.0.1.{i + 1}", port, task_status=task_status)

    with trio.fail_after(LIMIT + 10):
        async with trio.open_nursery() as nursery:
            url_a = await nursery.start(serve, 0, 0)
            port = int(url_a.rsplit(":", 1)[1])
            await nursery.start(serve, 1, port)
            await nursery.start(serve, 2, port)
            apiserver.add_pod("pod-a", ip="127.0.1.1")
            apiserver.add_pod("pod-b", ip="127.0.1.2")
            config = Config(
                server=ServerConfig(bind="127.0.0.1:0"),
                discovery=DiscoveryConfig(
                    mode="kubernetes",
                    kubernetes=KubernetesConfig(
                        namespace=apiserver.namespace,
                        port=port,
                        kubeconfig=str(kubeconfig),
                        stale_after_s=0.5,
                        read_timeout_s=1.0,
                    ),
                ),
                probe=ProbeConfig(interval_s=0.2, timeout_s=0.5, backoff_max_s=0.5),
                stats=StatsConfig(interval_s=0.0),
            )
            table = RoutingTable()
            (url,) = await nursery.start(
                partial(server.run, config, table=table, handle_signals=False)
            )

            def routable() -> set[str]:
                return {e.name for e in table.routable("fake-model")}

            while routable() != {"pod-a", "pod-b"}:
                await table.wait_changed()
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as client:
                assert (await client.get("/health")).json()["status"] == "ok"
                apiserver.outage(True)
                apiserver.delete_pod("pod-b")  # unseen until the API server is back
                apiserver.add_pod("pod-c", ip="127.0.1.3")
                start = trio.current_time()
                served, degraded = 0, 0
                while trio.current_time() - start < 3.0:  # 6 x stale_after_s
                    health = await client.get("/health")
                    assert health.status_code == 200, health.text
                    degraded += health.json()["status"] == "degraded"
                    response = await client.post(CHAT, json=chat())
                    assert response.status_code == 200, response.text
                    served += 1
                    if trio.current_time() - start > 1.0 and not scopes[1].cancel_called:
                        scopes[1].cancel()  # pod-b's engine dies during the outage
                    await trio.sleep(0.05)
                assert degraded > 0 and served > 20
                assert routable() == {"pod-a"}  # pod-b failed its probes: ejected
                apiserver.outage(False)
                while routable() != {"pod-a", "pod-c"} or "uid-pod-b" in table:
                    await table.wait_changed()
                assert (await client.get("/health")).json()["status"] == "ok"  # fresh again
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["rollout", "crash"])
async def test_a_request_waits_while_the_only_pod_is_replaced(
    apiserver: FakeApiServer, kubeconfig: Path, how: str
) -> None:
    """The waiting room in Kubernetes mode: the model's one pod is deleted (a rollout), or
    its engine dies while the pod is still Ready and then goes NotReady (a crash); a request
    sent meanwhile waits, and is answered by the replacement pod once it is Ready."""
    old, new = FakeEngine(name="old"), FakeEngine(name="new")
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            old_scope = trio.CancelScope()

            async def serve_old(task_status: trio.TaskStatus[str]) -> None:
                with old_scope:
                    await serve_fake_engine(old, "127.0.1.1", 0, task_status=task_status)

            port = int((await nursery.start(serve_old)).rsplit(":", 1)[1])
            await nursery.start(serve_fake_engine, new, "127.0.1.2", port)
            apiserver.add_pod("old", ip="127.0.1.1")
            config = kubernetes_config(apiserver.namespace, str(kubeconfig), port)
            table = RoutingTable()
            async with trio.open_nursery() as router_nursery:
                (url,) = await router_nursery.start(
                    partial(server.run, config, table=table, handle_signals=False)
                )
                while not table.routable("fake-model"):
                    await table.wait_changed()
                answers: list[httpx.Response] = []
                async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as client:

                    async def request() -> None:
                        answers.append(await client.post(CHAT, json=chat()))

                    if how == "rollout":
                        apiserver.delete_pod("old")
                        while table.routable("fake-model"):
                            await table.wait_changed()
                    else:
                        old_scope.cancel()  # connections refused; the pod is still Ready
                    async with trio.open_nursery() as clients:
                        clients.start_soon(request)
                        while table.routable("fake-model"):  # a crash: ejected when refused
                            await table.wait_changed()
                        if how == "crash":
                            apiserver.modify_pod("old", ready=False)
                        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                        assert answers == []  # it waits
                        apiserver.add_pod("new", ip="127.0.1.2")
                (answer,) = answers
                assert answer.status_code == 200, answer.text
                assert [r.path for r in new.requests if r.path == CHAT] == [CHAT]
                assert not [r for r in old.requests if r.path == CHAT]
                router_nursery.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
