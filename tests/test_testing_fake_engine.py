"""The fake engines answer as documented: over real HTTP (Hypercorn on 127.0.1.x), through
the official openai SDK, as a bare ASGI app on virtual time, and through the httpx transport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from trio_router.testing import (
    FakeEngine,
    fake_engine_app,
    open_fake_engines,
    serve_fake_engine,
)
from trio_router.testing.fake_transport import fake_engine_transport

LIMIT = 10.0


@asynccontextmanager
async def http_engine(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), httpx.AsyncClient(base_url=url) as client:
            yield client


def chat_body() -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return [event for event in raw.split(b"\n\n") if event]


def event_data(event: bytes) -> Any:
    line = next(x for x in event.split(b"\n") if x.startswith(b"data: "))
    return json.loads(line[6:])


# -- over real HTTP -----------------------------------------------------------------------
async def test_models_lists_base_models_and_adapters() -> None:
    engine = FakeEngine(models=["base"], adapters={"lora-a": "base"}, max_model_len=2048)
    async with http_engine(engine) as client:
        reply = (await client.get("/v1/models")).json()
    assert reply["object"] == "list"
    by_id = {m["id"]: m for m in reply["data"]}
    assert by_id["base"]["parent"] is None and by_id["base"]["max_model_len"] == 2048
    assert by_id["lora-a"]["parent"] == "base" and by_id["lora-a"]["object"] == "model"


async def test_engines_bind_distinct_loopback_addresses() -> None:
    engines = [FakeEngine(name=f"e{i}") for i in range(3)]
    with trio.fail_after(LIMIT):
        async with open_fake_engines(engines) as urls, httpx.AsyncClient() as client:
            assert [u.rsplit(":", 1)[0] for u in urls] == [
                "http://127.0.1.1",
                "http://127.0.1.2",
                "http://127.0.1.3",
            ]
            names = [(await client.get(f"{u}/health")).headers["x-fake-engine"] for u in urls]
    assert names == ["e0", "e1", "e2"]


async def test_serve_fake_engine_reports_its_url_and_stops_on_cancel() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_fake_engine, engine, "127.0.0.1", 0)
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"{url}/health")).status_code == 200
            nursery.cancel_scope.cancel()
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{url}/health")


async def test_chat_completion_json() -> None:
    engine = FakeEngine(name="e1", tokens=5)
    async with http_engine(engine) as client:
        reply = await client.post(
            "/v1/chat/completions",
            headers={"x-request-id": "r9"},
            json={
                "model": "fake-model",
                "messages": [{"role": "user", "content": "one two three"}],
            },
        )
    assert reply.status_code == 200 and reply.headers["x-fake-engine"] == "e1"
    completion = ChatCompletion.model_validate(reply.json())
    assert completion.choices[0].message.content == "Hello from a fake OpenAI-compatible"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    # The fake chat template: the user role, three words, the generation prompt.
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, 5)
    seen = engine.requests[-1]
    assert (seen.method, seen.path, seen.header("X-Request-Id")) == (
        "POST",
        "/v1/chat/completions",
        "r9",
    )
    assert seen.json()["messages"][0]["content"] == "one two three"
    await engine.wait_until(lambda: engine.completed == 1)


async def test_chat_stream_is_sse_ending_with_done() -> None:
    engine = FakeEngine(tokens=4)
    async with http_engine(engine) as client:
        reply = await client.post(
            "/v1/chat/completions",
            json={
                "model": "fake-model",
                "stream": True,
                "messages": [],
                "stream_options": {"include_usage": True},
            },
        )
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in reply.headers  # chunked: one chunk per event
    events = sse_events(reply.content)
    assert events[-1] == b"data: [DONE]"
    chunks = [ChatCompletionChunk.model_validate(event_data(e)) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from a fake"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_max_tokens_caps_the_reply() -> None:
    async with http_engine(FakeEngine(tokens=10)) as client:
        reply = (
            await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "p", "max_tokens": 2}
            )
        ).json()
    completion = Completion.model_validate(reply)
    assert completion.choices[0].text == "Hello from"
    assert completion.choices[0].finish_reason == "length"


async def test_completions_stream() -> None:
    async with http_engine(FakeEngine(tokens=3)) as client:
        reply = await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "p", "stream": True}
        )
    events = sse_events(reply.content)
    assert events[-1] == b"data: [DONE]"
    chunks = [event_data(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello from a"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]


async def test_adapter_is_served_and_unknown_model_is_404() -> None:
    engine = FakeEngine(models=["base"], adapters={"lora-a": "base"})
    async with http_engine(engine) as client:
        ok = await client.post("/v1/completions", json={"model": "lora-a", "prompt": "p"})
        missing = await client.post("/v1/completions", json={"model": "nope", "prompt": "p"})
    assert ok.status_code == 200 and ok.json()["model"] == "lora-a"
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "The model `nope` does not exist. Valid aliases: base, lora-a.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }  # as vLLM answers it


async def test_more_tokens_than_the_context_is_a_json_400_even_for_a_stream() -> None:
    async with http_engine(FakeEngine(max_model_len=1024)) as client:
        answers = [
            await client.post(
                "/v1/chat/completions",
                json={**chat_body(), "max_tokens": 5000, "stream": stream},
            )
            for stream in (False, True)
        ]
    for answer in answers:
        assert answer.status_code == 400
        assert answer.headers["content-type"] == "application/json"
        error = answer.json()["error"]
        assert error["param"] == "max_tokens" and "max_model_len=1024" in error["message"]


async def test_bad_requests() -> None:
    async with http_engine(FakeEngine()) as client:
        bad_json = await client.post("/v1/chat/completions", content=b"{nope")
        not_object = await client.post("/v1/chat/completions", json=[1])
        no_messages = await client.post("/v1/chat/completions", json={"model": "fake-model"})
        wrong_method = await client.get("/v1/chat/completions")
        unknown_path = await client.post("/v2/nothing", json={})
    assert [
        r.status_code for r in (bad_json, not_object, no_messages, wrong_method, unknown_path)
    ] == [400, 400, 400, 405, 404]
    assert bad_json.json()["error"]["code"] == 400


async def test_embeddings() -> None:
    async with http_engine(FakeEngine()) as client:
        reply = (
            await client.post("/v1/embeddings", json={"model": "fake-model", "input": ["a", "b c"]})
        ).json()
    embeddings = CreateEmbeddingResponse.model_validate(reply)
    assert [d.index for d in embeddings.data] == [0, 1]
    assert len(embeddings.data[0].embedding) == 8
    assert embeddings.data[0].embedding != embeddings.data[1].embedding


async def test_tokenize_and_detokenize() -> None:
    async with http_engine(FakeEngine(max_model_len=1024)) as client:
        tokens = (
            await client.post("/tokenize", json={"model": "fake-model", "prompt": "a b c"})
        ).json()
        text = (
            await client.post("/detokenize", json={"model": "fake-model", "tokens": [1, 2]})
        ).json()
    assert tokens["count"] == 3 and len(tokens["tokens"]) == 3
    assert tokens["max_model_len"] == 1024
    assert text == {"prompt": "tok1 tok2"}


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
async def test_rerank(path: str) -> None:
    async with http_engine(FakeEngine()) as client:
        reply = (
            await client.post(
                path,
                json={
                    "model": "fake-model",
                    "query": "q",
                    "documents": ["x", "y", "z"],
                    "top_n": 2,
                },
            )
        ).json()
    scores = [r["relevance_score"] for r in reply["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    assert {r["document"]["text"] for r in reply["results"]} <= {"x", "y", "z"}
    assert reply["model"] == "fake-model" and reply["usage"]["total_tokens"] == 4


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
async def test_score(path: str) -> None:
    async with http_engine(FakeEngine()) as client:
        reply = (
            await client.post(
                path, json={"model": "fake-model", "text_1": "q", "text_2": ["a", "b"]}
            )
        ).json()
    assert reply["object"] == "list"
    assert [(d["index"], d["object"]) for d in reply["data"]] == [(0, "score"), (1, "score")]
    assert all(0.0 <= d["score"] <= 1.0 for d in reply["data"])


async def test_responses() -> None:
    async with http_engine(FakeEngine(tokens=3)) as client:
        reply = (
            await client.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
        ).json()
        stream = await client.post(
            "/v1/responses", json={"model": "fake-model", "input": "hi", "stream": True}
        )
    response = Response.model_validate(reply)
    assert response.output_text == "Hello from a" and response.status == "completed"
    events = [event_data(e) for e in sse_events(stream.content)]
    assert [e["type"] for e in events] == ["response.created"] + [
        "response.output_text.delta"
    ] * 3 + ["response.completed"]


async def test_metrics_in_vllm_format() -> None:
    engine = FakeEngine(
        models=["m1"], num_requests_waiting=3, kv_cache_usage_perc=0.25, gate=trio.Event()
    )
    async with http_engine(engine) as client, trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, "/v1/completions", json={"prompt": "p"}))
        await engine.wait_until(lambda: engine.in_flight == 1)
        reply = await client.get("/metrics")
        assert engine.gate is not None
        engine.gate.set()
    assert reply.headers["content-type"].startswith("text/plain")
    lines = reply.text.splitlines()
    assert 'vllm:num_requests_running{engine="0",model_name="m1"} 1.0' in lines  # live count
    assert 'vllm:num_requests_waiting{engine="0",model_name="m1"} 3.0' in lines
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m1"} 0.25' in lines
    assert not any(line.startswith("vllm:gpu_cache_usage_perc") for line in lines)  # gone in 0.32
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="m1"} 1.0' in lines  # "p"
    assert any(line.startswith('vllm:cache_config_info{block_size="128"') for line in lines)
    assert "# TYPE vllm:num_requests_running gauge" in lines
    engine.num_requests_running = 7
    assert 'vllm:num_requests_running{engine="0",model_name="m1"} 7.0' in (
        engine.metrics_text().splitlines()
    )


async def test_fail_status_answers_everything() -> None:
    engine = FakeEngine(fail_status=503)
    async with http_engine(engine) as client:
        replies = [
            await client.get("/v1/models"),
            await client.get("/health"),
            await client.post("/v1/completions", json={"prompt": "p"}),
        ]
    assert [r.status_code for r in replies] == [503, 503, 503]
    assert replies[2].json()["error"]["code"] == 503


async def test_inference_fail_status_keeps_probes_healthy() -> None:
    engine = FakeEngine(inference_fail_status=429)
    async with http_engine(engine) as client:
        models = await client.get("/v1/models")
        work = await client.post("/v1/completions", json={"prompt": "p"})
    assert models.status_code == 200 and work.status_code == 429
    assert work.json()["error"]["type"] == "RateLimitError"


async def test_client_disconnect_is_observed() -> None:
    engine = FakeEngine(gate=trio.Event())
    body = json.dumps({"model": "fake-model", "stream": True, "messages": []}).encode()
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,):
            host, port = url.removeprefix("http://").split(":")
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                received = b""
                while b"data: " not in received:  # the first event, then the engine holds
                    received += await stream.receive_some()
            # The client closed its connection mid-stream; the engine sees it go.
            await engine.wait_until(lambda: engine.disconnects == 1)
    assert engine.completed == 0 and engine.in_flight == 0


async def test_openai_sdk_against_the_fake_engine() -> None:
    # The synchronous SDK in a worker thread: how most scripts use it, and it needs no
    # asyncio/anyio integration with the test's Trio loop.
    engine = FakeEngine(tokens=3)

    def use_sdk(url: str) -> tuple[list[str], str | None, str]:
        with openai.OpenAI(
            base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=LIMIT
        ) as client:
            models = [m.id for m in client.models.list()]
            chat = client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}]
            )
            stream = client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        return models, chat.choices[0].message.content, "".join(pieces)

    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,):
            models, text, streamed = await trio.to_thread.run_sync(use_sdk, url)
    assert models == ["fake-model"]
    assert text == streamed == "Hello from a"
    assert engine.requests[-1].header("authorization") == "Bearer k"


# -- the bare ASGI app on virtual time ----------------------------------------------------
async def call_app(
    engine: FakeEngine, path: str, body: dict[str, Any], *, disconnect: trio.Event | None = None
) -> list[tuple[float, dict[str, Any]]]:
    """Run one request through the ASGI app; returns (time, message) for every send."""
    sent: list[tuple[float, dict[str, Any]]] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if disconnect is not None:
            await disconnect.wait()
        else:
            await trio.sleep_forever()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append((trio.current_time(), message))

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("1.2.3.4", 5),
    }
    await fake_engine_app(engine)(scope, receive, send)
    return sent


async def test_stream_timing_follows_ttft_and_inter_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(ttft_s=0.5, inter_token_s=0.1, tokens=3)
    start = trio.current_time()
    sent = await call_app(
        engine, "/v1/chat/completions", {"model": "fake-model", "stream": True, "messages": []}
    )
    bodies = [(t - start, m["body"]) for t, m in sent if m["type"] == "http.response.body"]
    times = [round(t, 6) for t, _ in bodies]
    # role event at the first token time, then one token per 0.1 s, finish, [DONE], end
    assert times == [0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9]
    assert bodies[-2][1] == b"data: [DONE]\n\n" and bodies[-1][1] == b""
    assert engine.requests[0].client == ("1.2.3.4", 5)


async def test_a_pause_comes_before_its_event(autojump_clock: trio.testing.MockClock) -> None:
    """`pauses`: event N of a stream comes that many seconds later than it would."""
    engine = FakeEngine(inter_token_s=0.1, tokens=3, pauses={2: 3.0})
    start = trio.current_time()
    sent = await call_app(
        engine, "/v1/chat/completions", {"model": "fake-model", "stream": True, "messages": []}
    )
    times = [round(t - start, 6) for t, m in sent if m["type"] == "http.response.body"]
    assert times[:4] == [0.0, 0.1, 3.2, 3.3]


async def test_whole_reply_waits_for_all_tokens(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine(ttft_s=0.5, inter_token_s=0.1, tokens=3)
    start = trio.current_time()
    sent = await call_app(engine, "/v1/chat/completions", {"model": "fake-model", "messages": []})
    assert round(sent[0][0] - start, 6) == 0.7
    assert sent[0][1]["status"] == 200


async def test_asgi_disconnect_stops_the_stream(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine(inter_token_s=1.0, tokens=100)
    gone = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                call_app,
                engine,
                "/v1/chat/completions",
                {"model": "fake-model", "stream": True, "messages": []},
                disconnect=gone,
            )
        )
        await trio.sleep(10.5)
        gone.set()
        await engine.wait_until(lambda: engine.in_flight == 0)
    assert engine.disconnects == 1 and engine.completed == 0
    assert trio.current_time() < 11


# -- the httpx transport --------------------------------------------------------------------
async def test_transport_answers_probes(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine(models=["m"], adapters={"a": "m"}, kv_cache_usage_perc=0.5)
    async with httpx.AsyncClient(
        transport=fake_engine_transport(engine), base_url="http://e1:8000"
    ) as client:
        models = (await client.get("/v1/models", headers={"authorization": "Bearer x"})).json()
        metrics = (await client.get("/metrics")).text
        health = await client.get("/health")
        engine.fail_status = 500
        failing = await client.get("/v1/models")
        engine.fail_status = None
        engine.hang_models = True
        with trio.move_on_after(5) as scope:
            await client.get("/v1/models")
    assert [m["id"] for m in models["data"]] == ["m", "a"]
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5' in metrics
    assert health.status_code == 200 and failing.status_code == 500
    assert scope.cancelled_caught  # hang_models: only the caller's deadline ends the probe
    assert engine.requests[0].header("authorization") == "Bearer x"
    assert engine.request_count == 5
