"""`connection.ClientConnection`, trio_router's server connections driving Hypercorn's protocols
(`hypercorn_seam.serve`): keep-alive timing, shutdown, writes the socket cannot take at once,
clients that vanish, the disconnect hook, joined writes, accepting.

Real sockets on 127.0.0.1: `hypercorn_seam.serve` with a small ASGI app, raw TCP clients. The
timing tests run on the autojump clock (loopback data is ready at the next I/O poll, so the
clock only jumps while every side waits): a 5 s keep-alive takes milliseconds.
"""

from __future__ import annotations

import gc
import logging
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import httpx
import hypercorn.config
import pytest
import trio
import trio.testing

from trio_router.asgi import answer_lifespan
from trio_router.serving import connection, hypercorn_seam
from trio_router.serving.answer import answer_of

KEEP_ALIVE: Final = 5.0
BIG: Final = 16 * 1024 * 1024  # more than the kernel takes in one write on loopback
LIMIT: Final = 10.0  # real seconds: only bounds a hang of the real-clock tests
VIRTUAL_LIMIT: Final = 600.0  # bounds every test, in virtual seconds on the autojump clock


DISCONNECTS: list[tuple[int, float]] = []  # /paced/N: (messages sent, when) at a disconnect
HOOKED: list[tuple[str, bool]] = []  # /hook/...: (what, whether the hook cancelled the request)
HOOKED_DONE = [trio.Event(), trio.Event()]  # set as each /hook request ends (in order)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """GET /: a short answer. /sleep/S: the answer after S seconds. /big: BIG bytes in one
    message. /stream/N: N messages of 64 KiB. /paced/N: N messages 1 s apart, noting in
    DISCONNECTS when the client leaves."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    if path.startswith("/held/"):
        await held(scope, send, path.removeprefix("/held/"))
        return
    if path.startswith("/hook/"):
        await hooked(scope, receive, send, path.removeprefix("/hook/"))
        return
    if path == "/client":  # the answer writer the server gave the request
        body = type(answer_of(scope)).__name__.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    if path.startswith("/status/"):
        await send(
            {
                "type": "http.response.start",
                "status": int(path.removeprefix("/status/")),
                "headers": [(b"content-length", b"0")],
            }
        )
        await send({"type": "http.response.body", "body": b""})
        return
    if path.startswith("/sleep/"):
        await trio.sleep(float(path.removeprefix("/sleep/")))
    if path == "/big":
        body = pattern(BIG)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})
    elif path.startswith("/paced/"):  # N messages 1 s apart, until the client leaves
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(int(path.removeprefix("/paced/"))):
            await send({"type": "http.response.body", "body": pattern(1024, i), "more_body": True})
            with trio.move_on_after(1):
                if (await receive())["type"] == "http.disconnect":
                    DISCONNECTS.append((i, trio.current_time()))
                    return
        await send({"type": "http.response.body", "body": b""})
    elif path.startswith("/stream/"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        count = int(path.removeprefix("/stream/"))
        for i in range(count):
            await send({"type": "http.response.body", "body": pattern(65536, i), "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


async def hooked(scope: dict[str, Any], receive: Any, send: Any, what: str) -> None:
    """/hook/hold: the request's scope armed with its answer writer, a first chunk sent, then
    held until cancelled. /hook/finish: armed, then the answer ended (which disarms it)."""
    answer = answer_of(scope)
    assert answer is not None
    done = HOOKED_DONE[len(HOOKED)]
    with trio.CancelScope() as cancel:
        answer.arm(cancel)
        if what == "hold":
            answer.start(200, [])
            await answer.body(b"first")
            await trio.sleep_forever()
        answer.start(200, [(b"content-length", b"4")])
        await answer.end(b"done")
        # The end of the exchange is reported to the app as a disconnect; the hook is not.
        while (await receive())["type"] != "http.disconnect":
            pass
    HOOKED.append((what, cancel.cancelled_caught))
    done.set()


HELD_SENT = [trio.Event()]  # /held/...: set once the message before the pause is sent
HELD_GO = [trio.Event()]  # /held/...: set by the test to have the app go on


async def held(scope: dict[str, Any], send: Any, what: str) -> None:
    """/held/head: the head given to the answer writer, then, once HELD_GO is set, the body
    and the end. /held/none: the head sent as a plain ASGI message, then the same. /held/body:
    a chunked body's first piece, its last handed to the writer, then the end once HELD_GO is
    set. /held/after: a whole answer, then a write held with no message after it."""
    answer = answer_of(scope)
    assert isinstance(answer, connection.ConnectionAnswer)
    headers = [(b"content-length", b"4")]
    if what in ("head", "none"):
        if what == "head":
            answer.start(200, headers)
        else:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        HELD_SENT[0].set()
        await HELD_GO[0].wait()
        await answer.end(b"body")
    elif what == "body":
        answer.start(200, [])
        await answer.body(b"first")
        answer._connection.write_with_next(b"6\r\nsecond\r\n")  # as a relay's last read
        HELD_SENT[0].set()
        await HELD_GO[0].wait()
        await answer.end()
    else:
        answer.start(200, headers)
        await answer.end(b"done")
        answer._connection.hold_next()


def pattern(size: int, seed: int = 0) -> bytes:
    """`size` bytes that differ from one offset (and seed) to the next, so a lost, repeated
    or reordered piece shows."""
    block = bytes((seed + i) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


@dataclass
class Served:
    port: int
    stop: trio.Event
    clients: list[trio.SocketStream] = field(default_factory=list)

    async def connect(self) -> trio.SocketStream:
        """A client connection, closed at the end of `serve()` if the test did not."""
        self.clients.append(await trio.open_tcp_stream("127.0.0.1", self.port))
        return self.clients[-1]


@asynccontextmanager
async def serve() -> AsyncIterator[Served]:
    """`app` served by `hypercorn_seam.serve` (trio_router's connections driving Hypercorn's
    protocols); `stop` starts the graceful shutdown."""
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = KEEP_ALIVE
    config.graceful_timeout = 60.0
    config.accesslog = None
    config.errorlog = logging.getLogger("test_connection.hypercorn")
    stop = trio.Event()
    with trio.fail_after(VIRTUAL_LIMIT):
        async with trio.open_nursery() as nursery:
            asgi: Any = app
            urls = await nursery.start(
                partial(hypercorn_seam.serve, asgi, config, shutdown_trigger=stop.wait)
            )
            served = Served(int(urls[0].rsplit(":", 1)[1]), stop)
            try:
                yield served
            finally:
                for client in served.clients:
                    await client.aclose()
                nursery.cancel_scope.cancel()


async def request(stream: trio.SocketStream, path: str) -> None:
    await stream.send_all(b"GET %s HTTP/1.1\r\nhost: test\r\n\r\n" % path.encode())


async def read_response(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """(head, body) of one response framed by Content-Length or chunked encoding."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some()
        assert data, f"closed in the head: {buffer!r}"
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:])
    if b"content-length" in fields:
        length = int(fields[b"content-length"])
        while len(rest) < length:
            data = await stream.receive_some()
            assert data, "closed in the body"
            rest += data
        assert len(rest) == length, "bytes after the response"
        return head, rest
    assert fields[b"transfer-encoding"] == b"chunked"
    body = b""
    while True:
        while b"\r\n" not in rest:
            rest += await stream.receive_some()
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            data = await stream.receive_some()
            assert data, "closed in the body"
            rest += data
        body, rest = body + rest[:size], rest[size + 2 :]
        if not size:
            assert not rest, "bytes after the response"
            return head, body


async def wait_closed_by_server(stream: trio.SocketStream) -> None:
    """Return once the server closed `stream` (EOF or reset); fail if it sends anything."""
    try:
        data = await stream.receive_some()
    except trio.BrokenResourceError:
        return
    assert not data, f"unexpected bytes: {data[:100]!r}"


def timer_tasks() -> int:
    """Connections' keep-alive timer tasks now running in this Trio run."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    count, pending = 0, [root]
    while pending:
        task = pending.pop()
        count += task.name.endswith("ClientConnection._keep_alive")
        pending.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return count


async def until(condition: Callable[[], bool]) -> None:
    """Wait for `condition` about the task tree or the app, which no event reports: checked
    every 10 ms of virtual time (only on the autojump clock, where it costs no real time and
    says when the condition came true)."""
    while True:
        if condition():
            return
        await trio.sleep(0.01)


async def idle_and_busy(
    served: Served, *, busy_for: float
) -> tuple[trio.SocketStream, trio.SocketStream]:
    """Two connections: one idle after an answer, one whose request is answered after
    `busy_for` seconds."""
    idle, busy = await served.connect(), await served.connect()
    await request(idle, "/")
    await read_response(idle)
    await request(busy, f"/sleep/{busy_for:g}")
    return idle, busy


# -- the status line ------------------------------------------------------------------------
async def test_status_lines_carry_their_reason_phrase() -> None:
    """As vLLM's server writes them (Hypercorn alone writes `HTTP/1.1 200 `); a status with no
    registered phrase keeps an empty one."""
    async with serve() as served:
        client = await served.connect()
        heads = []
        for path in ("/", "/status/404", "/status/503", "/status/599", "/stream/1"):
            await request(client, path)
            heads.append((await read_response(client))[0].split(b"\r\n", 1)[0])
    assert heads == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 503 Service Unavailable",
        b"HTTP/1.1 599 ",
        b"HTTP/1.1 200 OK",
    ]


# -- keep-alive -----------------------------------------------------------------------------
async def test_idle_connection_is_closed_after_the_keep_alive_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        silent = await served.connect()  # never sends anything
        used = await served.connect()
        await request(used, "/")
        assert (await read_response(used))[1] == b"ok"
        idle_from = trio.current_time()
        await wait_closed_by_server(used)
        assert trio.current_time() - idle_from == pytest.approx(KEEP_ALIVE, abs=0.01)
        await wait_closed_by_server(silent)


async def test_each_request_restarts_the_keep_alive_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        stream = await served.connect()
        for _ in range(4):  # 4 requests 4 s apart: 16 s, longer than the timeout
            await request(stream, "/")
            assert (await read_response(stream))[1] == b"ok"
            await trio.sleep(KEEP_ALIVE - 1)
        last = trio.current_time() - (KEEP_ALIVE - 1)
        await wait_closed_by_server(stream)
        assert trio.current_time() - last == pytest.approx(KEEP_ALIVE, abs=0.01)


async def test_request_longer_than_the_keep_alive_timeout_is_not_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        stream = await served.connect()
        started = trio.current_time()
        await request(stream, f"/sleep/{4 * KEEP_ALIVE}")
        assert (await read_response(stream))[1] == b"ok"
        answered = trio.current_time()
        assert answered - started == pytest.approx(4 * KEEP_ALIVE, abs=0.01)
        await wait_closed_by_server(stream)  # the timer counts from the answer
        assert trio.current_time() - answered == pytest.approx(KEEP_ALIVE, abs=0.01)


async def test_shutdown_closes_idle_connections_now_and_busy_ones_after_their_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        idle, busy = await idle_and_busy(served, busy_for=3)
        await trio.sleep(1)
        served.stop.set()
        await wait_closed_by_server(idle)
        assert trio.current_time() == pytest.approx(1, abs=0.01)
        assert (await read_response(busy))[1] == b"ok"
        await wait_closed_by_server(busy)
        assert trio.current_time() == pytest.approx(3, abs=0.01)


async def test_a_connection_the_client_closed_leaves_no_timer_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        idle, busy = await idle_and_busy(served, busy_for=30)
        await until(lambda: timer_tasks() == 2)
        closed_at = trio.current_time()
        await idle.aclose()
        await busy.aclose()  # while its request is still being answered
        await until(lambda: timer_tasks() == 0)
        assert trio.current_time() - closed_at < 0.1  # not at the timeout, not after 30 s


# -- writes ---------------------------------------------------------------------------------
async def test_large_answers_reach_a_slow_reader_whole_and_in_order() -> None:
    """16 MiB in one message and 256 messages of 64 KiB: most of each write waits for the
    reader, then the connection carries the next request."""
    with trio.fail_after(LIMIT):
        async with serve() as served:
            stream = await served.connect()
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            await request(stream, "/big")
            head, body = await read_response(stream)
            assert head.startswith(b"HTTP/1.1 200") and body == pattern(BIG)
            await request(stream, "/stream/256")
            assert (await read_response(stream))[1] == b"".join(
                pattern(65536, i) for i in range(256)
            )
            await request(stream, "/")
            assert (await read_response(stream))[1] == b"ok"


async def test_a_reader_that_vanishes_mid_answer_does_not_disturb_the_server(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        stream = await served.connect()
        await request(stream, "/big")
        await stream.receive_some()
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset_at = trio.current_time()
        await stream.aclose()  # a reset, with most of the answer still unsent
        other = await served.connect()
        await request(other, "/")
        assert (await read_response(other))[1] == b"ok"
        await until(lambda: timer_tasks() == 1)  # the other connection's only
        assert trio.current_time() - reset_at < 0.1


async def test_a_client_reset_mid_answer_reaches_the_app_as_a_disconnect(
    autojump_clock: trio.testing.MockClock,
) -> None:
    DISCONNECTS.clear()
    async with serve() as served:
        stream = await served.connect()
        await request(stream, "/paced/100")
        await stream.receive_some()  # the answer has begun
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset_at = trio.current_time()
        await stream.aclose()
        await until(lambda: bool(DISCONNECTS))
        ((sent, seen_at),) = DISCONNECTS
        assert sent == 0 and seen_at - reset_at < 0.01
        other = await served.connect()
        await request(other, "/")
        assert (await read_response(other))[1] == b"ok"


class RecordingProtocol:
    """Stands in for the protocol behind one connection: counts the connection's reports that
    it closed."""

    def __init__(self) -> None:
        self.closings = 0

    async def initiate(self) -> None:
        pass

    async def received(self, data: bytes) -> None:
        pass

    async def closed(self) -> None:
        self.closings += 1


def opened(protocol: RecordingProtocol, connection: Any, nursery: Any) -> RecordingProtocol:
    return protocol


async def test_writes_to_a_reset_or_closed_socket_tell_the_protocol_it_closed() -> None:
    """The write path itself, on a real socket pair: a reset peer and a closed socket are
    reported as closed to the protocol, never raised to the application's send."""
    with trio.fail_after(LIMIT):
        for how in ("reset", "closed"):
            ours, peer = socket_pair()
            recording = RecordingProtocol()
            settings = connection.ConnectionSettings(terminated=trio.Event(), keep_alive_s=5)
            conn = connection.ClientConnection(ours, settings, partial(opened, recording))
            conn._protocol = recording  # as `run` sets it
            if how == "reset":
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await peer.aclose()
                await conn.write(b"first")  # may still be taken
                await conn.write(b"second")
            else:
                await ours.aclose()
                await conn.write(b"data")
                await peer.aclose()
            assert recording.closings, how
            await ours.aclose()


def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Two connected TCP streams on 127.0.0.1."""
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return (
        trio.SocketStream(trio.socket.from_stdlib_socket(a)),
        trio.SocketStream(trio.socket.from_stdlib_socket(b)),
    )


async def test_http2_streams_share_the_connection_and_its_writes() -> None:
    """Hypercorn's HTTP/2 (prior knowledge) over the same class: concurrent streams write
    through one socket, large answers included."""
    with trio.fail_after(LIMIT):
        async with (
            serve() as served,
            httpx.AsyncClient(
                http1=False, http2=True, base_url=f"http://127.0.0.1:{served.port}", timeout=LIMIT
            ) as client,
        ):
            results: dict[str, bytes] = {}

            async def get(path: str) -> None:
                response = await client.get(path)
                assert response.http_version == "HTTP/2" and response.status_code == 200
                results[path] = response.content

            async with trio.open_nursery() as nursery:
                for path in ("/", "/big", "/stream/16", "/sleep/0.1"):
                    nursery.start_soon(get, path)
            assert results["/big"] == pattern(BIG)
            assert results["/stream/16"] == b"".join(pattern(65536, i) for i in range(16))
            assert results["/"] == results["/sleep/0.1"] == b"ok"
            assert timer_tasks() == 1  # one connection, one timer


# -- the fence and the fallback -------------------------------------------------------------
def test_every_hypercorn_touchpoint_has_the_parameters_it_was_written_against() -> None:
    """The installed Hypercorn fits the seam: every internal it uses (TOUCHPOINTS) has the
    parameters the seam passes."""
    assert hypercorn_seam.fits() == []
    names = [name for name, _ in hypercorn_seam.TOUCHPOINTS]
    assert "hypercorn.protocol.ProtocolWrapper" in names
    assert "hypercorn.typing.TaskGroup.spawn_app" in names


async def test_a_hypercorn_that_does_not_fit_serves_through_its_own_connections(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A touchpoint whose parameters changed is named in a warning, and Hypercorn's own
    `serve` serves instead: requests then get no answer writer (the app uses plain ASGI)."""
    async with serve() as served:
        stream = await served.connect()
        await request(stream, "/client")
        assert (await read_response(stream))[1] == b"ConnectionAnswer"

    # As if the seam had been written for a `handle` with another parameter, and for a
    # helper this Hypercorn does not have.
    changed = tuple(
        (name, (*params, "extra") if name.endswith(".handle") else params)
        for name, params in hypercorn_seam.TOUCHPOINTS
    )
    monkeypatch.setattr(
        hypercorn_seam, "TOUCHPOINTS", (*changed, ("hypercorn.protocol.gone", ("x",)))
    )
    assert hypercorn_seam.fits() == [
        "hypercorn.protocol.ProtocolWrapper.handle('self', 'event') "
        "(expected ('self', 'event', 'extra'))",
        "hypercorn.protocol.gone"
        "not there: module 'hypercorn.protocol' has no attribute 'gone' (expected ('x',))",
    ]
    async with serve() as served:
        plain = await served.connect()
        await request(plain, "/client")
        assert (await read_response(plain))[1] == b"NoneType"
    assert "serving with Hypercorn's own" in caplog.text
    assert "ProtocolWrapper.handle" in caplog.text


async def test_the_disconnect_hook_cancels_an_armed_request_when_its_client_leaves() -> None:
    """The app arms the hook with its request's cancel scope: the client closing its
    connection cancels it (no task of the app watched); a request that disarmed it before its
    last message is not cancelled by the end of its exchange, which Hypercorn also reports as
    a disconnect."""
    HOOKED.clear()
    async with serve() as served:
        client = await served.connect()
        await request(client, "/hook/hold")
        assert b"first" in await client.receive_some()
        await client.aclose()
        await HOOKED_DONE[0].wait()
        kept = await served.connect()
        await request(kept, "/hook/finish")
        assert (await read_response(kept))[1] == b"done"
        await HOOKED_DONE[1].wait()
    assert HOOKED == [("hold", True), ("finish", False)]
    assert answer_of({"type": "http", "extensions": {}}) is None


# -- accepting ----------------------------------------------------------------------------------
@asynccontextmanager
async def listening() -> AsyncIterator[tuple[socket.socket, trio.SocketListener, tuple[str, int]]]:
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(64)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
    try:
        yield raw, listener, raw.getsockname()
    finally:
        await listener.aclose()


async def test_a_burst_of_new_connections_is_accepted_in_one_turn() -> None:
    """Connections waiting together in the listen backlog all come out of the first accept's
    turn: the next `accept()` calls hand them out without a trip through the scheduler."""
    async with listening() as (raw, listener, address):
        draining = connection.DrainingListener(listener, raw, None)
        clients = [socket.create_connection(address) for _ in range(20)]
        try:
            with trio.fail_after(LIMIT):
                streams = [await draining.accept()]
            with trio.testing.assert_no_checkpoints():
                streams += [await draining.accept() for _ in range(19)]
            peers = {stream.socket.getpeername() for stream in streams}
            assert peers == {client.getsockname() for client in clients}
            for stream in streams:
                await stream.aclose()
        finally:
            for client in clients:
                client.close()


async def test_beyond_the_connection_bound_connections_wait_in_the_backlog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`server.max_connections` = 3 and five clients: three are accepted (two of them drained
    with the first), the fourth only once a connection ended and gave its slot back."""
    slots = trio.Semaphore(3)
    async with listening() as (raw, listener, address):
        draining = connection.DrainingListener(listener, raw, slots)
        clients = [socket.create_connection(address) for _ in range(5)]
        try:
            streams = [await draining.accept() for _ in range(3)]
            assert slots.value == 0
            with trio.move_on_after(60) as waited:
                await draining.accept()
            assert waited.cancelled_caught  # no slot: the fourth waits in the backlog
            await streams.pop().aclose()
            slots.release()  # as a connection gives its slot back when it ends
            with trio.fail_after(1):
                streams.append(await draining.accept())
            assert slots.value == 0
            for stream in streams:
                await stream.aclose()
        finally:
            for client in clients:
                client.close()


async def paused_at(stream: trio.SocketStream, path: str) -> bytes:
    """Request `path` (a /held/ one) and return what reached the client while the app waits
    for HELD_GO (nothing more comes while it waits: the autojump clock moves on only once
    every task is blocked)."""
    HELD_SENT[0], HELD_GO[0] = trio.Event(), trio.Event()
    await request(stream, path)
    await HELD_SENT[0].wait()
    received = b""
    with trio.move_on_after(1.0):
        while True:
            received += await stream.receive_some()
    return received


async def test_a_held_head_goes_out_with_the_body_that_follows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        stream = await served.connect()
        early = await paused_at(stream, "/held/none")
        assert early.startswith(b"HTTP/1.1 200 OK\r\n")  # not held: the head is out at once
        assert early.endswith(b"\r\n\r\n")
        HELD_GO[0].set()
        assert await stream.receive_some() == b"body"

        assert await paused_at(stream, "/held/head") == b""  # held until the body comes
        HELD_GO[0].set()
        head, body = await read_response(stream)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b"body"


async def test_bytes_written_with_the_next_write_go_out_in_front_of_the_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        stream = await served.connect()
        early = await paused_at(stream, "/held/body")
        assert early.endswith(b"\r\n\r\n5\r\nfirst\r\n")  # the held piece is not out yet
        HELD_GO[0].set()
        received = early
        while not received.endswith(b"0\r\n\r\n"):
            received += await stream.receive_some()
        assert received.endswith(b"5\r\nfirst\r\n6\r\nsecond\r\n0\r\n\r\n")


async def test_nothing_stays_held_past_the_end_of_a_response(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serve() as served:
        stream = await served.connect()
        await request(stream, "/held/after")  # asks to hold a write no message makes
        assert (await read_response(stream))[1] == b"done"
        # The next response on the connection is written as usual: its head at once.
        assert (await paused_at(stream, "/held/none")).startswith(b"HTTP/1.1 200 OK\r\n")
        HELD_GO[0].set()
        assert await stream.receive_some() == b"body"


async def test_a_request_leaves_no_reference_cycle_behind() -> None:
    """Its answer writer, stream and scope are freed by reference counting as it ends: none
    is left in a cycle (the writer holds the protocol stream's `send`, the stream holds the
    scope, the scope the writer) for the garbage collector to find."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage
    try:
        with trio.fail_after(LIMIT):
            async with serve() as served:
                client = await served.connect()
                for _ in range(3):
                    await request(client, "/client")
                    assert (await read_response(client))[1] == b"ConnectionAnswer"
                await trio.testing.wait_all_tasks_blocked()  # the last request has ended
                gc.collect()
                left = [o for o in gc.garbage if isinstance(o, connection.ConnectionAnswer)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []


async def test_what_the_lifespan_stores_in_its_state_every_request_sees() -> None:
    """ASGI's lifespan state: what the app stores at startup is in each request's
    `scope["state"]` (a copy per request)."""
    seen: list[Any] = []

    async def stateful(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                scope["state"]["pool"] = "opened at startup"
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        seen.append(dict(scope["state"]))
        scope["state"]["pool"] = "changed by a request"
        headers = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("test_connection.hypercorn")
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                partial(hypercorn_seam.serve, stateful, config, shutdown_trigger=trio.sleep_forever)
            )
            client = await trio.open_tcp_stream("127.0.0.1", int(urls[0].rsplit(":", 1)[1]))
            async with client:
                for _ in range(2):
                    await request(client, "/")
                    assert (await read_response(client))[0].startswith(b"HTTP/1.1 200")
            nursery.cancel_scope.cancel()
    assert seen == [{"pool": "opened at startup"}] * 2


async def test_a_client_gone_before_its_connection_is_served_costs_nothing() -> None:
    """A client that resets its connection before the server gets to it (its address can no
    longer be read): the connection ends quietly, its socket closed and its slot given back;
    nothing reaches the server's other connections."""
    with trio.fail_after(LIMIT):
        ours, peer = socket_pair()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await peer.aclose()
        await trio.sleep(0.05)  # the reset has arrived
        slots = trio.Semaphore(1)
        await slots.acquire()
        recording = RecordingProtocol()
        settings = connection.ConnectionSettings(
            terminated=trio.Event(), keep_alive_s=5, slots=slots
        )
        await connection.ClientConnection(ours, settings, partial(opened, recording)).run()
        assert slots.value == 1 and ours.socket.fileno() == -1
