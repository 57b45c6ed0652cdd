"""Hostile clients and broken engines: each finding of an adversarial run against the router,
as a test. Over real sockets (real Hypercorn, fake engines over HTTP) on the real clock, except
where a test is about time alone (virtual time)."""

from __future__ import annotations

import errno
import json
import logging
import math
import socket
import tracemalloc
from typing import Any, Final

import httpx
import pytest
import trio
import trio.testing

from test_http_relay import ScriptedEngine, open_scripted_router
from trio_router.errors import OverloadedError, RequestTimeoutError
from trio_router.http import LocalLimitError, UpstreamPool
from trio_router.serving.errors import from_transport
from trio_router.serving.intake import BodyBudget, Held, read_body
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.harness import CHAT, LIMIT, chat, open_raw, open_router, receive_until

BODY: Final = json.dumps(chat()).encode()
CHAT_PATH: Final = CHAT.encode()


async def raw_exchange(url: str, request: bytes) -> bytes:
    """Send `request` bytes on a new connection; everything until the router closes it."""
    stream = await open_raw(url)
    async with stream:
        await stream.send_all(request)
        received = b""
        while data := await stream.receive_some():
            received += data
        return received


# -- protocol strictness ----------------------------------------------------------------------
async def test_content_length_with_transfer_encoding_is_400_and_closes() -> None:
    """RFC 9112 §6.1: a request with both may smuggle a second one; it is refused and the
    connection closed, so the second request is never answered."""
    smuggled = b"GET /health HTTP/1.1\r\nhost: r\r\n\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n"
        b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n"
        % len(chunked)
        + chunked
        + smuggled
    )
    with trio.fail_after(LIMIT):
        async with open_router([FakeEngine()]) as router:
            received = await raw_exchange(router.url, request)
    assert received.startswith(b"HTTP/1.1 400 ")
    assert b"connection: close" in received.lower()
    assert received.count(b"HTTP/1.1 ") == 1  # the smuggled request got no answer
    assert b"Content-Length and Transfer-Encoding" in received


async def test_a_control_byte_in_a_client_header_is_400_not_an_engine_error() -> None:
    with trio.fail_after(LIMIT):
        async with open_router([FakeEngine()]) as router:
            request = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\nx-trace: a\x01b\r\n"
                b"content-length: %d\r\n\r\n" % len(BODY) + BODY
            )
            stream = await open_raw(router.url)
            async with stream:
                await stream.send_all(request)
                received = await receive_until(stream, b"}}")
            assert received.startswith(b"HTTP/1.1 400 ") and b"x-trace" in received
            assert router.engines[0].requests_to(CHAT) == []
            assert (
                await router.metric("trio_router_requests_total", model="", engine="", status="400")
                == 1
            )


async def test_a_websocket_upgrade_gets_a_clear_4xx() -> None:
    with trio.fail_after(LIMIT):
        async with open_router([FakeEngine()]) as router:
            stream = await open_raw(router.url)
            async with stream:
                await stream.send_all(
                    b"GET /v1/chat/completions HTTP/1.1\r\nhost: r\r\nupgrade: websocket\r\n"
                    b"connection: Upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"sec-websocket-version: 13\r\n\r\n"
                )
                received = await receive_until(stream, b"}}")
    assert received.startswith(b"HTTP/1.1 400 ")
    assert b"websocket_not_supported" in received


# -- request bodies ---------------------------------------------------------------------------
async def test_a_stalled_body_is_408_at_the_body_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The body budget per silence is a deadline on virtual time (the ASGI receive is faked
    as a channel, as the server delivers body parts)."""
    send, receive = trio.open_memory_channel[dict[str, Any]](10)
    await send.send({"type": "http.request", "body": b"{", "more_body": True})
    budget = BodyBudget(1000)
    held = Held(budget)
    start = trio.current_time()
    with pytest.raises(RequestTimeoutError, match="stopped arriving for 60 s"):
        await read_body(receive.receive, b"100", 1000, stall_s=60.0, held=held)
    assert trio.current_time() - start == pytest.approx(60.0)
    assert budget.used == 100  # the declared length was held until the caller releases it
    held.release()
    assert budget.used == 0


async def test_the_body_timeout_is_a_budget_of_silence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Parts 40 s apart under a 60 s budget are read to the end, 120 s after the first: the
    budget runs from each part, not from the first."""
    send, receive = trio.open_memory_channel[dict[str, Any]](10)
    held = Held(BodyBudget(1000))

    async def trickle() -> None:
        for part in (b"{", b'"a"', b":1"):
            await send.send({"type": "http.request", "body": part, "more_body": True})
            await trio.sleep(40)
        await send.send({"type": "http.request", "body": b"}", "more_body": False})

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        body = await read_body(receive.receive, None, 1000, stall_s=60.0, held=held)
    assert body == b'{"a":1}'
    assert trio.current_time() - start == pytest.approx(120.0)
    held.release()


async def test_a_stalled_body_gets_408_and_the_connection_closes() -> None:
    with trio.fail_after(LIMIT):
        async with open_router([FakeEngine()], server={"request_body_timeout_s": 0.5}) as router:
            start = trio.current_time()
            received = await raw_exchange(
                router.url,
                (
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n"
                    b"content-length: %d\r\n\r\n" % len(BODY) + BODY[:10]
                ),
            )
            assert 0.5 <= trio.current_time() - start < 0.5 + 2
    assert received.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in received


async def test_bodies_beyond_the_buffer_budget_get_503_with_retry_after() -> None:
    """While one large body is held, another that would take the budget past its limit is
    refused at once (503, Retry-After, the connection closed); the first one is served."""
    size = 600_000
    big = json.dumps(chat(pad="x" * size)).encode()
    with trio.fail_after(LIMIT):
        async with open_router(
            [FakeEngine()], server={"max_body_bytes": 1 << 20, "max_buffered_body_bytes": 1 << 20}
        ) as router:
            first = await open_raw(router.url)
            async with first:
                await first.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n"
                    b"content-length: %d\r\n\r\n" % len(big) + big[:1000]
                )
                await trio.testing.wait_all_tasks_blocked()
                refused = await raw_exchange(
                    router.url,
                    (
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n"
                        b"content-length: %d\r\n\r\n" % len(big)
                    ),
                )
                assert refused.startswith(b"HTTP/1.1 503 ")
                assert b"retry-after: 1" in refused.lower()
                assert b"max_buffered_body_bytes" in refused
                await first.send_all(big[1000:])
                answer = await receive_until(first, b"}}")
            assert answer.startswith(b"HTTP/1.1 200 ")


class AccessRecords(logging.Handler):
    """The access records the router writes, with a way to wait for the next one."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.fields: list[dict[str, Any]] = []
        self._changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(record.fields)  # type: ignore[attr-defined]
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, count: int) -> list[dict[str, Any]]:
        while len(self.fields) < count:
            await self._changed.wait()
        return self.fields


async def test_a_client_that_leaves_mid_body_gives_its_budget_back() -> None:
    """A declared body takes its share of the budget at once; a client that disconnects
    before sending all of it gives that share back (and the request is logged as 499), so
    the next bodies fit."""
    records = AccessRecords()
    logger = logging.getLogger("trio_router.access")
    logger.addHandler(records)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with trio.fail_after(LIMIT):
            async with open_router(
                [FakeEngine()], server={"max_body_bytes": 2000, "max_buffered_body_bytes": 2000}
            ) as router:
                for _ in range(3):  # each would leak 1,400 of the 2,000 bytes
                    leaving = await open_raw(router.url)
                    async with leaving:
                        await leaving.send_all(
                            b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n"
                            b"content-length: 1400\r\n\r\n" + b"{" * 100
                        )
                        await trio.testing.wait_all_tasks_blocked()
                left = await records.wait_for(3)
                assert [r["status"] for r in left] == [499] * 3
                response = await router.client.post(CHAT, json=chat(pad="z" * 1000))
                assert response.status_code == 200
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)


async def test_a_large_body_is_parsed_off_the_event_loop_and_served() -> None:
    """A body over 1 MiB is parsed in a worker thread (only its model, for a policy that
    needs no more); it is forwarded unchanged."""
    big = json.dumps(chat(pad="y" * (3 << 20))).encode()
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            response = await router.client.post(
                CHAT, content=big, headers={"content-type": "application/json"}
            )
            assert response.status_code == 200, response.text
            assert engine.requests_to(CHAT)[-1].body == big
            bad = await router.client.post(CHAT, content=b'{"pad": "' + b"z" * (2 << 20) + b'"}')
            assert bad.status_code == 400 and "model" in bad.json()["error"]["message"]


async def test_a_large_body_is_not_decoded_whole_while_it_is_served() -> None:
    """Of a large body the router decodes only what routing reads (its model; with
    `proxy.resume` on, as by default, more of a streamed request): while it waits for its
    engine, the serving path holds its bytes and no decoded copy of the rest (a long array
    beside its messages here); the engine gets the body as it came."""
    big = json.dumps({**chat(), "extra": [0] * 1_000_000}, separators=(",", ":")).encode()
    engine = FakeEngine(gate=trio.Event())
    answers: list[httpx.Response] = []
    queued = 'trio_router_model_queued_requests{model="fake-model",'
    with trio.fail_after(LIMIT):
        async with (
            open_router([engine], admission={"max_in_flight_per_engine": 1}) as router,
            trio.open_nursery() as nursery,
        ):

            async def post(body: bytes) -> None:
                answers.append(await router.client.post(CHAT, content=body))

            nursery.start_soon(post, BODY)
            await engine.wait_until(lambda: engine.in_flight == 1)  # the engine's one slot
            tracemalloc.start(64)
            try:
                nursery.start_soon(post, big)
                while not any(
                    line.startswith(queued) and line.endswith(" 1.0")
                    for line in (await router.client.get("/metrics")).text.splitlines()
                ):
                    await trio.testing.wait_all_tasks_blocked()
                snapshot = tracemalloc.take_snapshot()  # the big one waits, resolved
            finally:
                tracemalloc.stop()
            assert engine.gate is not None
            engine.gate.set()
    serving = tracemalloc.Filter(True, "*/trio_router/serving/*", all_frames=True)
    held = sum(trace.size for trace in snapshot.filter_traces([serving]).traces)
    assert held < 1.5 * len(big)  # the body's bytes as read, at most
    assert [a.status_code for a in answers] == [200, 200]
    assert engine.requests_to(CHAT)[-1].body == big


async def test_a_large_body_whose_model_is_rewritten_keeps_its_other_bytes() -> None:
    """A large body for an alias reaches the engine with its "model" replaced in its bytes:
    every other member's value byte for byte (numbers, escapes and spaces as the client wrote
    them), none of it decoded and encoded again."""
    messages = b'[{"role": "user", "content": "caf\\u00e9 \\"x\\""}]'
    extra = b"[" + b"1.50, " * 200_000 + b"1e3]"
    big = b'{"model": "chat", "messages": %s, "max_tokens": 2, "extra": %s}' % (messages, extra)
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine], routing={"aliases": {"chat": "fake-model"}}) as router:
            response = await router.client.post(CHAT, content=big)
    assert response.status_code == 200, response.text
    sent = engine.requests_to(CHAT)[-1].body
    assert json.loads(sent) == {**json.loads(big), "model": "fake-model"}
    assert messages in sent and extra in sent and b'"max_tokens":2' in sent


# -- slow readers, bounded connections --------------------------------------------------------
async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout() -> None:
    """A streamed answer to a client that takes nothing: after `write_timeout_s` without
    progress the router drops the client (status 499) and closes the engine's connection."""
    engine = FakeEngine(tokens=100_000, inter_token_s=0.0, max_model_len=1 << 20)
    with trio.fail_after(LIMIT):
        async with open_router([engine], server={"write_timeout_s": 0.5}) as router:
            stream = await open_raw(router.url)
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            body = json.dumps(chat(stream=True, max_tokens=100_000)).encode()
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n"
                b"content-length: %d\r\n\r\n" % len(body) + body
            )
            await engine.wait_until(lambda: engine.disconnects == 1)
            await stream.aclose()
            assert (
                await router.metric(
                    "trio_router_requests_total",
                    model="fake-model",
                    engine=router.engine_urls[0].removeprefix("http://"),
                    status="499",
                )
                == 1
            )


async def test_requests_wait_for_one_of_an_engines_connections() -> None:
    """`proxy.max_connections_per_engine`: beyond it, requests wait for a connection to be
    free instead of opening more; all of them are served."""
    gate = trio.Event()
    engine = FakeEngine(gate=gate)
    with trio.fail_after(LIMIT):
        async with open_router([engine], proxy={"max_connections_per_engine": 2}) as router:
            results: list[int] = []

            async def one() -> None:
                results.append((await router.client.post(CHAT, json=chat())).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(one)
                await engine.wait_until(lambda: engine.in_flight == 2)
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert engine.in_flight == 2  # the others wait in the router
                gate.set()
            assert results == [200] * 6


# -- outlier detection ------------------------------------------------------------------------
async def test_an_engine_whose_answers_are_garbage_is_ejected() -> None:
    """It passes its probes, but every answer to a request is malformed: after
    `proxy.eject_after_failures` failed requests it is out of routing (and stays out for
    `proxy.ejection_s`), and every later request goes to the healthy engine."""
    garbage = ScriptedEngine([], head=b"HTTP/1.1 200 OK\r\ncontent-length: zz\r\n\r\n")
    with trio.fail_after(LIMIT):
        async with open_scripted_router(
            garbage, proxy={"eject_after_failures": 3, "max_ejected_percent": 100}
        ) as (url, _):
            async with httpx.AsyncClient(base_url=url) as client:
                statuses = [(await client.post(CHAT, json=chat())).status_code for _ in range(3)]
                assert statuses == [502] * 3
                engines = (await client.get("/engines")).json()["engines"]
            (only,) = engines
            assert only["state"] == "unhealthy" and "3 requests in a row failed" in only["reason"]


async def test_outliers_are_ejected_but_never_more_than_the_allowed_share() -> None:
    slow = [FakeEngine(name=f"slow{i}", ttft_s=5.0) for i in range(2)]
    healthy = FakeEngine(name="ok")
    with trio.fail_after(LIMIT + 10):
        async with open_router(
            [*slow, healthy],
            proxy={
                "read_timeout_s": 0.3,
                "eject_after_failures": 2,
                "retries": 0,
                "max_ejected_percent": 34,
            },
        ) as router:
            for _ in range(8):
                await router.client.post(CHAT, json=chat())
            states = {e.name: e.state.value for e in router.table}
            assert sorted(states.values()) == ["routable", "routable", "unhealthy"]
            assert states[router.engine_urls[2].removeprefix("http://")] == "routable"


# -- the router's own limits ------------------------------------------------------------------
async def test_out_of_descriptors_is_a_503_not_an_engine_fault() -> None:
    async def no_descriptors(host: str, port: int) -> socket.socket:
        raise OSError(errno.EMFILE, "Too many open files")

    pool = UpstreamPool(connect_timeout=1.0, read_timeout=1.0, connect=no_descriptors)
    with pytest.raises(LocalLimitError, match="Too many open files") as caught:
        async with pool.request("http://10.0.0.1:8000", b"POST", CHAT_PATH, [], BODY):
            pass
    answer = from_transport(caught.value)  # what the client is told
    assert isinstance(answer, OverloadedError) and answer.status == 503


async def test_idle_engine_connections_closed_by_the_engine_are_swept() -> None:
    """An idle pooled connection whose engine has closed it is closed by `sweep()` (run
    every 2 s by the server), not left half-closed until the engine's next request."""
    pool = UpstreamPool(connect_timeout=1.0, read_timeout=1.0, max_idle_s=math.inf)
    with trio.fail_after(LIMIT):
        async with open_fake_engines([FakeEngine()]) as (url,):
            async with pool.request(url, b"POST", CHAT_PATH, [], BODY) as response:
                async for _ in response:
                    pass
            assert pool.idle_count() == 1 and pool.sweep() == 0
        # The engine is gone: its side of the idle connection is closed.
        await trio.testing.wait_all_tasks_blocked()
        assert pool.sweep() == 1 and pool.idle_count() == 0
    pool.close()


async def test_an_ejected_engine_that_was_down_is_readmitted_when_it_is_back() -> None:
    """Its answers broke off (it was dying: another engine answered them), so it is ejected
    for `proxy.ejection_s`, and probed at once: that probe fails (it is down); once a probe
    passes (restarted) it is routable again, not after its hold. Ejected the same way but
    never down (its probe passes), it stays out for its hold."""
    dying, other = FakeEngine(name="dying", break_whole_replies=True), FakeEngine(name="ok")
    proxy = {"eject_after_failures": 2, "ejection_s": 600.0, "max_ejected_percent": 100}
    probe = {"backoff_max_s": 0.2, "timeout_s": 0.3}
    with trio.fail_after(LIMIT):
        async with open_router([dying, other], proxy=proxy, probe=probe) as router:
            name = router.engine_urls[0].removeprefix("http://")

            def state() -> str:
                return next(e.state.value for e in router.table if e.name == name)

            dying.hang_models = True  # down from now on: its probes get no answer
            while state() == "routable":  # its answers break off until it is ejected
                await router.client.post(CHAT, json=chat())
            await trio.sleep(0.5)  # its probe at the ejection has failed
            dying.hang_models, dying.break_whole_replies = False, False  # back
            while state() != "routable":
                await router.table.wait_changed()
            answer = await router.client.post(CHAT, json=chat())
            assert answer.status_code == 200

            dying.break_whole_replies = True  # ejected again, but its probes pass
            while state() == "routable":
                await router.client.post(CHAT, json=chat())
            await trio.sleep(1.0)
            assert state() == "unhealthy"
