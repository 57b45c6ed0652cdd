"""In-flight counts and request figures stay exact whatever becomes of a request (hypothesis).

Random sequences of requests, run concurrently in small groups, go through the real server
(`server.run`, static discovery) to fake engines over HTTP on 127.0.1.x, under every routing
policy. Each request's outcome is drawn: a success (non-streamed or streamed), an error answer
from the engine (4xx or 5xx), an engine that refuses connections (failover to another one), an
engine silent past `proxy.read_timeout_s` (504), or a client that leaves mid-stream or before
the answer. Once every request has ended, every engine's `in_flight` is back to 0, and its
`requests.count` (and `requests.errors`) grew by exactly the requests that engine answered
with an outcome; requests whose client left are not counted.

Which engine served a request is read from the fake engines themselves (each request carries
its own `x-request-id`), so the oracle does not depend on the policy's choice. Each example runs
in its own `trio.run` on the real clock, under `trio.fail_after`.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trio_router.config import POLICIES
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine
from trio_router.testing.harness import CHAT, open_raw, open_router, receive_until, send_request

LIMIT: Final = 10.0  # seconds; bounds one example (it takes well under one)
READ_TIMEOUT_S: Final = 0.5  # proxy.read_timeout_s: a silent engine costs this much per group
INTER_TOKEN_S: Final = 0.01  # slow engines: never silent for anything near READ_TIMEOUT_S...
TOKENS: Final = 1000  # ...yet a full reply takes TOKENS * INTER_TOKEN_S = 10 s
SETTLE_S: Final = 2.0  # bound on in-flight counts returning to 0 after the last request
QUIET_S: Final = 0.01  # "nothing ran for this long": the process has gone quiet

# Engines, in the order served (127.0.1.1, ...): two slow streamers, two failing ones, and one
# stopped once routable, whose port then refuses connections.
SLOW_1, SLOW_2, FAIL_500, FAIL_503, DEAD = range(5)
SERVES: Final = {
    SLOW_1: ["m", "flaky"],
    SLOW_2: ["m"],
    FAIL_500: ["err"],
    FAIL_503: ["err"],
    DEAD: ["flaky"],
}

OK, OK_STREAM = "ok", "ok_stream"  # /tokenize answered at once; a 2-token stream
ENGINE_4XX, ENGINE_5XX = "engine_4xx", "engine_5xx"  # chat without messages; model "err"
UNREACHABLE = "unreachable"  # model "flaky": the dead engine, or its live peer
SILENT = "silent"  # a non-streamed chat from a slow engine: 504 after READ_TIMEOUT_S
CUT_MID_STREAM, CUT_BEFORE_ANSWER = "cut_mid_stream", "cut_before_answer"  # the client leaves
KINDS: Final = (
    OK,
    OK_STREAM,
    ENGINE_4XX,
    ENGINE_5XX,
    UNREACHABLE,
    SILENT,
    CUT_MID_STREAM,
    CUT_BEFORE_ANSWER,
)
CUT_KINDS: Final = frozenset({CUT_MID_STREAM, CUT_BEFORE_ANSWER})
ERROR_KINDS: Final = frozenset({ENGINE_5XX, SILENT})  # counted in requests.errors
EXPECTED_STATUS: Final[dict[str, tuple[int | None, ...]]] = {  # None: no response started
    OK: (200,),
    OK_STREAM: (200,),
    ENGINE_4XX: (400,),
    ENGINE_5XX: (500, 503),
    UNREACHABLE: (200,),
    SILENT: (504,),
    CUT_MID_STREAM: (200,),
    CUT_BEFORE_ANSWER: (None,),
}


@dataclass(frozen=True)
class Call:
    """One drawn request: its outcome kind and what the policies route on."""

    kind: str
    conversation: int  # shared prompt prefixes (prefix_aware)
    turns: int
    session: str | None  # x-session-id (session)


@dataclass
class Result:
    call: Call
    request_id: str
    status: int | None = None  # None: the client left before the response started
    engine: str | None = None  # x-trio-router-engine of the response, if any
    complete: bool = False  # the whole body arrived


calls = st.builds(
    Call,
    kind=st.sampled_from(KINDS),
    conversation=st.integers(0, 2),
    turns=st.integers(1, 3),
    session=st.sampled_from([None, "s0", "s1", "s2"]),
)
groups = st.lists(st.lists(calls, min_size=1, max_size=4), min_size=1, max_size=4)


def messages(call: Call) -> list[dict[str, str]]:
    """A conversation's first turns; turns of one conversation share their prefix."""
    out = []
    for turn in range(call.turns):
        out.append(
            {
                "role": "user",
                "content": f"conversation {call.conversation} turn {turn}: " + "lorem " * 50,
            }
        )
        out.append({"role": "assistant", "content": "ipsum " * 20})
    return out[:-1]


def request_for(call: Call) -> tuple[str, dict[str, Any]]:
    """The path and JSON body that lead to `call.kind`."""
    kind, msgs = call.kind, messages(call)
    if kind == OK:
        return "/tokenize", {"model": "m", "messages": msgs}
    if kind == OK_STREAM:
        return CHAT, {"model": "m", "messages": msgs, "stream": True, "max_tokens": 2}
    if kind == ENGINE_4XX:  # the engine wants `messages`; the router routes on `prompt`
        return CHAT, {"model": "m", "prompt": " ".join(m["content"] for m in msgs)}
    if kind == ENGINE_5XX:
        return CHAT, {"model": "err", "messages": msgs}
    if kind == UNREACHABLE:
        return "/tokenize", {"model": "flaky", "messages": msgs}
    if kind == CUT_MID_STREAM:
        return CHAT, {"model": "m", "messages": msgs, "stream": True}
    return CHAT, {"model": "m", "messages": msgs}  # SILENT, CUT_BEFORE_ANSWER


def seen(engine: FakeEngine, request_id: str) -> bool:
    """Whether `engine` received the request whose x-request-id is `request_id`."""
    return any(r.header("x-request-id") == request_id for r in engine.requests)


async def wait_seen(engines: list[FakeEngine], request_id: str) -> None:
    """Block until one of `engines` has received the request `request_id`."""

    async def watch(engine: FakeEngine, done: trio.CancelScope) -> None:
        await engine.wait_until(lambda: seen(engine, request_id))
        done.cancel()

    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(watch, engine, nursery.cancel_scope)


async def run_call(
    client: httpx.AsyncClient, url: str, engines: list[FakeEngine], result: Result
) -> None:
    """Send one request and record what the client saw. Clients that leave speak HTTP/1.1
    over a plain TCP connection and close it."""
    call = result.call
    path, body = request_for(call)
    headers = {"x-request-id": result.request_id}
    if call.session is not None:
        headers["x-session-id"] = call.session
    if call.kind in CUT_KINDS:
        async with await open_raw(url) as stream:
            await send_request(stream, path, body, headers)
            if call.kind == CUT_BEFORE_ANSWER:
                await wait_seen(engines, result.request_id)
            else:
                head = await receive_until(stream, b"data: ")  # the first event
                result.status = int(head.split(b" ", 2)[1])
                result.engine = header_value(head, b"x-trio-router-engine")
        return  # the connection is closed: the client has left
    response = await client.post(path, json=body, headers=headers)
    result.status = response.status_code
    result.engine = response.headers.get("x-trio-router-engine")
    result.complete = call.kind != OK_STREAM or response.content.endswith(b"data: [DONE]\n\n")


def header_value(head: bytes, name: bytes) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


async def wait_no_request_in_flight(table: RoutingTable) -> None:
    """Block until no engine has a request in flight. In-flight counts change only in request
    tasks, which end by themselves once their connections are closed; the condition is
    re-checked whenever every task of the process is blocked (nothing left to run). The
    caller bounds the wait."""
    while any(engine.in_flight for engine in table):
        await trio.testing.wait_all_tasks_blocked(cushion=QUIET_S)


async def run_example(policy: str, plan: list[list[Call]]) -> None:
    engines = [FakeEngine(name=f"engine-{i}", models=SERVES[i]) for i in range(len(SERVES))]
    for slow in (engines[SLOW_1], engines[SLOW_2]):
        slow.tokens, slow.inter_token_s = TOKENS, INTER_TOKEN_S
    engines[FAIL_500].inference_fail_status = 500
    engines[FAIL_503].inference_fail_status = 503
    with trio.fail_after(LIMIT):
        async with open_router(
            engines,
            wait_models=("m", "err", "flaky"),
            routing={"policy": policy},
            proxy={"read_timeout_s": READ_TIMEOUT_S},
        ) as router:
            router.stop_engine(DEAD)  # still routable as far as the router knows
            await trio.testing.wait_all_tasks_blocked()  # its listener is closed now
            results: list[Result] = []
            for g, group in enumerate(plan):
                batch = [Result(call, f"req-{g}-{i}") for i, call in enumerate(group)]
                results += batch
                async with trio.open_nursery() as nursery:
                    for result in batch:
                        nursery.start_soon(run_call, router.client, router.url, engines, result)

            with trio.move_on_after(SETTLE_S):
                await wait_no_request_in_flight(router.table)
            by_engine = {e.name: (e.in_flight, e.requests.count) for e in router.table}
            assert all(e.in_flight == 0 for e in router.table), (
                f"in-flight counts did not return to 0: {by_engine}"
            )
            entries = [router.table.get(url) for url in router.engine_urls]
            names = [entry.name if entry is not None else "" for entry in entries]

            counts: Counter[int] = Counter()
            errors: Counter[int] = Counter()
            for result in results:
                kind = result.call.kind
                where = [i for i, engine in enumerate(engines) if seen(engine, result.request_id)]
                assert len(where) == 1, f"{result} reached engines {where}"
                served = where[0]
                assert served != DEAD
                assert result.status in EXPECTED_STATUS[kind], result
                if result.engine is not None:
                    assert result.engine == names[served], result
                if kind in CUT_KINDS:
                    continue
                assert result.complete, result
                if kind == UNREACHABLE:
                    assert served == SLOW_1  # the live engine of "flaky"
                counts[served] += 1
                errors[served] += kind in ERROR_KINDS

            for i, entry in enumerate(entries):
                assert entry is not None
                assert (entry.requests.count, entry.requests.errors) == (counts[i], errors[i]), (
                    f"engine {i} ({entry.name}): {by_engine}"
                )
            shown = {
                e["name"]: (e["in_flight"], e["requests"]["requests"])
                for e in (await router.client.get("/engines")).json()["engines"]
            }
            assert shown == by_engine  # GET /engines shows the same figures
            dead = entries[DEAD]
            assert dead is not None
            if not dead.routable:  # ejected: a request was refused and failed over
                event("failover from a refused connection")


@pytest.mark.parametrize("policy", POLICIES)
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(plan=groups)
def test_in_flight_and_request_counts_are_exact(policy: str, plan: list[list[Call]]) -> None:
    # As the router's process does once started (`__main__`): what exists now is frozen, so a
    # full collection does not walk the whole test session's heap in the middle of an
    # example (on 2 cores that stalled every task, engines included, past the read timeout).
    gc.collect()
    gc.freeze()
    try:
        trio.run(run_example, policy, plan)
    finally:
        gc.unfreeze()
