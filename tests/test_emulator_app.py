"""An emulated engine's HTTP surface through real Hypercorn on loopback (real clock, a fast
time scale): vLLM's shapes for models, metrics, chat and text completions (whole and
streamed, with usage and token ids), tokenize and detokenize, vLLM's error bodies, and a
client going away aborting its request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.emulator.app import serve_engine
from trio_router.emulator.engine import EmulatedEngine, EngineConfig
from trio_router.emulator.profiles import load_profile

LIMIT = 10.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "max_tokens": 6}


@asynccontextmanager
async def served(**flags: Any) -> AsyncIterator[tuple[EmulatedEngine, httpx.AsyncClient]]:
    config = EngineConfig.from_profile(load_profile("h100"), time_scale=100.0, **flags)
    engine = EmulatedEngine(config)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_engine, engine, "127.0.1.1", 0)
            async with httpx.AsyncClient(base_url=url) as client:
                yield engine, client
            nursery.cancel_scope.cancel()


def events(raw: str) -> list[Any]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    chunks = [c for c in raw.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks)
    return [json.loads(c[6:]) for c in chunks[:-1]]


async def test_models_health_version_and_metrics() -> None:
    async with served(max_model_len=4096) as (_, client):
        health = await client.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        models = (await client.get("/v1/models")).json()
        assert [(m["id"], m["max_model_len"], m["owned_by"]) for m in models["data"]] == [
            (MODEL, 4096, "vllm")
        ]
        assert (await client.get("/version")).json() == {"version": "0.32.0"}
        metrics = await client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert parse_vllm_metrics(metrics.text)["running"] == 0
        assert (await client.get("/nowhere")).status_code == 404
        assert (await client.get("/v1/completions")).status_code == 405


async def test_a_whole_chat_answer_with_token_ids() -> None:
    async with served() as (engine, client):
        body = {"messages": [{"role": "user", "content": "hello there"}], **GREEDY}
        reply = await client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
        again = await client.post("/v1/chat/completions", json={**body, "model": MODEL})
        tokenized = await client.post("/tokenize", json={"messages": body["messages"]})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == engine.vocab.decode(choice["token_ids"])
    assert len(choice["token_ids"]) == 6 == answer["usage"]["completion_tokens"]
    assert answer["prompt_token_ids"] == tokenized.json()["tokens"]
    assert answer["usage"]["prompt_tokens"] == tokenized.json()["count"]
    # Greedy: the same answer again.
    assert again.json()["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_a_streamed_chat_with_usage_and_token_ids() -> None:
    body = {
        "messages": [{"role": "user", "content": "stream me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **GREEDY,
    }
    async with served() as (engine, client):
        reply = await client.post("/v1/chat/completions", json=body)
    assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
    first, *chunks, usage = events(reply.text)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["object"] == "chat.completion.chunk" and "prompt_token_ids" in first
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == engine.vocab.decode(ids) and len(ids) == 6
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == len(first["prompt_token_ids"])


async def test_a_streamed_completion_of_token_ids() -> None:
    prompt = [1, 100, 200, 300]
    body = {"prompt": prompt, "stream": True, "return_token_ids": True, **GREEDY}
    async with served() as (engine, client):
        reply = await client.post("/v1/completions", json=body)
        whole = await client.post("/v1/completions", json={"prompt": prompt, **GREEDY})
        words = await client.post("/detokenize", json={"tokens": prompt})
    chunks = events(reply.text)
    assert chunks[0]["object"] == "text_completion"
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole.json()["choices"][0]["text"]
    assert words.json() == {"prompt": engine.vocab.decode(prompt)}


async def test_vllms_errors() -> None:
    async with served(max_model_len=64) as (_, client):
        unknown = await client.post(
            "/v1/completions", json={"model": "nope", "prompt": "hi", "stream": True}
        )
        too_many = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 65})
        too_long = await client.post(
            "/v1/completions", json={"prompt": "w " * 64, "max_tokens": 1, "stream": True}
        )
        not_json = await client.post("/v1/completions", content=b"{")
        clamped = await client.post(
            "/v1/completions", json={"prompt": "w " * 60, "max_tokens": 50, **{"temperature": 0}}
        )
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert too_many.status_code == 400
    assert too_many.json()["error"]["message"] == (
        "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output "
        "tokens. (parameter=max_tokens, value=65)"
    )
    assert too_long.status_code == 400 and too_long.headers["content-type"] == "application/json"
    assert "maximum context length is 64 tokens" in too_long.json()["error"]["message"]
    assert not_json.status_code == 400
    # A prompt and max_tokens beyond the context: max_tokens is clamped (61 + 3 = 64).
    assert clamped.status_code == 200 and clamped.json()["usage"]["completion_tokens"] <= 3


async def test_a_client_going_away_aborts_its_request() -> None:
    body = json.dumps(
        {
            "prompt": "a long answer please",
            "stream": True,
            "max_tokens": 100_000,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    async with served() as (engine, client):
        host, port = str(client.base_url.host), client.base_url.port
        assert port is not None
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(head + body)
            received = b""
            while b"data: " not in received:  # the first tokens: then the client goes away
                received += await stream.receive_some()
            assert engine.scheduler.has_work()
        while engine.scheduler.has_work():
            await engine.wait_changed()
        metrics = parse_vllm_metrics((await client.get("/metrics")).text)
    assert metrics["running"] == 0 and metrics["kv_cache_usage"] == 0.0
    assert engine.cache.usage == 0.0
