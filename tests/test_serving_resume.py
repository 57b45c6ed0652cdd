"""Answers whose engine fails before their end (`proxy.resume`): a whole (non-streamed) answer
is held until its body is in, so an engine that breaks it off leaves nothing at the client and
another engine answers instead. Fake engines over real HTTP on 127.0.1.x, the real router on
loopback; real clock, each test bounded."""

from __future__ import annotations

import json
import logging
from typing import Any, Final

import httpx
import pytest
import trio

from test_serving_hardening import AccessRecords
from trio_router.http import MalformedResponseError
from trio_router.serving.resume import MAX_EVENT_BYTES, Track
from trio_router.testing import FakeEngine
from trio_router.testing.fake_replies import REPLY_TOKEN, REPLY_WORDS
from trio_router.testing.harness import CHAT, chat, open_raw, open_router, send_raw

LIMIT: Final = 10.0


async def resumes(router: object, reason: str, outcome: str, kind: str = "content") -> float:
    value: float = await router.metric(  # type: ignore[attr-defined]
        "trio_router_stream_resumes_total",
        model="fake-model",
        kind=kind,
        reason=reason,
        outcome=outcome,
    )
    return value


async def test_a_whole_answer_broken_off_is_answered_by_another_engine() -> None:
    """Half of one engine's answers arrive; the client gets each answer whole, from the
    other engine, and the breaks are counted (and count against the engine's health)."""
    breaking, healthy = FakeEngine(name="breaking", break_whole_replies=True), FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([breaking, healthy], proxy={"eject_after_failures": 0}) as router:
            answers = [await router.client.post(CHAT, json=chat()) for _ in range(4)]
            retried = await resumes(router, "closed", "retried", "whole")
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
            failed = await resumes(router, "closed", "failed", "whole")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "bad_engine_response"
    assert sum(len(e.requests_to(CHAT)) for e in engines) == 3
    assert failed == 1


async def test_the_last_engine_breaking_leaves_its_failure_as_the_answer() -> None:
    """No other engine to take the request: the failure is the answer (not "no engine")."""
    engines = [FakeEngine(name="only", break_whole_replies=True)]
    with trio.fail_after(LIMIT):
        async with open_router(engines) as router:
            answer = await router.client.post(CHAT, json=chat())
            failed = await resumes(router, "closed", "failed", "whole")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "bad_engine_response"
    assert failed == 1


async def test_a_stream_that_cannot_be_carried_on_ends_with_an_error_event() -> None:
    """A stream a continuation cannot carry on (Anthropic's /v1/messages; several choices)
    ends with an error event in its API's shape and a clean end, never a silent cut."""
    engines = [FakeEngine(name=f"e{i}", abort_after_first_event=True) for i in range(2)]
    anthropic = {"model": "fake-model", "max_tokens": 8, "stream": True}
    anthropic["messages"] = [{"role": "user", "content": "hi"}]
    with trio.fail_after(LIMIT):
        async with open_router(engines, proxy={"eject_after_failures": 0}) as router:
            openai = await router.client.post(CHAT, json=chat(stream=True, n=2))
            messages = await router.client.post("/v1/messages", json=anthropic)
            counted = await resumes(router, "closed", "not_resumable")
    last = openai.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "bad_engine_response"
    assert b"[DONE]" not in openai.content
    event, data = messages.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].split(b"\n")
    assert event == b"event: error"
    assert json.loads(data.removeprefix(b"data: "))["type"] == "error"
    assert counted == 2
    assert sum(len(e.requests_to(CHAT)) for e in engines) == 1  # never sent again


# -- streams carried on ---------------------------------------------------------------------
def events(body: bytes) -> list[Any]:
    """The JSON events of an SSE body, and "[DONE]"."""
    out: list[Any] = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: "):
            data = event.removeprefix(b"data: ")
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def text_of(stream: list[Any], *, chat_stream: bool = True) -> str:
    return "".join(
        (e["choices"][0]["delta"].get("content") or "") if chat_stream else e["choices"][0]["text"]
        for e in stream
        if e != "[DONE]" and e["choices"]
    )


WHOLE: Final = "".join(REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(12))


async def test_a_stream_broken_mid_answer_is_carried_on_by_another_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine closes the connection after 5 events: the client gets one stream, the
    same text as an uninterrupted answer, under one id, created and model, one [DONE], no
    token ids (it did not ask for them). The access record names both engines, in order."""
    caplog.set_level(logging.INFO, logger="trio_router.access")
    first = FakeEngine(name="first", tokens=12, break_after_events=5)
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
            resumed = await resumes(router, "closed", "resumed")
            continuation = other.requests_to("/v1/completions")
    stream = events(answer.content)
    assert answer.status_code == 200 and stream[-1] == "[DONE]"
    assert [e for e in stream if e == "[DONE]"] == ["[DONE]"]
    assert text_of(stream) == WHOLE
    heads = {(e["id"], e["created"], e["model"], e["object"]) for e in stream[:-1]}
    assert len(heads) == 1 and next(iter(heads))[3] == "chat.completion.chunk"
    assert all(e["choices"][0].get("token_ids") is None for e in stream[:-1])
    assert stream[-2]["choices"][0]["finish_reason"] == "stop"
    assert resumed == 1
    (sent,) = continuation
    body = sent.json()
    assert body["prompt"][-4:] == [REPLY_TOKEN + i for i in range(4)]  # 4 tokens sent
    assert body["stream"] is True and body["return_token_ids"] is True
    (access,) = (r for r in caplog.records if r.name == "trio_router.access")
    fields = access.fields  # type: ignore[attr-defined]
    urls = [url.removeprefix("http://") for url in router.engine_urls]
    assert (fields["engines"], fields["engine"], fields["resumes"]) == (urls, urls[1], 1)
    assert f" -> {urls[0]}>{urls[1]} 200 in " in access.getMessage()


async def test_a_continued_completion_counts_the_original_prompt_and_every_token() -> None:
    """A text completion with `stream_options.include_usage` and `max_tokens`: the
    continuation asks for what is left, and the one usage object counts the original prompt
    and every completion token."""
    first = FakeEngine(name="first", tokens=12, break_after_events=4)
    other = FakeEngine(name="other", tokens=12)
    request = {"model": "fake-model", "prompt": "one two three", "stream": True}
    request |= {"max_tokens": 10, "stream_options": {"include_usage": True}}
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post("/v1/completions", json=request)
            (sent,) = other.requests_to("/v1/completions")
    stream = events(answer.content)
    usages = [e["usage"] for e in stream if e != "[DONE]" and not e["choices"]]
    assert usages == [{"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}]
    assert text_of(stream, chat_stream=False) == WHOLE[: len("".join(REPLY_WORDS[:10]))]
    assert sent.json()["max_tokens"] == 10 - 3  # the first engine's first event has no token
    assert stream[-2]["choices"] == [] and stream[-1] == "[DONE]"


async def test_token_ids_the_client_asked_for_run_on_without_a_seam() -> None:
    first = FakeEngine(name="first", tokens=8, break_after_events=3)
    other = FakeEngine(name="other", tokens=8)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True, return_token_ids=True))
    stream = events(answer.content)[:-1]
    ids = [t for e in stream for t in (e["choices"][0].get("token_ids") or [])]
    assert ids == [REPLY_TOKEN + i for i in range(8)]
    assert isinstance(stream[0]["prompt_token_ids"], list)


@pytest.mark.parametrize("how", ["abort", "stall"])
async def test_an_engine_that_aborts_or_stalls_is_carried_on(how: str) -> None:
    """vLLM on SIGTERM ends its streams with finish_reason "abort" (and their usage and
    [DONE]): a truncated answer that looks finished; or an engine falls silent mid-stream.
    Either way another engine carries the answer on."""
    knob = {"abort_streams_after": 3} if how == "abort" else {"stall_after_events": 4}
    first = FakeEngine(name="first", tokens=12, **knob)  # type: ignore[arg-type]
    other = FakeEngine(name="other", tokens=12)
    proxy = {"stall_timeout_s": 0.5}
    with trio.fail_after(LIMIT):
        async with open_router([first, other], proxy=proxy) as router:
            answer = await router.client.post(
                CHAT, json=chat(stream=True, stream_options={"include_usage": True})
            )
            resumed = await resumes(router, how, "resumed")
    stream = events(answer.content)
    assert text_of(stream) == WHOLE
    assert [e for e in stream if e == "[DONE]"] == ["[DONE]"]
    assert all(e["choices"][0]["finish_reason"] != "abort" for e in stream[:-2])
    assert stream[-2]["usage"]["completion_tokens"] == 12
    assert resumed == 1


async def test_continuations_stop_after_resume_attempts() -> None:
    """Every engine breaks after 3 events: with `resume_attempts` 1 the answer is carried
    on once, then ends with an error event (counted as failed)."""
    engines = [FakeEngine(name=f"b{i}", tokens=12, break_after_events=3) for i in range(3)]
    proxy = {"resume_attempts": 1, "eject_after_failures": 0}
    with trio.fail_after(LIMIT):
        async with open_router(engines, proxy=proxy) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
            failed = await resumes(router, "closed", "failed")
    stream = events(answer.content)
    assert "[DONE]" not in stream
    assert stream[-1]["error"]["code"] == "bad_engine_response"
    assert sum(len(e.requests_to("/v1/completions")) for e in engines) == 1
    assert failed == 1


async def test_a_client_leaving_during_a_continuation_aborts_it() -> None:
    """The client leaves while the continuation runs: the continuation's engine sees its
    client go, and nothing is left behind."""
    first = FakeEngine(name="first", tokens=12, break_after_events=3)
    other = FakeEngine(name="other", tokens=12, gate=trio.Event())  # holds after one event
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            async with await open_raw(router.url) as stream:
                await send_raw(stream, CHAT, chat(stream=True), until=b'"content":"')
                await other.wait_until(lambda: other.in_flight == 1)
            await other.wait_until(lambda: other.disconnects == 1)
            assert other.completed == 0


async def test_a_client_leaving_once_it_has_the_carried_on_answer_counts_it_resumed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The continuation's engine holds its body's end after [DONE]; the client leaves as
    soon as it has [DONE]: the answer reached it whole, and the resume is counted and logged
    as one, though the client left before the router had read the engine's end."""
    caplog.set_level(logging.INFO, logger="trio_router.serving.failover")
    first = FakeEngine(name="first", tokens=12, break_after_events=3)
    other = FakeEngine(name="other", tokens=12, end_gate=trio.Event())
    records, access = AccessRecords(), logging.getLogger("trio_router.access")
    access.addHandler(records)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        with trio.fail_after(LIMIT):
            async with open_router([first, other]) as router:
                async with await open_raw(router.url) as stream:
                    received = await send_raw(stream, CHAT, chat(stream=True), until=b"[DONE]")
                (left,) = await records.wait_for(1)
                resumed = await resumes(router, "closed", "resumed")
                assert other.end_gate is not None
                other.end_gate.set()
    finally:
        access.removeHandler(records)
        access.setLevel(level)
    body = b"".join(received.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[1::2])  # unchunked
    assert text_of(events(body)) == WHOLE
    assert left["status"] == 499 and left["resumes"] == 1  # gone before the body's end
    assert resumed == 1
    assert any(r.getMessage().endswith("took it on: resumed") for r in caplog.records)


async def test_an_engine_failing_before_its_first_event_leaves_the_answer_to_another() -> None:
    """The engine sent the answer's head, then failed during its time to first token: no
    event reached the client, so another engine answers the request whole, in the same
    stream (counted as resumed)."""
    first = FakeEngine(name="first", tokens=12, break_after_events=0)
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
            resumed = await resumes(router, "closed", "resumed")
    stream = events(answer.content)
    assert text_of(stream) == WHOLE and stream[-1] == "[DONE]"
    assert len({e["id"] for e in stream[:-1]}) == 1
    (sent,) = other.requests_to(CHAT)  # the request itself, not a continuation
    assert sent.json()["messages"] == chat()["messages"] and sent.json()["return_token_ids"]
    assert other.requests_to("/v1/completions") == []
    assert resumed == 1


async def test_a_partial_event_of_a_failed_engine_is_dropped() -> None:
    """The engine broke off in the middle of an event: its half is never passed on, and
    the continuation's events follow the whole ones before it."""
    first = FakeEngine(name="first", tokens=12, break_inside_event=5)
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=chat(stream=True))
            resumed = await resumes(router, "closed", "resumed")
    stream = events(answer.content)  # every event whole JSON
    assert text_of(stream) == WHOLE and stream[-1] == "[DONE]"
    (sent,) = other.requests_to("/v1/completions")
    assert sent.json()["prompt"][-4:] == [REPLY_TOKEN + i for i in range(4)]
    assert resumed == 1


def test_an_event_without_end_is_held_only_so_far() -> None:
    """A followed stream's event is held until its end, up to MAX_EVENT_BYTES: an engine
    that never ends one has sent a malformed answer (carried on like any other failure)."""
    track = Track("chat", show_ids=False, usage=False)
    assert track(b'data: {"id":"x","choices":[{"delta":{"content":"', False) == b""
    with pytest.raises(MalformedResponseError, match="longer than"):
        for _ in range(MAX_EVENT_BYTES // 65536 + 1):
            track(b"a" * 65536, False)


async def test_an_engine_failing_after_every_allowed_token_has_its_end_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine generated every token `max_tokens` allows and failed before its finish
    event: nothing is left to continue; the router ends the stream itself (finish_reason
    "length", the usage, [DONE]); no other engine is asked."""
    first = FakeEngine(name="first", tokens=12, break_after_events=7)  # role + 6 tokens
    other = FakeEngine(name="other", tokens=12)
    body = chat(stream=True, max_tokens=6, stream_options={"include_usage": True})
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=body)
    stream = events(answer.content)
    assert text_of(stream) == "".join(REPLY_WORDS[:6])
    assert [e for e in stream if e == "[DONE]"] == ["[DONE]"] and stream[-1] == "[DONE]"
    assert stream[-3]["choices"][0]["finish_reason"] == "length"
    assert stream[-2]["usage"]["completion_tokens"] == 6
    assert other.request_count == len(other.requests_to("/v1/models"))  # probes only
    assert not [r for r in caplog.records if r.name.startswith("trio_router.serving")]


async def test_an_engine_failing_after_its_done_leaves_the_stream_as_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the body's last (empty) chunk was lost: the stream the client gets is whole,
    with one [DONE] and one usage object, nothing added."""
    first = FakeEngine(name="first", tokens=4, break_after_events=7)  # role, 4, end, usage, DONE
    other = FakeEngine(name="other", tokens=4)
    body = chat(stream=True, stream_options={"include_usage": True})
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(CHAT, json=body)
    stream = events(answer.content)
    assert answer.status_code == 200 and stream[-1] == "[DONE]"
    assert [e for e in stream if e == "[DONE]"] == ["[DONE]"]
    assert len([e for e in stream[:-1] if not e["choices"]]) == 1  # one usage object
    assert text_of(stream) == "".join(REPLY_WORDS[:4])
    assert other.requests_to(CHAT) == other.requests_to("/v1/completions") == []
    assert not [r for r in caplog.records if r.name.startswith("trio_router.serving")]


async def test_a_stream_of_an_engine_without_token_ids_passes_untouched() -> None:
    """An engine that ignores `return_token_ids` (no prompt token ids in its first event):
    its stream passes as it comes, not followed; when it breaks off, there is nothing to
    carry it on with, and it ends with an error event."""
    plain = FakeEngine(name="plain", tokens=6, token_ids=False)
    breaking = FakeEngine(name="breaking", tokens=12, token_ids=False, break_after_events=4)
    with trio.fail_after(LIMIT):
        async with open_router([plain, breaking]) as router:
            whole = await router.client.post(CHAT, json=chat(stream=True))
            cut = await router.client.post(CHAT, json=chat(stream=True))
            counted = await resumes(router, "closed", "not_resumable")
    assert whole.content.endswith(b"data: [DONE]\n\n")
    assert text_of(events(whole.content)) == "".join(REPLY_WORDS[:6])
    last = events(cut.content)[-1]
    assert last["error"]["code"] == "bad_engine_response" and counted == 1
    assert breaking.requests_to("/v1/completions") == plain.requests_to("/v1/completions") == []


def test_an_event_that_is_not_json_is_a_malformed_answer() -> None:
    """A followed stream's first event must be read: one that is not a JSON object makes the
    answer malformed (a failure like a broken connection), not an error of the router."""
    track = Track("chat", show_ids=False, usage=False)
    with pytest.raises(MalformedResponseError, match="not a JSON object"):
        track(b"data: {not json\n\n", False)


async def test_a_continuation_waits_for_an_engine_it_has_not_tried() -> None:
    """The answer's engine breaks it off while the model's other engine is out of routing:
    the one routable engine has been tried, so the continuation waits (the waiting room)
    for another, and carries the answer on there once it is back: the stream is whole, not
    ended with an error event."""
    first = FakeEngine(name="first", tokens=12, break_after_events=5, inter_token_s=0.02)
    other = FakeEngine(name="other", tokens=12)
    probe = {"interval_s": 0.2, "failures_to_eject": 1, "backoff_max_s": 0.2}
    with trio.fail_after(LIMIT):
        async with open_router([first, other], probe=probe) as router:
            other_name = router.engine_urls[1].removeprefix("http://")
            other.fail_status = 503  # out of routing: its probes fail
            while any(e.name == other_name and e.routable for e in router.table):
                await router.table.wait_changed()
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await router.client.post(CHAT, json=chat(stream=True)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                queued = "trio_router_model_queued_requests"
                # The continuation is waiting: the queue's gauge, read over HTTP, polled.
                while not await router.metric(queued, model="fake-model", priority="0"):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                other.fail_status = None  # back
            resumed = await resumes(router, "closed", "resumed")
    (answer,) = answers
    stream = events(answer.content)
    assert text_of(stream) == WHOLE and stream[-1] == "[DONE]"
    assert len(other.requests_to("/v1/completions")) == 1 and resumed == 1


async def test_an_engine_answering_that_it_shuts_down_leaves_the_request_to_another() -> None:
    """vLLM draining on SIGTERM (`--shutdown-timeout`) answers a new request 500 "cannot
    schedule new futures after shutdown": another engine answers it (a 500 of the request's
    own making still passes as it is)."""
    going = FakeEngine(name="going", inference_fail_status=500)
    other = FakeEngine(name="other")
    with trio.fail_after(LIMIT):
        async with open_router([going, other], routing={"policy": "round_robin"}) as router:
            plain = [await router.client.post(CHAT, json=chat()) for _ in range(2)]
            going.fail_message = "cannot schedule new futures after shutdown"
            answers = [await router.client.post(CHAT, json=chat()) for _ in range(2)]
            retried = await resumes(router, "error_500", "retried", "whole")
    assert sorted(a.status_code for a in plain) == [200, 500]
    assert [a.status_code for a in answers] == [200, 200]
    assert retried == len(going.requests_to(CHAT)) - 1 >= 1  # all but its first


@pytest.mark.parametrize("framed", [False, True])
def test_a_token_event_and_the_finish_in_one_read_both_pass(framed: bool) -> None:
    """A read that holds a token event and then the finish (both end as a plain token event
    does): each passes, the token's id alone is noted, and the finish is seen."""
    track = Track("chat", show_ids=False, usage=False)
    head = b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
    first = head + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    first += b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2]}\n\n'
    assert track(first, False)
    token = head + b'"choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,'
    token += b'"finish_reason":null,"token_ids":[7]}]}\n\n'
    finish = head + b'"choices":[{"index":0,"delta":{},"logprobs":null,'
    finish += b'"finish_reason":"stop","stop_reason":null,"token_ids":[8]}]}\n\n'
    if framed:
        chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n" % (len(token), token, len(finish), finish)
        assert track.framed(chunks) is None  # not the common read: it goes the general way
    out = track(token + finish, False)
    assert out.count(b"data: ") == 2 and b'"finish_reason":"stop"' in out
    assert track.generated_ids() == [7, 8] and track.finish == "stop"
