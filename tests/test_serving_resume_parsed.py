"""Reasoning and tool-call streams carried on when their engine fails mid-answer: through the
engine's parsers (vLLM's render, generate and derender endpoints: `serving.resume.parsed`),
or, before anything was generated, as the request itself again. Fake engines with a
reasoning and a tool parser over real HTTP on 127.0.1.x, the real router on loopback; real
clock, each test bounded."""

from __future__ import annotations

import json
import logging
from typing import Any, Final

import pytest
import trio
import trio.testing

from trio_router.serving.resume import not_resumable
from trio_router.table import EngineState
from trio_router.testing import FakeEngine
from trio_router.testing.fake_replies import REPLY_TOKEN, REPLY_WORDS
from trio_router.testing.harness import CHAT, chat, open_router

LIMIT: Final = 10.0
DERENDER: Final = "/v1/chat/completions/derender"
GENERATE: Final = "/inference/v1/generate"
RENDER: Final = "/v1/chat/completions/render"
CALLS: Final = [
    ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ("get_time", '{"zone": "Europe/Paris"}'),
]
TOOLS: Final = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name, _ in CALLS
]


def events(body: bytes) -> list[Any]:
    """The JSON events of an SSE body, and "[DONE]"."""
    out: list[Any] = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: "):
            data = event.removeprefix(b"data: ")
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def texts(stream: list[Any]) -> tuple[str, str]:
    """The reasoning and the content a client puts together from a chat stream."""
    reasoning = content = ""
    for event in stream:
        if event == "[DONE]" or not event.get("choices"):
            continue
        delta = event["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
    return reasoning, content


def calls(stream: list[Any]) -> list[dict[str, str]]:
    """The tool calls a client puts together from a chat stream: id, name, arguments."""
    made: dict[int, dict[str, str]] = {}
    for event in stream:
        if event == "[DONE]" or not event.get("choices"):
            continue
        for call in event["choices"][0]["delta"].get("tool_calls") or ():
            one = made.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in call:
                assert not one["id"], f"call {call['index']} given a second id"
                one["id"] = call["id"]
            function = call.get("function") or {}
            one["name"] += function.get("name") or ""
            one["arguments"] += function.get("arguments") or ""
    return [made[i] for i in sorted(made)]


def thinking(name: str, **knobs: Any) -> FakeEngine:
    """An engine with a reasoning parser (8 reasoning tokens, then 6 of content) and a tool
    parser, serving the scale-out endpoints unless told otherwise."""
    given: dict[str, Any] = {"reasoning_tokens": 8, "tokens": 6, "tool_calls": CALLS}
    return FakeEngine(name=name, **(given | {"scale_out": True} | knobs))


def once(stream: list[Any]) -> None:
    """One [DONE], at the end; one id, created and model throughout."""
    assert [e for e in stream if e == "[DONE]"] == ["[DONE]"] and stream[-1] == "[DONE]"
    heads = {(e["id"], e["created"], e["model"]) for e in stream[:-1]}
    assert len(heads) == 1, heads


async def resumes(router: object, reason: str, outcome: str, kind: str = "content") -> float:
    value: float = await router.metric(  # type: ignore[attr-defined]
        "trio_router_stream_resumes_total",
        model="fake-model",
        kind=kind,
        reason=reason,
        outcome=outcome,
    )
    return value


async def uninterrupted(body: dict[str, Any], **knobs: Any) -> list[Any]:
    """The stream of `body` from one engine that does not fail."""
    async with open_router([thinking("whole", **knobs)]) as router:
        answer = await router.client.post(CHAT, json=body)
    return events(answer.content)


@pytest.mark.parametrize("cut_after", [4, 11])  # inside the reasoning; in the content
async def test_a_reasoning_stream_is_carried_on_by_the_engines_parsers(cut_after: int) -> None:
    """The engine breaks off after `cut_after` events, inside the reasoning or after it:
    the client's reasoning and content are those of an uninterrupted answer, the switch to
    content where the model ended its reasoning, under one id with one [DONE] and a usage
    object counting the original prompt and every completion token. The continuation went
    through render, generate (the prompt's ids and those sent) and one derender per read."""
    first, other = thinking("first", break_after_events=cut_after), thinking("other")
    body = chat(stream=True, stream_options={"include_usage": True})
    with trio.fail_after(LIMIT):
        whole = await uninterrupted(body)
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=body)
            resumed = await resumes(router, "closed", "resumed", "reasoning")
            paused = await router.metric(
                "trio_router_stream_handover_seconds_count", model="fake-model", reason="closed"
            )
    stream = events(answer.content)
    assert answer.status_code == 200 and paused == 1  # the client's pause, timed
    once(stream)
    assert texts(stream) == texts(whole)
    assert texts(stream) == ("".join(REPLY_WORDS[:8]), "".join(REPLY_WORDS[9:15]))
    usage = stream[-2]["usage"]
    assert usage == whole[-2]["usage"] and usage["completion_tokens"] == 8 + 1 + 6 + 1  # and eos
    assert all(e["choices"][0].get("token_ids") is None for e in stream[:-2])
    assert resumed == 1
    sent = cut_after - 1  # the first event carries no token
    (generate,) = other.requests_to(GENERATE)
    prompt = generate.json()["token_ids"]
    assert prompt[-sent:] == [REPLY_TOKEN + i for i in range(sent)]
    assert len(other.requests_to(RENDER)) == 1 and other.derenders >= 1
    state = other.requests_to(DERENDER)[0].json()["stream_state"]
    assert state["output_token_ids"] == [REPLY_TOKEN + i for i in range(sent)]
    assert state["output_chunk_lens"] == [1] * sent and state["role_sent"] is True
    assert first.derenders == 0 and first.requests_to(RENDER) == []


async def test_a_healthy_reasoning_stream_makes_no_parser_call() -> None:
    """A reasoning stream whose engine does not fail passes as it comes (its token ids
    nulled, as the client did not ask for them): no render, generate or derender call."""
    engine = thinking("only")
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
    stream = events(answer.content)
    once(stream)
    assert texts(stream) == ("".join(REPLY_WORDS[:8]), "".join(REPLY_WORDS[9:15]))
    assert all(e["choices"][0].get("token_ids") is None for e in stream[1:-1])
    assert engine.derenders == 0 and engine.requests_to(GENERATE) == []


@pytest.mark.parametrize("cut_after", [14, 20])  # inside the first call's arguments; between
async def test_a_tool_call_stream_keeps_the_ids_the_client_has(cut_after: int) -> None:
    """Tool calls (auto tool choice) broken off mid-stream: each call's name and arguments
    arrive whole, once; a call the client had begun keeps its id, a call begun after the
    seam gets a fresh id from the engine that made it; the finish is "tool_calls"."""
    first, other = thinking("first", break_after_events=cut_after), thinking("other")
    body = chat(stream=True, tools=TOOLS)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=body)
    stream = events(answer.content)
    once(stream)
    made = calls(stream)
    assert [(c["name"], c["arguments"]) for c in made] == CALLS
    assert made[0]["id"].startswith("chatcmpl-tool-first-")  # begun before the seam
    assert made[1]["id"].startswith("chatcmpl-tool-other-")  # begun after it
    assert stream[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert texts(stream)[0] == "".join(REPLY_WORDS[:8])
    pinned = other.requests_to(DERENDER)[0].json()["stream_state"]["last_tool_call_ids"]
    assert pinned == [made[0]["id"]]


async def test_a_stream_with_nothing_generated_goes_again_as_itself() -> None:
    """The engine broke off after its first event (the role): the request itself goes to
    another engine (no parser endpoint needed), whose role event is not written twice."""
    first = thinking("first", break_after_events=1, scale_out=False)
    other = thinking("other", scale_out=False)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
    stream = events(answer.content)
    once(stream)
    assert [e for e in stream[:-1] if "role" in e["choices"][0]["delta"]] == stream[:1]
    assert texts(stream) == ("".join(REPLY_WORDS[:8]), "".join(REPLY_WORDS[9:15]))
    assert len(other.requests_to(CHAT)) == 1 and other.requests_to(GENERATE) == []


async def test_without_the_parser_endpoints_the_stream_ends_with_an_error_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The other engine does not serve the scale-out endpoints (vLLM without
    --enable-scale-out): the reasoning stream cannot be carried on; it ends with an error
    event, not a silent cut, and the log says why."""
    first = thinking("first", break_after_events=4, scale_out=False)
    other = thinking("other", scale_out=False)
    with trio.fail_after(LIMIT):
        async with open_router([first, other], proxy={"eject_after_failures": 0}) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
    stream = events(answer.content)
    assert "[DONE]" not in stream and stream[-1]["error"]["code"] == "bad_engine_response"
    assert texts(stream[:-1])[0] == "".join(REPLY_WORDS[:3])
    assert any("--enable-scale-out" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("payload", "kind", "why"),
    [
        ({"messages": [], "response_format": {"type": "json_object"}}, "chat", "grammar"),
        ({"messages": [], "tools": TOOLS, "tool_choice": "required"}, "chat", "required"),
        ({"messages": [], "tools": TOOLS, "tool_choice": {"type": "function"}}, "chat", "req"),
        (
            {"messages": [], "tools": [{"function": {"name": "f", "strict": True}}]},
            "chat",
            "strict",
        ),
        ({"messages": [], "logprobs": True}, "chat", "log probabilities"),
        ({"messages": [], "n": 2}, "chat", "n > 1"),
        ({"messages": [], "include_reasoning": False}, "chat", "reasoning"),
        ({"messages": [], "tools": TOOLS}, "chat", None),
        ({"messages": [], "tools": TOOLS, "tool_choice": "none"}, "chat", None),
        ({"messages": [], "frequency_penalty": 0.5}, "chat", None),
        ({"prompt": "hi", "logprobs": 2}, "completion", None),
    ],
)
def test_what_cannot_be_carried_on_is_named(
    payload: dict[str, Any], kind: str, why: str | None
) -> None:
    """Each case of docs/serving.md's table: a reason, or None (carried on)."""
    reason = not_resumable(payload, kind)
    if why is None:
        assert reason is None
    else:
        assert reason is not None and why in reason


async def test_a_grammar_stream_ends_with_an_error_event_and_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Structured output broken off mid-stream: a continuation would restart its grammar,
    so the stream ends with an error event, and the log names why it was not carried on."""
    caplog.set_level(logging.WARNING)
    engines = [FakeEngine(name=f"e{i}", tokens=12, break_after_events=4) for i in range(2)]
    body = chat(stream=True, response_format={"type": "json_object"})
    with trio.fail_after(LIMIT):
        async with open_router(engines, proxy={"eject_after_failures": 0}) as router:
            answer = await router.client.post(CHAT, json=body)
    stream = events(answer.content)
    assert "[DONE]" not in stream and stream[-1]["error"]["code"] == "bad_engine_response"
    assert any("structured output" in r.getMessage() for r in caplog.records)


async def test_a_parsed_continuation_whose_engine_leaves_is_handed_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reasoning stream carried on through the parsers at a second engine, whose pod then
    goes away mid-continuation: its generate stream is broken off at once and a third engine
    carries the answer on, whole."""
    first = thinking("first", break_after_events=4, reasoning_tokens=30)
    second = thinking("second", reasoning_tokens=30, inter_token_s=0.1)
    third = thinking("third", reasoning_tokens=30)
    body = chat(stream=True)
    with trio.fail_after(120):
        whole = texts(await uninterrupted(body, reasoning_tokens=30))
        async with open_router([first, second, third], routing={"policy": "round_robin"}) as router:
            by_name = {e.name: e for e in router.table}
            engines = [by_name[u.removeprefix("http://")] for u in router.engine_urls]
            router.table.set_pending(engines[2].uid, "not Ready")  # not the first continuation's
            answers: list[Any] = []

            async def ask() -> None:
                answers.append(await router.client.post(CHAT, json=body))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await second.wait_until(lambda: second.derenders >= 3)
                engines[2].state = EngineState.ROUTABLE  # back, as a probe would have it
                router.table.put(engines[2])
                router.table.set_pending(engines[1].uid, "terminating")
                assert engines[1].leaving("terminating") == 1
    (answer,) = answers
    stream = events(answer.content)
    once(stream)
    assert texts(stream) == whole
    assert len(third.requests_to(GENERATE)) == 1 and third.derenders >= 1
