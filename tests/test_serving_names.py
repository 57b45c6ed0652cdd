"""Model aliases and fallback models (`serving.names`): the rewriting of the engine's echo at
every split of its answer, and end to end through the router in front of fake engines."""

from __future__ import annotations

import itertools
import json
import logging
import re
from functools import partial
from typing import Any

import openai
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from trio_router.serving.names import ModelEcho, ModelNames
from trio_router.testing import FakeEngine
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router

MODEL_HEADER = "x-trio-router-model"
ENGINE_HEADER = "x-trio-router-engine"


# -- the echo ---------------------------------------------------------------------------------
ANSWER = (
    b'data: {"id":"x","model":"tiny-model","choices":[{"delta":{"content":"a \\"model\\":'
    b'\\"tiny-model\\" b"}}]}\n\n'
    b'data: {"model" : "tiny-model", "object":"chat.completion.chunk"}\n\n'
    b'data: {"model":"tiny-model-2"}\n\n'
    b'{"model":"other","root":"tiny-model"}'
)


def test_echo_rewrites_the_model_member_only() -> None:
    # The text inside a string (escaped quotes) and other members are left alone.
    echo = ModelEcho("tiny-model", "chat")
    out = echo.feed(ANSWER, final=True)
    assert out.count(b'"model":"chat"') == 2
    assert b'\\"model\\":\\"tiny-model\\"' in out
    assert b'"root":"tiny-model"' in out


@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=12))
def test_echo_is_the_same_at_every_split(cuts: list[int]) -> None:
    whole = ModelEcho("tiny-model", "chat").feed(ANSWER, final=True)
    echo = ModelEcho("tiny-model", "chat")
    bounds = [0, *sorted(cuts), len(ANSWER)]
    pieces = [ANSWER[a:b] for a, b in itertools.pairwise(bounds)]
    out = b"".join(echo.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
    assert out == whole


def test_chains_resolve_aliases() -> None:
    names = ModelNames({"chat": "big", "small-alias": "small"}, {"big": ["small-alias", "tiny"]})
    assert names.chain("chat") == names.chain("big") == ("big", "small", "tiny")
    assert names.chain("small-alias") == ("small",)
    assert names.chain("unknown") == ("unknown",)
    assert names.echo("chat", "big") is not None
    assert names.echo("chat", "small") is None  # a fallback's answer says which model it is
    assert names.echo("big", "big") is None


# -- aliases ----------------------------------------------------------------------------------
def use_alias(url: str) -> dict[str, Any]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=LIMIT) as client:
        messages: Any = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="chat", messages=messages)
        chunks = list(client.chat.completions.create(model="chat", messages=messages, stream=True))
        return {
            "models": sorted(m.id for m in client.models.list()),
            "retrieved": client.models.retrieve("chat").id,
            "model": reply.model,
            "text": reply.choices[0].message.content,
            "stream_models": {c.model for c in chunks},
            "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        }


async def test_an_alias_is_its_model_to_the_engine_and_itself_to_the_client() -> None:
    engine = FakeEngine(tokens=3)
    with trio.fail_after(LIMIT):
        async with open_router([engine], routing={"aliases": {"chat": "fake-model"}}) as router:
            out = await trio.to_thread.run_sync(use_alias, router.url)
            listed = (await router.client.get("/v1/models")).json()["data"]
            direct = await router.client.post(CHAT, json=chat())
            response = await router.client.post(CHAT, json=chat("chat"))
    assert out == {
        "models": ["chat", "fake-model"],
        "retrieved": "chat",
        "model": "chat",
        "text": "Hello from a",
        "stream_models": {"chat"},
        "streamed": "Hello from a",
    }
    cards = {card["id"]: card for card in listed}
    assert {**cards["fake-model"], "id": "chat"} == cards["chat"]  # the model's card
    assert {r.json()["model"] for r in engine.requests_to(CHAT)} == {"fake-model"}
    assert direct.json()["model"] == "fake-model"  # the model's own name is not rewritten
    assert response.headers[MODEL_HEADER] == "fake-model"
    assert response.json()["model"] == "chat"


async def test_a_large_body_for_an_alias_is_rewritten_whole() -> None:
    engine = FakeEngine()
    big = "word " * 300_000  # over the size parsed in a worker thread
    with trio.fail_after(LIMIT):
        async with open_router([engine], routing={"aliases": {"chat": "fake-model"}}) as router:
            body = chat("chat", messages=[{"role": "user", "content": big}], max_tokens=2)
            response = await router.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert engine.requests_to(CHAT)[-1].json() == {**body, "model": "fake-model"}


# -- fallbacks --------------------------------------------------------------------------------
def fallback_router(engines: list[FakeEngine], **sections: Any) -> Any:
    return open_router(
        engines,
        wait_models=["big-model", "fake-model"],
        routing={"fallbacks": {"big-model": ["fake-model"]}},
        **sections,
    )


async def fell_back(router: Any, reason: str) -> float:
    """How many requests for big-model went to fake-model for `reason`."""
    value: float = await router.metric(
        "trio_router_model_fallbacks_total", model="big-model", fallback="fake-model", reason=reason
    )
    return value


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="trio_router.access")
    return caplog


def records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "trio_router.access"]  # type: ignore[attr-defined]


async def test_a_model_with_no_engine_falls_back(access: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(name="small")
    with trio.fail_after(LIMIT):
        async with open_router(
            [engine], routing={"fallbacks": {"big-model": ["fake-model"]}}
        ) as router:
            response = await router.client.post(CHAT, json=chat("big-model"))
            count = await fell_back(router, "no_engine")
            unknown = await router.client.post(CHAT, json=chat("nothing"))
    assert response.status_code == 200, response.text
    assert response.headers[MODEL_HEADER] == "fake-model"
    assert response.json()["model"] == "fake-model"  # the fallback's own answer
    assert engine.requests_to(CHAT)[-1].json()["model"] == "fake-model"
    assert count == 1
    (record, _unknown) = records(access)
    assert (record["model"], record["served_model"], record["status"]) == (
        "big-model",
        "fake-model",
        200,
    )
    lines = [r.getMessage() for r in access.records if r.name == "trio_router.access"]
    assert "big-model(fake-model)" in lines[0]
    assert unknown.status_code == 404


async def test_engines_that_all_refuse_send_the_request_to_the_fallback() -> None:
    big = [FakeEngine(name=f"big{i}", models=["big-model"]) for i in range(2)]
    small = FakeEngine(name="small", tokens=2)
    big[0].inference_fail_status = 503
    big[1].inference_fail_status = 429
    with trio.fail_after(LIMIT):
        async with fallback_router([*big, small]) as router:
            response = await router.client.post(CHAT, json=chat("big-model", stream=True))
            reason = await fell_back(router, "engines_refused")
            # One engine refusing is not the model refusing: the next engine takes it.
            big[1].inference_fail_status = None
            second = await router.client.post(CHAT, json=chat("big-model"))
            third = await router.client.post(CHAT, json=chat("big-model"))
            # Every model refusing: the last engine's answer, as it sent it.
            big[1].inference_fail_status = 429
            small.inference_fail_status = 429
            last = await router.client.post(CHAT, json=chat("big-model"))
    assert response.status_code == 200, response.text
    assert response.headers[MODEL_HEADER] == "fake-model"
    assert "data: [DONE]" in response.text
    assert [len(e.requests_to(CHAT)) >= 1 for e in big] == [True, True]
    assert reason == 1
    assert {second.headers[MODEL_HEADER], third.headers[MODEL_HEADER]} == {"big-model"}
    assert {second.headers[ENGINE_HEADER], third.headers[ENGINE_HEADER]} == {
        router.engine_urls[1].removeprefix("http://")
    }
    assert last.status_code == 429
    assert last.json()["error"]["message"] == "small refuses"
    assert last.headers[ENGINE_HEADER] == router.engine_urls[2].removeprefix("http://")


async def test_an_engine_that_keeps_refusing_is_ejected_though_a_fallback_took_its_requests() -> (
    None
):
    """A refusal (503, with `proxy.eject_on_5xx`) is the engine's answer for its health, as any
    other: two in a row eject it (`eject_after_failures` = 2), although a fallback model took
    both requests."""
    big = [FakeEngine(name=f"big{i}", models=["big-model"]) for i in range(2)]
    big[0].inference_fail_status = 503
    proxy = {"eject_on_5xx": True, "eject_after_failures": 2, "max_ejected_percent": 100}
    with trio.fail_after(LIMIT):
        async with fallback_router([*big, FakeEngine(name="small")], proxy=proxy) as router:
            big[1].inference_fail_status = 503
            for _ in range(2):  # each goes to both big engines, then to the fallback
                response = await router.client.post(CHAT, json=chat("big-model"))
                assert response.headers[MODEL_HEADER] == "fake-model"
            routable = {e.name for e in router.table.routable("big-model")}
    assert routable == set()  # both ejected by their refusals


async def test_a_large_streamed_request_falls_back_with_its_own_members() -> None:
    """A large streamed chat, sent on with `return_token_ids` (`proxy.resume`), whose
    engine refuses: the fallback's engine gets it with its model replaced, asked for token
    ids once, the client's members unchanged; the client, who did not ask for token ids,
    gets none."""
    big = FakeEngine(name="big", models=["big-model"])
    big.inference_fail_status = 503
    small = FakeEngine(name="small", tokens=3)
    body = chat("big-model", stream=True, messages=[{"role": "user", "content": "x" * (1 << 20)}])
    with trio.fail_after(LIMIT):
        async with fallback_router([big, small]) as router:
            response = await router.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert "data: [DONE]" in response.text and '"token_ids":[' not in response.text
    assert big.requests_to(CHAT)[-1].json() == {**body, "return_token_ids": True}
    sent = small.requests_to(CHAT)[-1].body
    assert sent.count(b'"return_token_ids"') == 1
    assert json.loads(sent) == {**body, "model": "fake-model", "return_token_ids": True}


async def test_without_fallbacks_an_engines_refusal_is_the_answer() -> None:
    engines = [FakeEngine(name=f"e{i}") for i in range(2)]
    for engine in engines:
        engine.inference_fail_status = 503
    with trio.fail_after(LIMIT):
        async with open_router(engines) as router:
            response = await router.client.post(CHAT, json=chat())
    assert response.status_code == 503
    assert sum(len(e.requests_to(CHAT)) for e in engines) == 1  # no second engine tried


async def test_a_saturated_model_falls_back() -> None:
    big = FakeEngine(name="big", models=["big-model"], gate=trio.Event())
    small = FakeEngine(name="small")
    with trio.fail_after(LIMIT):
        async with (
            fallback_router(
                [big, small], admission={"max_in_flight_per_engine": 1, "queue_size": 0}
            ) as router,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(partial(router.client.post, CHAT, json=chat("big-model")))
            await big.wait_until(lambda: big.in_flight == 1)
            response = await router.client.post(CHAT, json=chat("big-model"))
            count = await fell_back(router, "queue_full")
            assert big.gate is not None
            big.gate.set()
    assert response.status_code == 200, response.text
    assert response.headers[MODEL_HEADER] == "fake-model"
    assert count == 1


async def test_a_fallback_may_be_an_alias_and_an_alias_may_fall_back() -> None:
    small = FakeEngine(name="small")
    routing = {
        "aliases": {"chat": "big-model", "tiny": "fake-model"},
        "fallbacks": {"big-model": ["tiny"]},
    }
    with trio.fail_after(LIMIT):
        async with open_router([small], routing=routing) as router:
            response = await router.client.post(CHAT, json=chat("chat"))
    assert response.status_code == 200, response.text
    assert response.headers[MODEL_HEADER] == "fake-model"
    assert small.requests_to(CHAT)[-1].json()["model"] == "fake-model"
    assert response.json()["model"] == "fake-model"


def test_config_errors_name_the_key() -> None:
    from trio_router.config import parse_config
    from trio_router.errors import ConfigError

    for raw, message in (
        ({"aliases": {"a": "b", "b": "c"}}, "routing.aliases.a names 'b', which is an alias"),
        ({"fallbacks": {"m": ["m"]}}, "routing.fallbacks.m must not name 'm' itself"),
        ({"fallbacks": {"m": []}}, "routing.fallbacks.m must be a non-empty list"),
        ({"fallbacks": {"m": ["a", "a"]}}, "routing.fallbacks.m names a model twice"),
        (
            {"aliases": {"a": "m"}, "fallbacks": {"a": ["x"]}},
            "routing.fallbacks.a: 'a' is an alias",
        ),
        ({"aliases": {"a": 1}}, "routing.aliases.a must be str"),
        ({"aliases": "x"}, "routing.aliases must be a table"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({"routing": raw})
    assert parse_config({"routing": {"aliases": {"a/b.c": "m"}}}).routing.aliases == {"a/b.c": "m"}
