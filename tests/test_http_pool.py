"""The pool (`http.pool`) against real HTTP on 127.0.0.1: fake engines on Hypercorn, and
small h11/raw TCP servers where the test needs exact control of the wire (stale connections,
resets). Real clock, every test bounded by `trio.fail_after`."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial

import h11
import pytest
import trio
import trio.testing

from trio_router.http import (
    EngineBrokeOffError,
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    MalformedResponseError,
    TransportError,
    UpstreamPool,
    UpstreamResponse,
)
from trio_router.http.pool import CHECKPOINT_EVERY
from trio_router.testing import FakeEngine, open_fake_engines

CHAT = b"/v1/chat/completions"
JSON_HEADERS = [(b"content-type", b"application/json")]
LIMIT = 10.0  # seconds: generous bound on every test; they take milliseconds


def chat_body(*, stream: bool = False, model: str = "fake-model") -> bytes:
    return json.dumps(
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()


def new_pool(**kwargs: float) -> UpstreamPool:
    options: dict[str, float] = {"connect_timeout": 2.0, "read_timeout": 5.0}
    options.update(kwargs)
    return UpstreamPool(**options)  # type: ignore[arg-type]


async def read_all(resp: UpstreamResponse) -> bytes:
    return b"".join([chunk async for chunk in resp])


# -- a wire-level test server -------------------------------------------------------------
Handler = Callable[[int, trio.SocketStream], Awaitable[None]]


@dataclass
class WireServer:
    url: str
    connections: int = 0
    requests: list[tuple[int, h11.Request, bytes]] = field(default_factory=list)
    eofs: int = 0  # connections the client closed while the server waited for a request
    eof: trio.Event = field(default_factory=trio.Event)  # set at the first such close


@asynccontextmanager
async def wire_server(handler: Handler) -> AsyncIterator[WireServer]:
    """Serve on 127.0.0.1:0; `handler(index, stream)` runs per connection (index from 0)."""
    server = WireServer(url="")

    async def on_connection(stream: trio.SocketStream) -> None:
        index = server.connections
        server.connections += 1
        try:
            await handler(index, stream)
        except trio.BrokenResourceError:
            pass  # the client went away; the test looks at what it saw
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, on_connection, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        server.url = f"http://127.0.0.1:{port}"
        yield server
        nursery.cancel_scope.cancel()


async def read_request(
    server: WireServer, index: int, stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """The next request on `conn`, or None at EOF."""
    request: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            server.requests.append((index, request, body))
            return request, body
        elif isinstance(event, h11.ConnectionClosed):
            server.eofs += 1
            server.eof.set()
            return None
        else:
            raise AssertionError(event)


async def respond(
    stream: trio.SocketStream,
    conn: h11.Connection,
    status: int,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
) -> None:
    data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
    for chunk in chunks:
        data += conn.send(h11.Data(data=chunk)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


def reset(stream: trio.SocketStream) -> None:
    """Make the coming close a TCP RST rather than a FIN."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def keep_alive_handler(
    server_ref: list[WireServer],
    answer: Callable[[h11.Request, bytes], tuple[int, list[tuple[bytes, bytes]], list[bytes]]],
) -> Handler:
    """Answer every request on every connection with `answer(request, body)`."""

    async def handler(index: int, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while (got := await read_request(server_ref[0], index, stream, conn)) is not None:
            status, headers, chunks = answer(*got)
            await respond(stream, conn, status, headers, chunks)
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()

    return handler


@asynccontextmanager
async def answering_server(
    answer: Callable[[h11.Request, bytes], tuple[int, list[tuple[bytes, bytes]], list[bytes]]],
) -> AsyncIterator[WireServer]:
    ref: list[WireServer] = []
    async with wire_server(keep_alive_handler(ref, answer)) as server:
        ref.append(server)
        yield server


# -- keep-alive and bodies against fake engines --------------------------------------------
async def test_sequential_requests_reuse_one_connection() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            for _ in range(5):
                async with pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body()) as resp:
                    assert resp.status == 200
                    reply = json.loads(await read_all(resp))
                    assert reply["object"] == "chat.completion"
            assert pool.connections_opened == 1
            assert pool.idle_count(url) == 1
    clients = {r.client for r in engine.requests}
    assert len(engine.requests) == 5 and len(clients) == 1  # the engine saw one connection


async def test_concurrent_requests_open_connections_and_pool_them() -> None:
    engine = FakeEngine(gate=trio.Event())
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool(max_idle_per_origin=3) as pool:
            bodies: list[bytes] = []

            async def one() -> None:
                async with pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body()) as resp:
                    bodies.append(await read_all(resp))

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(one)
                await engine.wait_until(lambda: engine.in_flight == 5)
                assert engine.gate is not None
                engine.gate.set()
            assert len(bodies) == 5
            assert pool.connections_opened == 5
            assert pool.idle_count(url) == 3  # bounded idle list: the other two were closed
            async with pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body()) as resp:
                await read_all(resp)
            assert pool.connections_opened == 5


async def test_stream_arrives_chunk_by_chunk() -> None:
    engine = FakeEngine(gate=trio.Event(), tokens=3)
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            async with pool.request(
                url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=True)
            ) as resp:
                assert resp.status == 200
                assert dict(resp.headers)[b"content-type"].startswith(b"text/event-stream")
                chunks = aiter(resp)
                first = await anext(chunks)
                # The engine holds every later event until the gate opens.
                assert first.startswith(b"data: ") and first.endswith(b"\n\n")
                assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
                assert not resp.complete and not resp.at_hand()
                assert engine.completed == 0
                assert engine.gate is not None
                engine.gate.set()
                rest = b"".join([chunk async for chunk in chunks])
                assert resp.complete
            events = rest.split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            assert len(events) == 3 + 2 + 1  # tokens, the finish event, [DONE]
            assert pool.idle_count(url) == 1  # read to the end: kept alive


async def test_content_length_chunked_and_large_bodies() -> None:
    big = bytes(range(256)) * 16384  # 4 MiB

    def answer(
        request: h11.Request, body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
        if request.target == b"/echo-length":
            return 200, [(b"content-length", b"%d" % len(body))], [body]
        if request.target == b"/chunked":
            return 200, [(b"transfer-encoding", b"chunked")], [b"a" * 10, b"b" * 70_000, b"c"]
        return 200, [(b"content-length", b"%d" % len(big))], [big]

    with trio.fail_after(LIMIT):
        async with answering_server(answer) as server, new_pool() as pool:
            async with pool.request(server.url, b"POST", b"/echo-length", [], big) as resp:
                assert dict(resp.headers)[b"content-length"] == b"%d" % len(big)
                assert await read_all(resp) == big
            async with pool.request(server.url, b"GET", b"/chunked", [], b"") as resp:
                assert b"transfer-encoding" not in dict(resp.headers)  # hop-by-hop
                assert await read_all(resp) == b"a" * 10 + b"b" * 70_000 + b"c"
            async with pool.request(server.url, b"GET", b"/big", [], b"") as resp:
                assert await read_all(resp) == big
            assert server.connections == 1
    assert server.requests[0][2] == big  # the request body arrived whole
    assert [dict(r.headers).get(b"content-length") for _, r, _ in server.requests] == [
        b"%d" % len(big),
        b"0",
        b"0",
    ]


@pytest.mark.parametrize(
    "framing",
    [
        b"content-length: 12\r\n\r\nhello world!",
        b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n7\r\n world!\r\n0\r\n\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_here_whole_comes_as_one_complete_chunk(framing: bytes) -> None:
    """`complete` says the chunk just returned was the last, so the router can end its own
    response with it."""
    written = trio.Event()

    async def handler(index: int, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\n" + framing)
        written.set()
        await stream.receive_some(65536)  # until the client closes or sends again

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                await written.wait()
                assert not resp.complete
                assert resp.at_hand()  # it came with the head: no wait for it
                assert resp.at_hand()  # asking again reads nothing more
                assert await anext(aiter(resp)) == b"hello world!"
                assert resp.complete
                assert [chunk async for chunk in resp] == []
            assert pool.idle_count() == 1


async def test_responses_without_body_keep_the_connection() -> None:
    def answer(
        request: h11.Request, body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
        if request.method == b"HEAD":
            return 200, [(b"content-length", b"1234")], []
        if request.target == b"/304":
            return 304, [], []
        return 204, [], []

    with trio.fail_after(LIMIT):
        async with answering_server(answer) as server, new_pool() as pool:
            for method, target, status in [
                (b"HEAD", b"/", 200),
                (b"GET", b"/204", 204),
                (b"GET", b"/304", 304),
            ]:
                async with pool.request(server.url, method, target, [], b"") as resp:
                    assert resp.status == status
                    assert await read_all(resp) == b""
            async with pool.request(server.url, b"HEAD", b"/", [], b"") as resp:
                pass  # never iterated: the empty body still ends cleanly
            assert pool.idle_count(server.url) == 1
            assert server.connections == 1


async def test_unread_body_holds_the_engine_back() -> None:
    """Backpressure: what the caller does not read stays in the engine's socket."""
    total = 64 * 1024 * 1024
    sent = 0

    async def handler(index: int, stream: trio.SocketStream) -> None:
        nonlocal sent
        conn = h11.Connection(h11.SERVER)
        if await read_request(server, index, stream, conn):
            await stream.send_all(
                conn.send(
                    h11.Response(status_code=200, headers=[(b"content-length", b"%d" % total)])
                )
                or b""
            )
            block = b"x" * (1024 * 1024)
            for _ in range(total // len(block)):
                await stream.send_all(block)
                sent += len(block)

    with trio.fail_after(LIMIT):
        async with (
            wire_server(handler) as server,
            new_pool() as pool,
            pool.request(server.url, b"GET", b"/", [], b"") as resp,
        ):
            chunks = aiter(resp)
            received = len(await anext(chunks))
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert sent < total // 2  # the engine is stuck in send: socket buffers full
            async for chunk in chunks:
                received += len(chunk)
    assert received == sent == total


async def test_headers_forwarded_end_to_end_only() -> None:
    engine = FakeEngine()
    headers = [
        (b"Host", b"client-facing.example"),
        (b"Connection", b"keep-alive, X-Private"),
        (b"X-Private", b"secret"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Content-Length", b"999"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Authorization", b"Bearer k"),
        (b"X-Request-Id", b"r1"),
        *JSON_HEADERS,
    ]
    with trio.fail_after(LIMIT):
        async with (
            open_fake_engines([engine]) as (url,),
            new_pool() as pool,
            pool.request(url, b"POST", CHAT + b"?a=1", headers, chat_body()) as resp,
        ):
            await read_all(resp)
            names = [name for name, _ in resp.headers]
            assert b"x-fake-engine" in names and b"content-length" in names
    seen = engine.requests[-1]
    assert seen.query == {"a": "1"}
    assert seen.header("host") == url.removeprefix("http://")
    assert seen.header("content-length") == str(len(chat_body()))
    assert seen.header("x-private") is None and seen.header("keep-alive") is None
    assert seen.header("transfer-encoding") is None
    assert seen.header("authorization") == "Bearer k" and seen.header("x-request-id") == "r1"
    assert seen.json()["model"] == "fake-model"


async def test_connection_close_answer_is_not_pooled() -> None:
    def answer(
        request: h11.Request, body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
        return 200, [(b"connection", b"close"), (b"content-length", b"2")], [b"ok"]

    with trio.fail_after(LIMIT):
        async with answering_server(answer) as server, new_pool() as pool:
            for _ in range(2):
                async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                    assert await read_all(resp) == b"ok"
                    assert (b"connection", b"close") not in resp.headers
            assert pool.idle_count() == 0
            assert server.connections == 2


# -- failures before the request is delivered: EngineUnreachableError ----------------------
async def test_connect_refused_is_unreachable() -> None:
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(LIMIT):
        async with new_pool() as pool:
            with pytest.raises(EngineUnreachableError, match=f"127.0.0.1:{port}") as info:
                async with pool.request(url, b"POST", CHAT, [], b"{}"):
                    raise AssertionError("not reached")
    assert isinstance(info.value, TransportError)  # no HTTP status: the serving layer maps it


async def test_connect_timeout_is_unreachable() -> None:
    # A listener that never accepts, with its backlog full: Linux drops further SYNs, so
    # the next connect hangs until the client gives up.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        with trio.fail_after(LIMIT):
            async with new_pool(connect_timeout=0.3) as pool:
                start = trio.current_time()
                with pytest.raises(EngineUnreachableError, match=r"no answer within 0\.3 s"):
                    async with pool.request(f"http://127.0.0.1:{port}", b"GET", b"/", [], b""):
                        raise AssertionError("not reached")
                assert trio.current_time() - start < 2.0
    finally:
        for s in fillers:
            s.close()
        listener.close()


@pytest.mark.parametrize(
    "url",
    ["https://e:1", "http://e:99999", "http://:80", "ftp://e", "http://e x:80", "http://\u00e9:80"],
)
async def test_unusable_url_is_unreachable(url: str) -> None:
    async with new_pool() as pool:
        with pytest.raises(EngineUnreachableError, match="not usable"):
            async with pool.request(url, b"GET", b"/", [], b""):
                raise AssertionError("not reached")


async def test_host_header_is_the_engine_authority() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            authority = url.removeprefix("http://")
            async with pool.request(
                f"http://user:secret@{authority}/", b"GET", b"/health", [], b""
            ) as resp:
                assert resp.status == 200
    assert engine.requests[-1].header("host") == authority


async def test_stale_pooled_connection_is_retried_on_a_fresh_one() -> None:
    server_ref: list[WireServer] = []

    async def handler(index: int, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        n = 0
        while await read_request(server_ref[0], index, stream, conn) is not None:
            if index == 0 and n == 1:
                reset(stream)  # a keep-alive connection dying as the 2nd request arrives
                return
            await respond(stream, conn, 200, [(b"content-length", b"%d" % index)], [b"x" * index])
            conn.start_next_cycle()
            n += 1

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            server_ref.append(server)
            for expected in (b"", b"x"):
                async with pool.request(server.url, b"POST", b"/", [], b"{}") as resp:
                    assert resp.status == 200
                    assert await read_all(resp) == expected
            assert server.connections == 2 and pool.connections_opened == 2
    assert [index for index, _, _ in server.requests] == [0, 0, 1]


async def test_idle_connection_closed_by_engine_is_not_reused() -> None:
    server_ref: list[WireServer] = []
    closed = trio.Event()

    async def handler(index: int, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while await read_request(server_ref[0], index, stream, conn) is not None:
            if conn.our_state is h11.SEND_RESPONSE:
                await respond(stream, conn, 200, [(b"content-length", b"2")], [b"ok"])
            if index == 0 and not closed.is_set():
                # An engine's keep-alive timeout: it closes its side while idle. It keeps
                # reading, so a request sent into this connection would show up here.
                await stream.send_eof()
                closed.set()
            if conn.our_state is h11.DONE:
                conn.start_next_cycle()

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            server_ref.append(server)
            async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                await read_all(resp)
            await closed.wait()
            async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                assert await read_all(resp) == b"ok"
            await server.eof.wait()
    # The closed connection was noticed before use: no request was sent into it.
    assert [index for index, _, _ in server.requests] == [0, 1]


async def test_old_idle_connections_are_not_reused() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool(max_idle_s=0.0) as pool:
            for _ in range(2):
                async with pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body()) as resp:
                    await read_all(resp)
            assert pool.connections_opened == 2


async def test_connection_closed_before_any_response_is_unreachable() -> None:
    server_ref: list[WireServer] = []

    async def handler(index: int, stream: trio.SocketStream) -> None:
        got = await read_request(server_ref[0], index, stream, h11.Connection(h11.SERVER))
        if got is not None and index % 2:
            reset(stream)  # RST on odd connections, FIN on even ones

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            server_ref.append(server)
            for _ in range(2):
                with pytest.raises(EngineUnreachableError, match="closed the connection"):
                    async with pool.request(server.url, b"POST", b"/", [], b"{}"):
                        raise AssertionError("not reached")
            assert pool.idle_count() == 0


# -- failures after delivery: timeouts and broken bodies ----------------------------------
async def test_silent_engine_before_head_times_out() -> None:
    engine = FakeEngine(ttft_s=30.0)
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool(read_timeout=0.2) as pool:
            with pytest.raises(EngineTimeoutError, match=url) as info:
                async with pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body()):
                    raise AssertionError("not reached")
            assert not isinstance(info.value, EngineUnreachableError)  # not a failover signal
            await engine.wait_until(lambda: engine.disconnects == 1)  # the socket was closed
            assert pool.idle_count() == 0


async def test_engine_that_stops_taking_the_request_times_out() -> None:
    never = trio.Event()

    async def handler(index: int, stream: trio.SocketStream) -> None:
        await never.wait()  # accepts, never reads: the socket buffers fill up

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool(read_timeout=0.2) as pool:
            with pytest.raises(EngineTimeoutError, match="stopped taking the request"):
                async with pool.request(server.url, b"POST", b"/", [], b"x" * (16 * 1024 * 1024)):
                    raise AssertionError("not reached")
            assert pool.idle_count() == 0
            never.set()


async def test_a_body_that_is_always_there_still_checkpoints() -> None:
    """Chunks already in the socket buffer come back without waiting, yet at least every
    CHECKPOINT_EVERY-th one is a checkpoint: other tasks run, a cancellation lands."""
    body = b"x" * (2 * 1024 * 1024)
    written = trio.Event()

    async def handler(index: int, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        # Let the kernel buffer it all before the client reads (Trio caps unsent bytes).
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, 1 << 30)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        written.set()  # all of it is in the kernel's buffers: reads need not wait

    ticks = 0

    async def other_task() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(LIMIT):
        async with (
            wire_server(handler) as server,
            new_pool() as pool,
            trio.open_nursery() as nursery,
        ):
            async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                await written.wait()
                nursery.start_soon(other_task)
                start, chunks, received = ticks, 0, b""
                async for chunk in resp:
                    chunks += 1
                    received += chunk
                others_ran = ticks - start
            nursery.cancel_scope.cancel()
    assert received == body
    assert chunks > 2 * CHECKPOINT_EVERY
    # The other task runs once per scheduler pass, so once per checkpoint of the reader.
    assert others_ran >= chunks // CHECKPOINT_EVERY - 1

    # The same body for a reader cancelled once the head was in (its client left): it stops
    # at its first checkpoint.
    written = trio.Event()
    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            with trio.CancelScope() as cancelled:
                async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                    await written.wait()
                    cancelled.cancel()
                    chunks = 0
                    async for _ in resp:
                        chunks += 1
            assert cancelled.cancelled_caught
            assert chunks == CHECKPOINT_EVERY - 1  # the 16th is not handed out
            assert pool.idle_count() == 0


async def test_silence_between_chunks_times_out() -> None:
    engine = FakeEngine(gate=trio.Event())
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool(read_timeout=0.2) as pool:
            chunks: list[bytes] = []
            with pytest.raises(EngineTimeoutError, match="mid-response"):
                async with pool.request(
                    url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=True)
                ) as resp:
                    async for chunk in resp:
                        chunks.append(chunk)
            assert len(chunks) == 1
            await engine.wait_until(lambda: engine.disconnects == 1)


async def test_slow_but_steady_stream_does_not_time_out() -> None:
    engine = FakeEngine(tokens=6, inter_token_s=0.05)
    with trio.fail_after(LIMIT):
        async with (
            open_fake_engines([engine]) as (url,),
            new_pool(read_timeout=0.15) as pool,
            pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=True)) as resp,
        ):
            body = b"".join([chunk async for chunk in resp])
    assert body.count(b"data: ") == 6 + 3  # total 0.3 s > read_timeout: only silence counts


async def test_reset_mid_body_is_a_broken_answer() -> None:
    async def handler(index: int, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        if await read_request(server, index, stream, conn):
            data = conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"1000")]))
            await stream.send_all((data or b"") + b"x" * 10)
            reset(stream)

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            with pytest.raises(EngineBrokeOffError) as info:
                async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                    assert resp.status == 200
                    async for _ in resp:
                        pass
            assert not isinstance(info.value, EngineUnreachableError)
            assert pool.idle_count() == 0


async def test_stream_broken_off_by_engine_is_a_broken_answer() -> None:
    engine = FakeEngine(abort_after_first_event=True)
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            chunks: list[bytes] = []
            with pytest.raises(EngineBrokeOffError, match="broke off") as info:
                async with pool.request(
                    url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=True)
                ) as resp:
                    async for chunk in resp:
                        chunks.append(chunk)
            assert not isinstance(info.value, EngineUnreachableError)
            assert len(chunks) == 1


async def test_malformed_response_is_a_broken_answer() -> None:
    async def handler(index: int, stream: trio.SocketStream) -> None:
        if await read_request(server, index, stream, h11.Connection(h11.SERVER)):
            await stream.send_all(b"SPDY/9 banana\r\n\r\n")

    with trio.fail_after(LIMIT):
        async with wire_server(handler) as server, new_pool() as pool:
            with pytest.raises(MalformedResponseError, match="malformed") as info:
                async with pool.request(server.url, b"GET", b"/", [], b""):
                    raise AssertionError("not reached")
            assert not isinstance(info.value, EngineUnreachableError)


async def test_a_broken_body_found_by_at_hand_breaks_the_next_step() -> None:
    async def handler(index: int, stream: trio.SocketStream) -> None:
        if await read_request(server, index, stream, h11.Connection(h11.SERVER)):
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nbanana\r\n"
            )
            await stream.receive_some(65536)

    with trio.fail_after(LIMIT):
        async with (
            wire_server(handler) as server,
            new_pool() as pool,
            pool.request(server.url, b"GET", b"/", [], b"") as resp,
        ):
            assert resp.at_hand()  # written with the head: here with it
            with pytest.raises(EngineBrokeOffError, match="broke off the response body"):
                await anext(aiter(resp))


# -- leaving early and cancellation close the upstream connection -------------------------
async def test_cancelled_stream_closes_the_engine_connection() -> None:
    engine = FakeEngine(gate=trio.Event())
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            got_first = trio.Event()

            async def client() -> None:
                async with pool.request(
                    url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=True)
                ) as resp:
                    async for _ in resp:
                        got_first.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(client)
                await got_first.wait()
                nursery.cancel_scope.cancel()  # the router's client went away
            with trio.fail_after(1.0):
                await engine.wait_until(lambda: engine.disconnects == 1)
            assert pool.idle_count() == 0 and engine.completed == 0


async def test_cancel_while_waiting_for_head_closes_the_engine_connection() -> None:
    engine = FakeEngine(ttft_s=60.0)
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            async with trio.open_nursery() as nursery:

                async def client() -> None:
                    async with pool.request(url, b"POST", CHAT, JSON_HEADERS, chat_body()):
                        raise AssertionError("not reached")

                nursery.start_soon(client)
                await engine.wait_until(lambda: engine.in_flight == 1)
                nursery.cancel_scope.cancel()
            with trio.fail_after(1.0):
                await engine.wait_until(lambda: engine.disconnects == 1)
            assert pool.idle_count() == 0


@pytest.mark.parametrize("stream", [False, True], ids=["awaiting-head", "mid-stream"])
async def test_a_cancelled_exchange_ends_the_wait_and_closes_the_engine_connection(
    autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    """Virtual time: the engine holds the head 60 s (non-streamed) or the second event
    (streamed); the client leaves at 2 s (its request's scope is cancelled, as the server's
    disconnect hook does) and the exchange stops at once, closing the engine's connection."""
    engine = FakeEngine(gate=trio.Event()) if stream else FakeEngine(ttft_s=60.0)
    with trio.fail_after(100):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            events = 0
            with trio.move_on_after(2) as request:
                async with pool.request(
                    url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=stream)
                ) as resp:
                    async for _ in resp:
                        events += 1
            assert request.cancelled_caught and trio.current_time() == pytest.approx(2)
            assert events == (1 if stream else 0)
            await engine.wait_until(lambda: engine.disconnects == 1)
            assert pool.idle_count() == 0 and engine.completed == 0


async def test_leaving_before_the_end_closes_instead_of_pooling() -> None:
    engine = FakeEngine(gate=trio.Event())
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            async with pool.request(
                url, b"POST", CHAT, JSON_HEADERS, chat_body(stream=True)
            ) as resp:
                await anext(aiter(resp))
            await engine.wait_until(lambda: engine.disconnects == 1)
            assert pool.idle_count() == 0
            with pytest.raises(trio.ClosedResourceError):
                await anext(aiter(resp))


async def test_aclose_closes_idle_connections() -> None:
    def answer(
        request: h11.Request, body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
        return 200, [(b"content-length", b"0")], []

    with trio.fail_after(LIMIT):
        async with answering_server(answer) as server:
            pool = new_pool()
            async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                await read_all(resp)
            assert pool.idle_count() == 1
            await pool.aclose()
            assert pool.idle_count() == 0
            await server.eof.wait()  # the server's read ends with EOF: the client closed
            # Still usable after aclose, but nothing is pooled any more.
            async with pool.request(server.url, b"GET", b"/", [], b"") as resp:
                await read_all(resp)
            assert pool.idle_count() == 0


async def test_header_injection_is_refused_before_sending() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (url,), new_pool() as pool:
            for headers in (
                [(b"x-a", b"1\r\nx-injected: 1")],
                [(b"bad name", b"1")],
                [(b"x-a", b"\n")],
            ):
                with pytest.raises(InvalidRequestError, match="cannot send request") as info:
                    async with pool.request(url, b"POST", CHAT, headers, b"{}"):
                        raise AssertionError("not reached")
                assert not isinstance(info.value, EngineUnreachableError)
            with pytest.raises(InvalidRequestError, match="invalid request line"):
                async with pool.request(url, b"POST", b"/a b", [], b"{}"):
                    raise AssertionError("not reached")
    assert engine.request_count == 0
