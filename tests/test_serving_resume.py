"""Answers whose engine fails before their end (`proxy.resume`): a whole (non-streamed) answer
is held until its body is in, so an engine that breaks it off leaves nothing at the client and
another engine answers instead. Fake engines over real HTTP on 127.0.1.x, the real router on
loopback; real clock, each test bounded."""

from __future__ import annotations

import json
from typing import Final

import httpx
import pytest
import trio

from trio_router.testing import FakeEngine
from trio_router.testing.harness import CHAT, chat, open_router

LIMIT: Final = 10.0


async def resumes(router: object, reason: str, outcome: str) -> float:
    value: float = await router.metric(  # type: ignore[attr-defined]
        "trio_router_stream_resumes_total", model="fake-model", reason=reason, outcome=outcome
    )
    return value


async def test_a_whole_answer_broken_off_is_answered_by_another_engine() -> None:
    """Half of one engine's answers arrive; the client gets each answer whole, from the
    other engine, and the breaks are counted (and count against the engine's health)."""
    breaking, healthy = FakeEngine(name="breaking", break_whole_replies=True), FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([breaking, healthy], proxy={"eject_after_failures": 0}) as router:
            answers = [await router.client.post(CHAT, json=chat()) for _ in range(4)]
            retried = await resumes(router, "closed", "retried")
            engine_of_breaking = router.engine_urls[0].removeprefix("http://")
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json()["object"] == "chat.completion" for a in answers)  # whole JSON
    assert {a.headers["x-trio-router-engine"] for a in answers} == {
        router.engine_urls[1].removeprefix("http://")
    }
    assert engine_of_breaking not in {a.headers["x-trio-router-engine"] for a in answers}
    assert retried == len(breaking.requests_to(CHAT)) >= 1
    assert len(healthy.requests_to(CHAT)) == 4


async def test_with_resume_off_a_broken_whole_answer_is_cut() -> None:
    """`proxy.resume = "off"`: the answer passes as it comes, and its break cuts the client's
    connection before the end of its body, as before."""
    engines = [FakeEngine(name="breaking", break_whole_replies=True), FakeEngine()]
    with trio.fail_after(LIMIT):
        async with open_router(engines, proxy={"resume": "off"}) as router:
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in range(2):  # one of them goes to the breaking engine
                    await router.client.post(CHAT, json=chat())
    assert len(engines[0].requests_to(CHAT)) == 1


async def test_retries_stop_after_resume_attempts() -> None:
    """Every engine breaks its answers: the request is tried on 1 + `resume_attempts`
    engines, then the client gets the last failure (502), counted as failed."""
    engines = [FakeEngine(name=f"b{i}", break_whole_replies=True) for i in range(4)]
    proxy = {"resume_attempts": 2, "eject_after_failures": 0}
    with trio.fail_after(LIMIT):
        async with open_router(engines, proxy=proxy) as router:
            answer = await router.client.post(CHAT, json=chat())
            failed = await resumes(router, "closed", "failed")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "bad_engine_response"
    assert sum(len(e.requests_to(CHAT)) for e in engines) == 3
    assert failed == 1


async def test_the_last_engine_breaking_leaves_its_failure_as_the_answer() -> None:
    """No other engine to take the request: the failure is the answer (not "no engine")."""
    engines = [FakeEngine(name="only", break_whole_replies=True)]
    with trio.fail_after(LIMIT):
        async with open_router(engines) as router:
            answer = await router.client.post(CHAT, json=chat())
            failed = await resumes(router, "closed", "failed")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "bad_engine_response"
    assert failed == 1


async def test_a_broken_stream_ends_with_an_error_event_not_a_silent_cut() -> None:
    """Streams are not continued yet: one whose engine breaks off ends with an error event
    in its API's shape (OpenAI's `{"error": ...}`; Anthropic's `event: error`), counted as
    not resumable."""
    engines = [FakeEngine(name="e", abort_after_first_event=True)]
    anthropic = {"model": "fake-model", "max_tokens": 8, "stream": True}
    anthropic["messages"] = [{"role": "user", "content": "hi"}]
    with trio.fail_after(LIMIT):
        async with open_router(engines, proxy={"eject_after_failures": 0}) as router:
            openai = await router.client.post(CHAT, json=chat(stream=True))
            messages = await router.client.post("/v1/messages", json=anthropic)
            counted = await resumes(router, "closed", "not_resumable")
    last = openai.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "bad_engine_response"
    assert b"[DONE]" not in openai.content
    event, data = messages.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].split(b"\n")
    assert event == b"event: error"
    assert json.loads(data.removeprefix(b"data: "))["type"] == "error"
    assert counted == 2
