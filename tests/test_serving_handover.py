"""Streams handed over to another engine without waiting for theirs (`serving.handover`,
`http.stall`): an engine whose pod is going away hands its streams over at once, through
Kubernetes discovery (a wire-level fake API server, the real clock); an engine that falls
silent is left at the stream's own pace (the autojump clock, with the real router and fake
engines over loopback); the client's pause is timed in trio_router_stream_handover_seconds,
and each resume is logged with both engines."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio
import trio.testing

from trio_router import server
from trio_router.http.relay import CHECK_S
from trio_router.table import EngineState, RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.fake_replies import REPLY_WORDS
from trio_router.testing.harness import CHAT, LIMIT, chat, kubernetes_config, open_router, sample

MODEL: Final = "fake-model"
VIRTUAL_LIMIT: Final = 120.0  # virtual seconds: bounds the autojump tests


def words(tokens: int) -> str:
    """The text of an uninterrupted fake answer of `tokens` tokens."""
    return "".join(REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(tokens))


def text_of(body: bytes) -> str:
    """The content of a chat stream's events (and a check that it ended with one [DONE])."""
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1, body[-300:]
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


# -- a silent engine, left at the stream's pace (autojump clock) ----------------------------------
async def test_a_steady_stream_whose_engine_falls_silent_goes_on_after_the_floor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine takes 5 s to its first token (not a stall), streams tokens 0.05 s apart,
    then falls silent: the stream goes on at the other engine after `stall_floor_s` (2 s) of
    silence, not `stall_timeout_s` (30 s); the client's pause is observed."""
    first = FakeEngine(name="first", tokens=12, ttft_s=5.0, inter_token_s=0.05)
    first.stall_after_events = 6  # the role, then 5 tokens
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(VIRTUAL_LIMIT):
        async with open_router([first, other]) as router:
            start = trio.current_time()
            answer = await router.client.post(CHAT, json=chat(stream=True))
            took = trio.current_time() - start
            text = (await router.client.get("/metrics")).text
    assert answer.status_code == 200 and text_of(answer.content) == words(12)
    silent_since = 5.0 + 0.05 * 5
    assert silent_since + 2.0 <= took <= silent_since + 2.0 + CHECK_S + 0.1
    labels = {"model": MODEL, "reason": "stall"}
    assert (
        sample(
            text, "trio_router_stream_resumes_total", kind="content", outcome="resumed", **labels
        )
        == 1
    )
    assert sample(text, "trio_router_stream_handover_seconds_count", **labels) == 1
    paused = sample(text, "trio_router_stream_handover_seconds_sum", **labels)
    assert 2.0 <= paused <= 2.0 + CHECK_S + 0.1
    assert sample(text, "trio_router_stream_handover_seconds_bucket", le="3.0", **labels) == 1


async def test_a_stream_that_paused_long_before_may_pause_as_long_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Tokens 0.05 s apart, a pause of 1.5 s (under the floor), later one of 5 s (past the
    floor, within 4 x 1.5 s): the same engine carries on. Silent after that, the stream is
    left at 4 x its longest gap (about 20 s), still short of `stall_timeout_s` (30 s)."""
    first = FakeEngine(name="first", tokens=12, inter_token_s=0.05, pauses={4: 1.5, 8: 5.0})
    first.stall_after_events = 11
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(VIRTUAL_LIMIT):
        async with open_router([first, other]) as router:
            start = trio.current_time()
            answer = await router.client.post(CHAT, json=chat(stream=True), timeout=60)
            took = trio.current_time() - start
            (continuation,) = other.requests_to("/v1/completions")
    assert text_of(answer.content) == words(12)
    assert len(continuation.json()["prompt"]) > 10  # every token but the last two were first's
    silent_since = 0.05 * 10 + 1.5 + 5.0
    longest = 5.0 + 0.05
    assert silent_since + 4 * longest <= took <= silent_since + 4 * longest + CHECK_S + 0.1


# -- an engine going away hands its streams over at once (Kubernetes discovery, real clock) ------
async def received(lines: Any, events: list[bytes], count: int) -> None:
    """Read the stream's events into `events` until it holds `count` of them, or ends."""
    async for line in lines:
        if line.startswith("data: "):
            events.append(line.encode())
            if len(events) >= count:
                return


@pytest.mark.parametrize("how", ["terminating", "deleted"])
async def test_a_stream_whose_pod_goes_away_goes_on_at_another_engine_at_once(
    apiserver: FakeApiServer,
    kubeconfig: Path,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """pod-a's engine streams, then falls silent (a silent engine is only left after 20 s
    here). Its pod going NotReady changes nothing for the stream; its pod terminating (or
    deleted outright) hands the stream over to pod-b's engine at once: the client has the
    whole answer well within the test's 10 s, one [DONE], one resume for "leaving", its
    pause observed, and a log line naming both engines."""
    caplog.set_level(logging.INFO, logger="trio_router")
    a = FakeEngine(name="a", tokens=60, inter_token_s=0.01, stall_after_events=22)
    b = FakeEngine(name="b", tokens=60)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = int((await nursery.start(serve_fake_engine, a, "127.0.1.1", 0)).rsplit(":")[-1])
            await nursery.start(serve_fake_engine, b, "127.0.1.2", port)
            apiserver.add_pod("pod-a", ip="127.0.1.1")
            proxy = {"stall_floor_s": 20.0}
            config = kubernetes_config(apiserver.namespace, str(kubeconfig), port, proxy=proxy)
            table = RoutingTable()
            run = partial(server.run, config, table=table, handle_signals=False)
            (url,) = await nursery.start(run)

            async def routable(names: set[str]) -> None:
                while {e.name for e in table.routable(MODEL)} != names:
                    await table.wait_changed()

            await routable({"pod-a"})
            events: list[bytes] = []
            async with (
                httpx.AsyncClient(base_url=url, timeout=LIMIT) as client,
                client.stream("POST", CHAT, json=chat(stream=True)) as answer,
            ):
                lines = answer.aiter_lines()
                await received(lines, events, 5)
                apiserver.modify_pod("pod-a", ready=False)  # a readiness flap
                await routable(set())
                await received(lines, events, 20)  # still pod-a's, with no engine left
                apiserver.add_pod("pod-b", ip="127.0.1.2")
                await routable({"pod-b"})
                assert b.requests_to("/v1/completions") == []
                left = trio.current_time()
                if how == "terminating":
                    apiserver.modify_pod("pod-a", ready=False, terminating=True)
                else:
                    apiserver.delete_pod("pod-a")
                await received(lines, events, 10_000)  # to the end
                done = trio.current_time()
                text = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    assert text_of(b"\n\n".join(events) + b"\n\n") == words(60)
    assert done - left < 2.0  # not 20 s: the stall floor
    assert len(b.requests_to("/v1/completions")) == 1
    labels = {"model": MODEL, "reason": "leaving"}
    assert (
        sample(
            text, "trio_router_stream_resumes_total", kind="content", outcome="resumed", **labels
        )
        == 1
    )
    assert sample(text, "trio_router_stream_handover_seconds_count", **labels) == 1
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("trio_router")]
    assert any(
        "engine pod-a failed it (leaving), engine pod-b took it on: resumed" in m for m in logged
    )
    assert any("engine pod-a is going away" in m and "1 stream(s)" in m for m in logged)


async def test_a_stream_no_other_engine_could_take_is_left_to_its_leaving_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Told its engine is going away while no other engine serves the model, a stream is
    left to finish there (the engine drains it), whole; once another engine is routable, a
    second telling hands it over."""
    first = FakeEngine(name="first", tokens=40, inter_token_s=0.1)
    other = FakeEngine(name="other", tokens=40)
    with trio.fail_after(VIRTUAL_LIMIT):
        async with open_router([first, other]) as router, trio.open_nursery() as nursery:
            by_name = {e.name: e for e in router.table}
            leaving, staying = (by_name[u.removeprefix("http://")] for u in router.engine_urls)
            router.table.set_pending(staying.uid, "not Ready")  # no other engine for now
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await router.client.post(CHAT, json=chat(stream=True)))

            nursery.start_soon(ask)
            await first.wait_until(lambda: first.in_flight == 1)
            await trio.sleep(1.0)
            router.table.set_pending(leaving.uid, "terminating")
            assert leaving.leaving("terminating") == 1  # told, and stays
            await trio.sleep(1.0)
            assert other.requests_to("/v1/completions") == [] and not answers
            staying.state = EngineState.ROUTABLE  # back (as a probe would have it)
            router.table.put(staying)
            assert leaving.leaving("deleted") == 1  # told again: now it goes
        (answer,) = answers
        assert text_of(answer.content) == words(40)
        (continuation,) = other.requests_to("/v1/completions")
        assert 15 <= len(continuation.json()["prompt"]) - 1 <= 25  # about 2 s of first's tokens
