"""The serving path over real sockets: Hypercorn on 127.0.0.1, fake engines over HTTP, httpx.

Every test runs the real `server.run` (static discovery) in front of `FakeEngine`s served by
Hypercorn, on the real clock under `trio.fail_after`. Waits are on events (the routing table's
`wait_changed`, the engines' `wait_until`), never on sleeps.
"""

from __future__ import annotations

import email.utils
import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from trio_router import server
from trio_router._version import __version__
from trio_router.errors import ConfigError
from trio_router.testing import FakeEngine
from trio_router.testing.harness import (
    CHAT,
    LIMIT,
    chat,
    open_raw,
    open_router,
    receive_until,
    router_config,
    sample,
    send_raw,
    send_request,
    undated,
)


# -- proxying ---------------------------------------------------------------------------------
async def test_non_streamed_request_is_forwarded_unchanged_both_ways() -> None:
    engine = FakeEngine(
        name="e1",
        tokens=3,
        extra_headers=[(b"x-engine-extra", b"kept"), (b"date", b"Mon, 01 Jan 2024 00:00:00 GMT")],
    )
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            body = json.dumps(chat(max_tokens=2, user="u")).encode() + b"  "
            response = await router.client.post(
                CHAT + "?trace=1",
                content=body,
                headers={
                    "content-type": "application/json",
                    "x-custom": "abc",
                    "connection": "keep-alive, x-hop",
                    "x-hop": "dropped",
                },
            )
    assert response.status_code == 200
    seen = engine.requests_to(CHAT)[-1]
    assert seen.body == body  # byte for byte, trailing spaces included
    assert seen.query == {"trace": "1"}
    assert seen.header("x-custom") == "abc" and seen.header("x-hop") is None
    assert seen.header("connection") is None
    request_id = seen.header("x-request-id")
    assert request_id and response.headers["x-request-id"] == request_id
    assert response.headers["x-trio-router-engine"] == router.engine_urls[0].split("//")[1]
    assert response.headers["x-engine-extra"] == "kept"
    assert response.headers.get_list("date") == ["Mon, 01 Jan 2024 00:00:00 GMT"]  # the engine's
    assert response.json()["choices"][0]["message"]["content"] == "Hello from"


async def test_answers_carry_one_date_the_engines_or_the_routers() -> None:
    """The engine's Date passes through (above); the router dates what it answers itself and
    an engine's answer that came without one."""
    undated = FakeEngine(send_date=False)
    with trio.fail_after(LIMIT):
        async with open_router([undated]) as router:
            answers = [
                await router.client.post(CHAT, json=chat()),
                await router.client.post(CHAT, json=chat("no-such-model")),
                await router.client.get("/health"),
                await router.client.get("/metrics"),
            ]
    assert [a.status_code for a in answers] == [200, 404, 200, 200]
    for answer in answers:
        (date,) = answer.headers.get_list("date")
        age = datetime.now(UTC) - email.utils.parsedate_to_datetime(date)
        assert abs(age.total_seconds()) < 60


async def test_client_request_id_is_passed_on_and_returned() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            response = await router.client.post(
                CHAT, json=chat(), headers={"x-request-id": "req-42"}
            )
    assert response.headers["x-request-id"] == "req-42"
    assert engine.requests_to(CHAT)[-1].header("x-request-id") == "req-42"


@pytest.mark.parametrize("enabled", [True, False])
async def test_access_record_per_request_unless_turned_off(
    enabled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """`server.access_log`: one `trio_router.access` record per proxied request, errors the
    router answers itself included; none at all when it is off."""
    caplog.set_level(logging.INFO, logger="trio_router.access")
    engine = FakeEngine(tokens=2)
    with trio.fail_after(LIMIT):
        async with open_router([engine], server={"access_log": enabled}) as router:
            ok = await router.client.post(CHAT, json=chat(), headers={"x-request-id": "ok-1"})
            missing = await router.client.post(
                CHAT, json=chat("no-such-model"), headers={"x-request-id": "missing-1"}
            )
    assert (ok.status_code, missing.status_code) == (200, 404)
    records = {
        r.fields["request_id"]: r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "trio_router.access"
    }
    if not enabled:
        assert records == {}
        return
    assert records.keys() == {"ok-1", "missing-1"}
    assert records["ok-1"]["status"] == 200 and records["ok-1"]["bytes"] == len(ok.content)
    assert records["ok-1"]["engine"] == router.engine_urls[0].split("//")[1]
    assert records["ok-1"]["retries"] == 0 and records["ok-1"]["ttfb_ms"] is not None
    assert records["missing-1"]["status"] == 404 and records["missing-1"]["engine"] == ""
    assert records["missing-1"]["model"] == "no-such-model"


async def test_stream_is_forwarded_event_by_event() -> None:
    gate = trio.Event()
    engine = FakeEngine(tokens=4, gate=gate)  # holds after the first event until the gate
    with trio.fail_after(LIMIT):
        async with (
            open_router([engine]) as router,
            router.client.stream("POST", CHAT, json=chat(stream=True)) as response,
        ):
            assert response.headers["content-type"].startswith("text/event-stream")
            chunks = response.aiter_raw()
            first = await chunks.__anext__()
            # The engine still holds every other event: the first one got through alone.
            assert first.startswith(b"data: ") and first.endswith(b"\n\n")
            assert engine.in_flight == 1 and engine.completed == 0
            gate.set()
            rest = b"".join([chunk async for chunk in chunks])
    events = (first + rest).split(b"\n\n")
    assert events[-2] == b"data: [DONE]" and events[-1] == b""
    assert len(events) == 1 + 4 + 1 + 1 + 1  # role, 4 tokens, finish, [DONE], tail
    assert engine.completed == 1


async def test_backpressure_a_slow_client_slows_the_engine_read() -> None:
    # A 24 MB reply (rerank echoes its documents) read slowly: the router must not buffer it
    # whole. While the client reads nothing, the engine cannot finish sending.
    big = "x" * (24 * 1024 * 1024)
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine], server={"max_body_bytes": 64 * 1024 * 1024}) as router:
            async with router.client.stream(
                "POST", "/v1/rerank", json={"model": "fake-model", "query": "q", "documents": [big]}
            ) as response:
                assert response.status_code == 200
                chunks = response.aiter_raw()
                size = len(await chunks.__anext__())
                with trio.move_on_after(0.5):  # the outcome: the engine is still sending
                    await engine.wait_until(lambda: engine.completed == 1)
                assert engine.completed == 0
                size += sum([len(c) async for c in chunks])
            await engine.wait_until(lambda: engine.completed == 1)
    assert size > len(big)


async def test_model_routing_including_lora_adapters() -> None:
    llama = FakeEngine(name="llama", models=["llama"], adapters={"sql-lora": "llama"})
    mistral = FakeEngine(name="mistral", models=["mistral"])
    with trio.fail_after(LIMIT):
        async with open_router([llama, mistral], wait_models=["llama", "mistral"]) as router:
            for model, engine in [
                ("sql-lora", llama),
                ("mistral", mistral),
                ("llama", llama),
                ("sql-lora", llama),
            ]:
                response = await router.client.post(CHAT, json=chat(model))
                assert response.status_code == 200
                assert router.engine_named(response.headers["x-trio-router-engine"]) is engine
                assert engine.requests_to(CHAT)[-1].json()["model"] == model
            models = (await router.client.get("/v1/models")).json()
            listed = {m["id"]: m for e in (llama, mistral) for m in e.models_payload()["data"]}
    assert models["object"] == "list"
    by_id = {m["id"]: m for m in models["data"]}
    assert sorted(by_id) == ["llama", "mistral", "sql-lora"]
    assert by_id["sql-lora"]["parent"] == "llama"
    # Each card as its engine listed it: every field (vLLM's permission list too) kept.
    for card in by_id.values():
        assert card.keys() == listed[card["id"]].keys()
        assert card["permission"][0]["object"] == "model_permission"
        assert undated(card) == undated(listed[card["id"]])
    assert len(llama.requests_to(CHAT)) == 3 and len(mistral.requests_to(CHAT)) == 1


async def test_round_robin_spreads_requests_over_engines() -> None:
    engines = [FakeEngine(name=f"e{i}") for i in range(3)]
    with trio.fail_after(LIMIT):
        async with open_router(engines) as router:
            for _ in range(6):
                assert (await router.client.post(CHAT, json=chat())).status_code == 200
    assert [len(e.requests_to(CHAT)) for e in engines] == [2, 2, 2]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/v1/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/invocations",
        "/pooling",
        "/classify",
        "/v2/rerank",
    ],
)
async def test_every_proxied_endpoint(path: str) -> None:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "a b"}],
        "max_tokens": 4,
        "prompt": "a b",
        "input": "a",
        "tokens": [1, 2],
        "query": "q",
        "documents": ["d"],
        "text_1": "a",
        "text_2": ["b"],
    }
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            response = await router.client.post(path, json=body)
    assert response.status_code == 200, response.text
    sent = engine.requests_to(path)[-1].json()
    if path == "/v1/responses":  # the router names the response after the engine it went to
        assert sent.pop("request_id").startswith("resp_tr1")
    assert sent == body


@pytest.mark.parametrize("setting", ["reject", "model"])
async def test_unknown_paths_are_refused_or_sent_to_an_engine_of_the_model(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROUTER_KEY", "k")
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router(
            [engine], proxy={"unknown_paths": setting}, server={"api_key_env": "ROUTER_KEY"}
        ) as router:
            key = {"authorization": "Bearer k"}
            engines = await router.client.get("/engines", headers=key)
            if setting == "reject":  # answered before the body is read: a raw client
                heads = []
                for headers in (key, {}):
                    async with await open_raw(router.url) as stream:
                        await send_request(stream, "/v1/future/endpoint", chat(), headers)
                        heads.append(await receive_until(stream, b"\r\n\r\n"))
            else:
                answer = await router.client.post("/v1/future/endpoint", json=chat(), headers=key)
                anonymous = await router.client.post("/v1/future/endpoint", json=chat())
    assert engines.status_code == 200  # the router's own paths stay its own
    if setting == "reject":
        assert all(head.startswith(b"HTTP/1.1 404 ") for head in heads)
        assert engine.requests_to("/v1/future/endpoint") == []
    else:  # the fake engine knows no such path: its 404, from the engine
        assert anonymous.status_code == 401  # never a way around the client key
        assert answer.headers["x-trio-router-engine"] == router.engine_urls[0].removeprefix(
            "http://"
        )
        assert engine.requests_to("/v1/future/endpoint")[-1].json() == chat()


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render"]
)
async def test_render_endpoints_reach_the_engine_and_its_answer_passes(path: str) -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            response = await router.client.post(path, json=chat())
    # vLLM refuses these unless started with --enable-scale-out; its answer is the client's.
    assert response.status_code == 403
    assert response.json()["error"]["type"] == "PermissionDeniedError"
    assert engine.requests_to(path)[-1].json() == chat()


async def test_an_anthropic_message_stream_passes_event_for_event() -> None:
    engine = FakeEngine(tokens=3)
    body = {**chat(stream=True), "max_tokens": 16, "system": "be brief"}
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            async with router.client.stream("POST", "/v1/messages", json=body) as response:
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
            async with httpx.AsyncClient(base_url=router.engine_urls[0]) as direct:
                alone = await direct.post("/v1/messages", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert [e.split("\n", 1)[0] for e in events] == [
        e.split("\n", 1)[0] for e in alone.text.split("\n\n") if e
    ]
    assert events[0].startswith("event: message_start") and events[-1].startswith(
        "event: message_stop"
    )


# -- errors -----------------------------------------------------------------------------------
def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code and isinstance(error["message"], str) and error["type"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "bad_request"),
        (b"", "bad_request"),
        (b"[1, 2]", "bad_request"),
        (b'{"messages": []}', "bad_request"),
        (b'{"model": 7}', "bad_request"),
        (b'{"model": ""}', "bad_request"),
        (b"\xff\xfe", "bad_request"),
        (b"[" * 100_000, "bad_request"),
    ],
)
async def test_malformed_requests_get_400(body: bytes, code: str) -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            response = await router.client.post(CHAT, content=body)
    assert_openai_error(response, 400, code)
    assert not engine.requests_to(CHAT)


async def test_unknown_model_is_404_and_known_model_without_engine_is_503() -> None:
    engine = FakeEngine(name="e1")
    with trio.fail_after(LIMIT):
        async with open_router(
            [engine],
            probe={"interval_s": 0.2, "failures_to_eject": 1},
            admission={"wait_for_engine": False},  # no waiting room: refused at once
        ) as router:
            assert_openai_error(
                await router.client.post(CHAT, json=chat("nope")), 404, "model_not_found"
            )
            engine.fail_status = 500  # its probes fail: it leaves routing
            await router.wait_routable("fake-model", 0)
            assert_openai_error(
                await router.client.post(CHAT, json=chat()), 503, "no_routable_engine"
            )
            engine.fail_status = None  # and comes back without any discovery event
            await router.wait_routable("fake-model", 1)
            assert (await router.client.post(CHAT, json=chat())).status_code == 200


async def test_a_known_model_without_engine_waits_and_is_sent_the_moment_one_is_back() -> None:
    """The waiting room through the real router: the only engine leaves routing (its probes
    fail); a request for its model waits (counted in trio_router_model_queued_requests), and
    is answered by the engine once it is routable again; an unknown model is still 404."""
    engine = FakeEngine(name="e1")
    with trio.fail_after(LIMIT):
        async with open_router(
            [engine], probe={"interval_s": 0.2, "failures_to_eject": 1}
        ) as router:
            engine.fail_status = 500
            await router.wait_routable("fake-model", 0)
            assert_openai_error(
                await router.client.post(CHAT, json=chat("nope")), 404, "model_not_found"
            )
            answers: list[httpx.Response] = []

            async def waiting_request() -> None:
                answers.append(await router.client.post(CHAT, json=chat()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting_request)
                while True:  # the request is in the room: the series says so
                    text = (await router.client.get("/metrics")).text
                    if sample(
                        text, "trio_router_model_queued_requests", model="fake-model", priority="0"
                    ):
                        break
                    await trio.testing.wait_all_tasks_blocked()
                assert answers == [] and not [r for r in engine.requests if r.path == CHAT]
                engine.fail_status = None  # its next probe brings it back
            (answer,) = answers
            assert answer.status_code == 200
            assert len([r for r in engine.requests if r.path == CHAT]) == 1


async def test_body_over_the_limit_is_413() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine], server={"max_body_bytes": 1000}) as router:
            small = json.dumps(chat(pad="x" * 500)).encode()
            assert (await router.client.post(CHAT, content=small)).status_code == 200
            big = json.dumps(chat(pad="x" * 2000)).encode()
            assert_openai_error(await router.client.post(CHAT, content=big), 413, "body_too_large")

            async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted
                for _ in range(4):
                    yield b" " * 400

            assert_openai_error(
                await router.client.post(CHAT, content=chunked()), 413, "body_too_large"
            )
    assert len(engine.requests_to(CHAT)) == 1


async def test_engine_errors_pass_through_untouched() -> None:
    engine = FakeEngine(inference_fail_status=429)
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            response = await router.client.post(CHAT, json=chat())
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "RateLimitError"  # the engine's own body
    assert response.headers["x-fake-engine"] == "fake-engine"


async def test_engine_silent_past_read_timeout_is_504() -> None:
    engine = FakeEngine(ttft_s=5.0)
    with trio.fail_after(LIMIT):
        async with open_router([engine], proxy={"read_timeout_s": 0.3}) as router:
            start = trio.current_time()
            response = await router.client.post(CHAT, json=chat())
            elapsed = trio.current_time() - start
            await engine.wait_until(lambda: engine.in_flight == 0)
    assert_openai_error(response, 504, "engine_timeout")
    assert response.headers["x-trio-router-engine"] == router.engine_urls[0].split("//")[1]
    assert 0.3 <= elapsed < 2.0
    assert engine.disconnects == 1  # the router closed the upstream connection


async def test_unknown_paths_and_methods() -> None:
    with trio.fail_after(LIMIT):
        async with open_router([FakeEngine()]) as router:
            assert_openai_error(await router.client.get("/nope"), 404, "not_found")
            response = await router.client.get(CHAT)
            assert_openai_error(response, 405, "method_not_allowed")
            assert response.headers["allow"] == "POST"
            assert_openai_error(await router.client.post("/engines"), 405, "method_not_allowed")


# -- failover ---------------------------------------------------------------------------------
async def test_failover_to_another_engine_before_the_first_byte() -> None:
    engines = [FakeEngine(name="down"), FakeEngine(name="up")]
    with trio.fail_after(LIMIT):
        async with open_router(engines) as router:
            router.stop_engine(0)  # still routable as far as the router knows
            responses = [await router.client.post(CHAT, json=chat()) for _ in range(4)]
            assert all(r.status_code == 200 for r in responses)
            assert {r.headers["x-trio-router-engine"] for r in responses} == {
                router.engine_urls[1].split("//")[1]
            }
            # Passive health: the failed engine was ejected at once, not at its next probe.
            down = router.table.get(router.engine_urls[0])
            assert down is not None and not down.routable
            assert (
                await router.metric("trio_router_engine_unreachable_total", engine=down.name) == 1.0
            )
    assert len(engines[1].requests_to(CHAT)) == 4


async def test_all_engines_unreachable_is_502_after_retries() -> None:
    engines = [FakeEngine(name=f"e{i}") for i in range(4)]
    with trio.fail_after(LIMIT):
        async with open_router(
            engines, proxy={"retries": 2}, admission={"wait_for_engine": False}
        ) as router:
            for i in range(4):
                router.stop_engine(i)
            response = await router.client.post(CHAT, json=chat())
            assert_openai_error(response, 502, "engine_unreachable")
            unroutable = [e for e in router.table if not e.routable]
            assert response.headers["x-trio-router-engine"] in {e.name for e in unroutable}
            assert len(unroutable) == 3  # the first try and two retries, then it gave up
            # The fourth engine is tried by the next request; then none is left: 503.
            assert_openai_error(
                await router.client.post(CHAT, json=chat()), 502, "engine_unreachable"
            )
            assert_openai_error(
                await router.client.post(CHAT, json=chat()), 503, "no_routable_engine"
            )


async def test_a_stream_every_engine_breaks_off_ends_with_an_error_event() -> None:
    """A stream that broke off after its first event (the role: nothing generated yet) goes
    to the other engine as it is, its first event not written twice; when that one breaks off
    too, the stream ends with an error event (no [DONE]), and no engine is ejected for it."""
    engines = [FakeEngine(name=f"e{i}", abort_after_first_event=True) for i in range(2)]
    with trio.fail_after(LIMIT):
        async with open_router(engines) as router:
            async with router.client.stream("POST", CHAT, json=chat(stream=True)) as response:
                assert response.status_code == 200
                received = b"".join([chunk async for chunk in response.aiter_raw()])
            events = [e for e in received.split(b"\n\n") if e]
            assert len(events) == 2 and events[0].startswith(b"data: {")
            assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == (
                "bad_engine_response"
            )
            assert all(e.routable for e in router.table)  # a broken stream ejects nothing
    assert [len(e.requests_to(CHAT)) for e in engines] == [1, 1]  # each engine once


# -- cancellation -----------------------------------------------------------------------------
async def test_client_disconnect_mid_stream_closes_the_upstream() -> None:
    gate = trio.Event()
    engine = FakeEngine(tokens=4, gate=gate)
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            async with await open_raw(router.url) as stream:
                received = await send_raw(stream, CHAT, chat(stream=True), until=b"data: ")
            assert received.startswith(b"HTTP/1.1 200")
            # The client closed its connection; within a second the engine sees it go.
            with trio.fail_after(1.0):
                await engine.wait_until(lambda: engine.disconnects == 1)
            assert engine.completed == 0
            await router.wait_routable("fake-model", 1)
            engine_entry = next(iter(router.table))
            await engine.wait_until(lambda: engine.in_flight == 0)
            assert engine_entry.in_flight == 0
            assert (
                await router.metric(
                    "trio_router_requests_total",
                    model="fake-model",
                    engine=engine_entry.name,
                    status="499",
                )
                == 1.0
            )


async def test_client_disconnect_while_waiting_for_a_non_streamed_reply() -> None:
    gate = trio.Event()
    engine = FakeEngine(gate=gate)  # non-streamed replies wait for the gate
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(router.client.post, CHAT, json=chat()))
                await engine.wait_until(lambda: engine.in_flight == 1)
                nursery.cancel_scope.cancel()  # the client gives up and closes
            with trio.fail_after(1.0):
                await engine.wait_until(lambda: engine.disconnects == 1)
            assert all(e.in_flight == 0 for e in router.table)


# -- auth -------------------------------------------------------------------------------------
async def test_client_api_key_is_required_except_for_health_and_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUTER_KEY", "s3cret")
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine], server={"api_key_env": "ROUTER_KEY"}) as router:
            client = router.client
            for headers in [
                {},
                {"authorization": "Bearer wrong"},
                {"authorization": "s3cret"},
                {"authorization": "Basic s3cret"},
            ]:
                response = await client.post(CHAT, json=chat(), headers=headers)
                assert_openai_error(response, 401, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
                assert_openai_error(
                    await client.get("/v1/models", headers=headers), 401, "invalid_api_key"
                )
                assert_openai_error(
                    await client.get("/engines", headers=headers), 401, "invalid_api_key"
                )
            good = {"authorization": "Bearer s3cret"}
            assert (await client.post(CHAT, json=chat(), headers=good)).status_code == 200
            assert (await client.get("/v1/models", headers=good)).status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
    assert len(engine.requests_to(CHAT)) == 1
    # Without proxy.api_key_env the client's own Authorization goes on to the engine.
    assert engine.requests_to(CHAT)[0].header("authorization") == "Bearer s3cret"


async def test_an_error_answered_before_the_body_was_read_ends_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """401 and a declared 413 are answered without reading the request body, so the
    connection cannot carry another request: the answer says Connection: close and the
    router closes it. An error found after reading the body keeps the connection."""
    monkeypatch.setenv("ROUTER_KEY", "s3cret")
    good = {"authorization": "Bearer s3cret"}
    with trio.fail_after(LIMIT):
        async with open_router(
            [FakeEngine()], server={"api_key_env": "ROUTER_KEY", "max_body_bytes": 1000}
        ) as router:
            for body, headers, status in [(chat(), {}, 401), (chat(pad="x" * 2000), good, 413)]:
                stream = await open_raw(router.url)
                async with stream:
                    await send_request(stream, CHAT, body, headers)
                    answer = await receive_until(stream, b"}}")
                    assert answer.startswith(b"HTTP/1.1 %d " % status)
                    assert b"\r\nconnection: close\r\n" in answer.lower()
                    assert await stream.receive_some() == b""  # closed by the router
            stream = await open_raw(router.url)
            async with stream:
                await send_request(stream, CHAT, {"model": 7}, good)
                answer = await receive_until(stream, b"}}")
                assert answer.startswith(b"HTTP/1.1 400 ")
                assert b"connection:" not in answer.lower()
                await send_request(stream, CHAT, chat(), good)  # the same connection
                assert (await receive_until(stream, b"}}")).startswith(b"HTTP/1.1 200 ")


async def test_engine_api_key_replaces_the_clients_and_is_used_by_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENGINE_KEY", "engine-key")
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine], proxy={"api_key_env": "ENGINE_KEY"}) as router:
            await router.client.post(CHAT, json=chat(), headers={"authorization": "Bearer c"})
            await router.client.post(CHAT, json=chat())
    assert [r.header("authorization") for r in engine.requests_to(CHAT)] == [
        "Bearer engine-key"
    ] * 2
    assert engine.requests_to("/v1/models")[0].header("authorization") == "Bearer engine-key"


async def test_missing_api_key_variable_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    config = router_config(["http://127.0.0.1:9"], server={"api_key_env": "NOT_SET_ANYWHERE"})
    with trio.fail_after(LIMIT), pytest.raises(ConfigError, match="NOT_SET_ANYWHERE"):
        await server.run(config, handle_signals=False)


# -- admin ------------------------------------------------------------------------------------
async def test_engines_health_and_metrics() -> None:
    engines = [FakeEngine(name="a"), FakeEngine(name="b", models=["other"])]
    with trio.fail_after(LIMIT):
        async with open_router(engines, wait_models=["fake-model", "other"]) as router:
            await router.client.post(CHAT, json=chat())
            await router.client.post(CHAT, json=chat("missing"))
            listed = (await router.client.get("/engines")).json()["engines"]
            health = await router.client.get("/health")
            text = (await router.client.get("/metrics")).text
    assert sorted(e["url"] for e in listed) == sorted(router.engine_urls)
    assert all(e["healthy"] and e["state"] == "routable" for e in listed)
    assert {tuple(e["models"]) for e in listed} == {("fake-model",), ("other",)}
    served = next(e for e in listed if e["models"] == ["fake-model"])["requests"]
    assert served["requests"] == 1 and served["errors"] == 0
    assert served["ttfb_s"] > 0 and served["latency_s"] >= served["ttfb_s"]
    assert served["requests_per_s"] > 0
    assert health.status_code == 200 and health.json()["status"] == "ok"
    name = router.engine_urls[0].split("//")[1]
    assert (
        sample(text, "trio_router_requests_total", model="fake-model", engine=name, status="200")
        == 1.0
    )
    assert sample(text, "trio_router_requests_total", model="", engine="", status="404") == 1.0
    assert sample(text, "trio_router_routable_engines") == 2.0
    assert sample(text, "trio_router_in_flight_requests", engine=name) == 0.0
    assert sample(text, "trio_router_request_duration_seconds_count", model="fake-model") == 1.0
    assert sample(text, "trio_router_time_to_first_byte_seconds_count", model="fake-model") == 1.0
    assert sample(text, "trio_router_discovery_healthy") == 1.0
    assert '"missing"' not in text  # unknown model names never become label values


async def test_engines_are_filtered_by_model_and_state() -> None:
    """GET /engines?model=M&state=S lists only those engines; an unknown parameter or state
    is a 400 naming it."""
    engines = [FakeEngine(name="a"), FakeEngine(name="b", models=["other"])]
    with trio.fail_after(LIMIT):
        async with open_router(engines, wait_models=["fake-model", "other"]) as router:
            client = router.client
            other = (await client.get("/engines", params={"model": "other"})).json()["engines"]
            both = await client.get("/engines", params={"model": "other", "state": "routable"})
            none = await client.get("/engines", params={"state": "unhealthy"})
            bad_state = await client.get("/engines", params={"state": "sleeping"})
            bad_name = await client.get("/engines", params={"pool": "x"})
    assert [e["models"] for e in other] == [["other"]]
    assert [e["models"] for e in both.json()["engines"]] == [["other"]]
    assert none.json() == {"engines": []}
    assert_openai_error(bad_state, 400, "bad_request")
    assert "'sleeping'" in bad_state.json()["error"]["message"]
    assert_openai_error(bad_name, 400, "bad_request")
    assert "'pool'" in bad_name.json()["error"]["message"]


async def test_version_needs_no_key_and_tells_the_engines_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUTER_KEY", "k")
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    with trio.fail_after(LIMIT):
        async with open_router(engines, server={"api_key_env": "ROUTER_KEY"}) as router:
            answer = await router.client.get("/version")
            engines_answer = await router.client.get("/engines")
    assert answer.status_code == 200
    assert answer.json() == {"version": __version__, "engine_versions": {"0.0.0-fake": 2}}
    assert [len([r for r in e.requests if r.path == "/version"]) for e in engines] == [1, 1]
    assert engines_answer.status_code == 401  # the router's other endpoints still ask for it


async def test_in_flight_is_exact_while_streaming() -> None:
    gate = trio.Event()
    engine = FakeEngine(gate=gate)
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            name = router.engine_urls[0].split("//")[1]
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(partial(router.client.post, CHAT, json=chat(stream=True)))
                await engine.wait_until(lambda: engine.in_flight == 3)
                assert await router.metric("trio_router_in_flight_requests", engine=name) == 3.0
                gate.set()
            assert await router.metric("trio_router_in_flight_requests", engine=name) == 0.0
