"""An emulated engine's HTTP surface through real Hypercorn on loopback (real clock, a fast
time scale): vLLM's shapes for models, metrics, chat and text completions (whole and
streamed, with usage and token ids), tokenize and detokenize, vLLM's error bodies, a client
going away aborting its request, and LoRA adapters (listed, served by name, loaded and
unloaded at run time only when allowed, vllm:lora_requests_info)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.emulator.app import serve_engine
from trio_router.emulator.engine import EmulatedEngine, EngineConfig
from trio_router.emulator.lora import LoraConfig, LoraModule
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


SQL = LoraModule("sql-lora", "/adapters/sql")
ADAPTERS = LoraConfig(
    enable_lora=True,
    modules=(SQL, LoraModule("chat-lora", "/adapters/chat", base_model_name="not-served")),
)


async def test_adapters_are_listed_and_served_by_name() -> None:
    chat = {"messages": [{"role": "user", "content": "select"}], **GREEDY}
    async with served(lora=ADAPTERS) as (_, client):
        models = (await client.get("/v1/models")).json()["data"]
        whole = await client.post("/v1/chat/completions", json={**chat, "model": "sql-lora"})
        stream = await client.post(
            "/v1/chat/completions", json={**chat, "model": "chat-lora", "stream": True}
        )
        tokens = await client.post("/tokenize", json={"model": "sql-lora", "prompt": "a b"})
        unknown = await client.post("/v1/chat/completions", json={**chat, "model": "sq-lora"})
        metrics = (await client.get("/metrics")).text
    assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in models[1:]] == [
        ("sql-lora", "/adapters/sql", MODEL, None),  # parent: the served model
        ("chat-lora", "/adapters/chat", MODEL, None),  # a base_model_name not served: ignored
    ]
    assert models[0]["id"] == MODEL and models[0]["parent"] is None
    card = models[1]
    assert (card["object"], card["owned_by"]) == ("model", "vllm")
    assert card["permission"][0]["object"] == "model_permission"
    assert card["permission"][0]["id"].startswith("modelperm-")
    assert card["permission"][0]["id"] != models[2]["permission"][0]["id"]  # one each
    assert whole.status_code == 200 and whole.json()["model"] == "sql-lora"
    assert {e["model"] for e in events(stream.text)} == {"chat-lora"}
    assert tokens.status_code == 200 and tokens.json()["count"] == 3
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == (
        f"The model `sq-lora` does not exist. Valid aliases: {MODEL}."
    )
    # vLLM's gauge: a series per list of adapters it was set with, the wall clock as value.
    info = re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", metrics, re.MULTILINE)
    series = dict(info)
    assert (
        'max_lora="1",waiting_lora_adapters="sql-lora",running_lora_adapters="sql-lora"' in series
    )
    assert 'max_lora="1",waiting_lora_adapters="",running_lora_adapters=""' in series
    assert all(abs(float(value) - time.time()) < LIMIT for _, value in info)
    assert parse_vllm_metrics(metrics)["running"] == 0  # the router's parser still reads it


async def test_no_lora_no_gauge_and_no_adapter_endpoints() -> None:
    async with served() as (_, client):
        metrics = (await client.get("/metrics")).text
        load = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}
        )
    assert "lora" not in metrics
    assert load.status_code == 404 and load.json() == {"detail": "Not Found"}


async def test_adapters_load_and_unload_at_run_time_when_allowed() -> None:
    runtime = LoraConfig(enable_lora=True, allow_runtime_updating=True)
    async with served(lora=runtime) as (_, client):

        async def post(path: str, **body: Any) -> httpx.Response:
            return await client.post(f"/v1/{path}_lora_adapter", json=body)

        loaded = await post("load", lora_name="a", lora_path="/p/a")
        again = await post("load", lora_name="a", lora_path="/p/a")
        in_place = await post("load", lora_name="a", lora_path="/p/a2", load_inplace=True)
        listed = (await client.get("/v1/models")).json()["data"]
        served_a = await client.post(
            "/v1/completions", json={"model": "a", **GREEDY, "prompt": "x"}
        )
        conflict = await post("load", lora_name=MODEL, lora_path="/p")
        missing = await post("load", lora_name="b")
        not_json = await client.post("/v1/load_lora_adapter", content=b"{}")
        unloaded = await post("unload", lora_name="a")
        gone = await post("unload", lora_name="a")
        after = await client.post("/v1/completions", json={"model": "a", **GREEDY, "prompt": "x"})
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'a' added successfully.",
    )
    assert "content-type" not in loaded.headers  # vLLM answers with a bare Response
    assert again.status_code == 400
    assert again.json()["error"] == {
        "message": "The lora adapter 'a' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True.",
        "type": "InvalidUserInput",
        "param": None,
        "code": 400,
    }
    assert in_place.status_code == 200
    assert [(m["id"], m["root"]) for m in listed[1:]] == [("a", "/p/a2")]
    assert served_a.status_code == 200 and served_a.json()["model"] == "a"
    assert conflict.status_code == 400 and "conflicts with a served base model" in conflict.text
    assert missing.status_code == 400
    assert (missing.json()["error"]["type"], missing.json()["error"]["param"]) == (
        "Bad Request",
        "body.lora_path",
    )
    assert not_json.status_code == 400 and "application/json" in not_json.text
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'a' removed successfully.",
    )
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert gone.json()["error"]["message"] == "The lora adapter 'a' cannot be found."
    assert after.status_code == 404


async def test_loading_without_enable_lora_fails_as_vllms_engine_does() -> None:
    async with served(lora=LoraConfig(allow_runtime_updating=True)) as (_, client):
        load = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}
        )
        models = (await client.get("/v1/models")).json()["data"]
    assert load.status_code == 500 and load.json()["error"]["type"] == "InternalServerError"
    assert "LoRA is not enabled. Use --enable-lora to enable LoRA." in load.text
    assert [m["id"] for m in models] == [MODEL]


async def test_a_chat_streams_head_at_once_and_its_role_with_the_first_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As vLLM's server: the response's head at once, the role event only with the first
    token (its chat stream writes the role on its first output, after the prefill)."""
    words = " ".join(f"w{i}" for i in range(3000))  # a prefill of some emulated milliseconds
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": words}], "stream": True,
         **GREEDY}
    ).encode()  # fmt: skip
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    config = EngineConfig.from_profile(load_profile("h100"), time_scale=1.0)
    engine = EmulatedEngine(config)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_engine, engine, "127.0.1.1", 0)
            host, port = url.removeprefix("http://").split(":")
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                start = trio.current_time()
                await stream.send_all(head + body)
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await stream.receive_some()
                head_at, role_at = trio.current_time(), None
                assert received.endswith(b"\r\n\r\n")  # the head alone
                while received.count(b"data: ") < 2:  # the role event and the first token's
                    received += await stream.receive_some()
                    if b"data: " in received and role_at is None:
                        role_at = trio.current_time()
                token_at = trio.current_time()
            nursery.cancel_scope.cancel()
    assert head_at == start  # no step before the head
    assert role_at == token_at > start  # the role with the first token, after the prefill
    role, token = [e for e in received.split(b"\r\n") if e.startswith(b"data: ")][:2]
    assert b'"role":"assistant"' in role and b'"role"' not in token
    assert engine.stats.ttft.sum == pytest.approx(token_at - start)
