"""The emulated engines' HTTP/1.1 server (`emulator.http_server`) over real sockets, with a
small ASGI app: keep-alive and the idle timeout, `100 Continue`, chunked request bodies, a
stream its client leaves (the app learns it), an app that fails (500, the connection closed,
the server still serving), and a client that does not speak HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final

import h11
import trio

from trio_router.emulator.http_server import DIRECT_WRITE, serve_asgi

LIMIT: Final = 10.0
FLOOD: Final = 200  # chunks of 64 KiB: more than the socket buffers take


def chunk(i: int) -> bytes:
    return b"%08d" % i * 8192


class App:
    """/echo answers the body back; /stream sends one chunk, then waits for the client to
    leave; /fail raises."""

    def __init__(self) -> None:
        self.left = trio.Event()
        self.direct = 0  # chunks written with write_now

    async def flood(self, direct: Any, send: Any) -> None:
        """Chunks 0..FLOOD-1 written at once while the connection takes them (the client is
        not reading yet, so it soon cannot), the rest sent; then the end."""
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": chunk(0), "more_body": True})
        n = 1
        while n < FLOOD and direct.ready_now():
            direct.write_now(chunk(n))
            n += 1
        self.direct = n - 1
        for i in range(n, FLOOD):
            await send({"type": "http.response.body", "body": chunk(i), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        if scope["path"] == "/fail":
            raise RuntimeError("the app failed")
        if scope["path"] == "/flood":
            await self.flood(scope["extensions"][DIRECT_WRITE], send)
            return
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            assert (await receive())["type"] == "http.disconnect"
            self.left.set()
            return
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


@asynccontextmanager
async def serving(keep_alive_s: float = 5.0) -> AsyncIterator[tuple[App, int]]:
    app = App()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            serve = partial(serve_asgi, app, "127.0.0.1", 0, keep_alive_s=keep_alive_s)
            url = await nursery.start(serve)
            yield app, int(url.rsplit(":", 1)[1])
            nursery.cancel_scope.cancel()


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = await stream.receive_some()
        assert chunk, f"closed before {marker!r}: {data!r}"
        data += chunk
    return data


async def read_to_end(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some():
        data += chunk
    return data


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"host: x", b"content-length: %d" % len(body)]
    return b"\r\n".join([*head, *extra]) + b"\r\n\r\n" + body


async def test_keep_alive_then_the_idle_connection_is_closed() -> None:
    async with serving(keep_alive_s=0.2) as (_, port), await connect(port) as stream:
        await stream.send_all(post("/echo", b"one"))
        assert (await read_until(stream, b"one")).startswith(b"HTTP/1.1 200")
        await stream.send_all(post("/echo", b"two"))  # the same connection
        assert (await read_until(stream, b"two")).startswith(b"HTTP/1.1 200")
        assert await read_to_end(stream) == b""  # idle past keep_alive_s: closed


async def test_100_continue_and_a_chunked_body() -> None:
    async with serving() as (_, port), await connect(port) as stream:
        head = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
        await stream.send_all(head + b"expect: 100-continue\r\n\r\n")
        assert (await read_until(stream, b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
        await stream.send_all(b"hello")
        assert (await read_until(stream, b"hello")).startswith(b"HTTP/1.1 200")
        chunked = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        await stream.send_all(chunked + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert (await read_until(stream, b"abcde")).startswith(b"HTTP/1.1 200")


async def test_a_client_leaving_a_stream_is_seen_by_the_app() -> None:
    async with serving() as (app, port), await connect(port) as stream:
        await stream.send_all(post("/stream", b""))
        answer = await read_until(stream, b"first")
        assert b"transfer-encoding: chunked" in answer.lower()
        await stream.aclose()
        await app.left.wait()


async def test_a_failing_app_and_a_bad_client_end_only_their_connection() -> None:
    async with serving() as (_, port):
        async with await connect(port) as failing:
            await failing.send_all(post("/fail", b""))
            assert (await read_to_end(failing)).startswith(b"HTTP/1.1 500")
        async with await connect(port) as garbage:
            await garbage.send_all(b"\x16\x03\x01 not http at all\r\n\r\n")
            assert b"HTTP/1.1 200" not in await read_to_end(garbage)
        async with await connect(port) as fine:
            await fine.send_all(post("/echo", b"still here"))
            assert (await read_until(fine, b"still here")).startswith(b"HTTP/1.1 200")


async def test_chunks_written_at_once_keep_their_order_when_the_socket_is_full() -> None:
    """Written straight to the socket until it takes no more (the rest kept and written
    before the next `send`), then sent: the client reads every chunk, in order, as one
    well-formed chunked body."""
    async with serving() as (app, port), await connect(port) as stream:
        await stream.send_all(post("/flood", b""))
        connection = h11.Connection(h11.CLIENT)
        connection.send(h11.Request(method="POST", target="/flood", headers=[("host", "x")]))
        connection.send(h11.EndOfMessage())
        body = bytearray()
        while not isinstance(event := connection.next_event(), h11.EndOfMessage):
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some())
            elif isinstance(event, h11.Data):
                body += event.data
    assert bytes(body) == b"".join(chunk(i) for i in range(FLOOD))
    assert 0 < app.direct < FLOOD - 1  # some written at once, then the socket was full
