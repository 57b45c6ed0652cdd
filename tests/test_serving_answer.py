"""The answer writers: `AsgiAnswer` over plain ASGI `send` (any server) and `ConnectionAnswer`
on trio_router's connections (`hypercorn_seam.serve`): what reaches the client, in what
order and with which joins, an engine's body passed on or relayed, a relay that broke off
followed by more body, and the client leaving.

Engines are scripted raw TCP servers on 127.0.0.1 (the bytes of a response, with pauses);
clients are raw sockets or recorded ASGI messages. Real clock, each test bounded."""

from __future__ import annotations

import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final

import hypercorn.config
import hypercorn.trio
import trio

from trio_router.asgi import Message, Receive, Scope, Send, answer_lifespan
from trio_router.http import EngineBrokeOffError, UpstreamPool, open_relay
from trio_router.serving import hypercorn_seam
from trio_router.serving.answer import Answer, AsgiAnswer, Rewrite, answer_of, open_asgi_answer
from trio_router.serving.connection import ConnectionAnswer

LIMIT: Final = 10.0
SSE_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
USAGE: Final = b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# A scripted engine's answer: bytes to send, seconds to pause, or None (reset the connection).
Script = Sequence[bytes | float | None]


@asynccontextmanager
async def scripted_engine(script: Script) -> AsyncIterator[str]:
    """An engine that reads one request head and answers with `script`; its base URL."""

    async def answer(stream: trio.SocketStream) -> None:
        received = b""
        while b"\r\n\r\n" not in received:
            received += await stream.receive_some()
        for step in script:
            if step is None:
                linger = struct.pack("ii", 1, 0)  # a reset, not an orderly close
                stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, linger)
                await stream.aclose()
                return
            if isinstance(step, float):
                await trio.sleep(step)
            else:
                await stream.send_all(step)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, answer, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def engine_response(pool: UpstreamPool, script: Script) -> AsyncIterator[Any]:
    async with (
        scripted_engine(script) as url,
        pool.request(url, b"POST", b"/v1/chat/completions", [], b"{}") as response,
    ):
        yield response


class Recorder:
    """A plain ASGI `send` that records the messages."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    def kinds(self) -> list[tuple[str, bytes, bool]]:
        return [
            (m["type"].rsplit(".", 1)[-1], m.get("body", b""), m.get("more_body", False))
            for m in self.messages
        ]


# -- over plain ASGI ----------------------------------------------------------------------------
async def test_the_head_goes_out_with_what_follows_it() -> None:
    sent = Recorder()
    answer = AsgiAnswer(sent)
    answer.start(200, [(b"content-length", b"4")])
    assert sent.messages == []  # nothing yet: the head waits for the next call
    await answer.end(b"done")
    assert sent.kinds() == [("start", b"", False), ("body", b"done", False)]
    assert sent.messages[0]["status"] == 200 and answer.sent == 4


async def test_an_engine_body_passes_chunk_by_chunk_its_last_with_the_end() -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", USAGE]
    script: list[bytes | float | None] = [SSE_HEAD, chunk(events[0]), 0.05, chunk(events[1]), 0.05]
    script.append(chunk(events[2]) + b"0\r\n\r\n")  # the last event with the end
    sent = Recorder()
    firsts: list[float] = []
    async with UpstreamPool(connect_timeout=LIMIT, read_timeout=LIMIT) as pool:
        with trio.fail_after(LIMIT):
            async with engine_response(pool, script) as response:
                answer = AsgiAnswer(sent)
                answer.start(200, [])
                tail = await answer.relay(response, on_first=firsts.append)
                # The body is over, the answer not: its last piece waits for the end.
                assert sent.kinds()[-1] == ("body", events[1], True)
                await answer.end()
    assert sent.kinds() == [
        ("start", b"", False),
        ("body", events[0], True),
        ("body", events[1], True),
        ("body", events[2], False),
    ]
    assert len(firsts) == 1 and answer.sent == sum(map(len, events))
    assert tail.endswith(USAGE)


async def test_a_rewritten_body_goes_out_rewritten() -> None:
    script: list[bytes | float | None] = [
        SSE_HEAD,
        chunk(b'{"model":"a"}'),
        0.02,
        chunk(b'{"model":"a"}'),
        b"0\r\n\r\n",
    ]
    sent = Recorder()
    async with UpstreamPool(connect_timeout=LIMIT, read_timeout=LIMIT) as pool:
        with trio.fail_after(LIMIT):
            async with engine_response(pool, script) as response:
                answer = AsgiAnswer(sent)
                answer.start(200, [])

                def rewrite(piece: bytes, final: bool) -> bytes:
                    return piece.replace(b'"a"', b'"alias"')

                await answer.relay(response, rewrite=Rewrite(rewrite))
                await answer.end()
    assert b"".join(body for _, body, _ in sent.kinds()) == b'{"model":"alias"}' * 2


async def test_the_client_leaving_cancels_an_armed_scope_until_the_end() -> None:
    """Over plain Hypercorn (which builds no writer): the watcher sees the client leave once
    the body is in, and cancels the armed scope; an answer that ended is not cancelled by the
    disconnect every exchange ends with."""
    outcomes: list[bool] = []
    done = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        assert answer_of(scope) is None
        async with open_asgi_answer(receive, send) as (answer, receive_body):
            while (await receive_body()).get("more_body"):
                pass
            with trio.CancelScope() as cancel:
                answer.arm(cancel)
                answer.start(200, [])
                await answer.body(b"first")
                if scope["path"] == "/end":
                    await answer.end(b"last")
                    await trio.sleep(0.2)  # the disconnect that follows every end comes
                else:
                    await trio.sleep_forever()
            outcomes.append(cancel.cancelled_caught)
            done.set()

    async with plain_hypercorn(app) as port:
        with trio.fail_after(LIMIT):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"POST /hold HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert b"first" in await read_until(client, b"first")
            await client.aclose()
            await done.wait()
            done = trio.Event()
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"POST /end HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert (await read_until(client, b"0\r\n\r\n")).endswith(b"4\r\nlast\r\n0\r\n\r\n")
            await done.wait()
            await client.aclose()
    assert outcomes == [True, False]


@asynccontextmanager
async def plain_hypercorn(
    app: Callable[[Scope, Receive, Send], Awaitable[None]],
) -> AsyncIterator[int]:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("test_answer.hypercorn")
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(hypercorn.trio.serve, app, config))  # type: ignore[arg-type]
        yield int(urls[0].rsplit(":", 1)[1])
        nursery.cancel_scope.cancel()


async def read_until(stream: trio.SocketStream, end: bytes) -> bytes:
    received = b""
    while end not in received:
        data = await stream.receive_some()
        assert data, f"closed before {end!r}: {received!r}"
        received += data
    return received


# -- on trio_router's connections ---------------------------------------------------------------
AppStep = Callable[[Answer, UpstreamPool], Awaitable[None]]


@asynccontextmanager
async def served(step: AppStep) -> AsyncIterator[int]:
    """`hypercorn_seam.serve` with a relay, whose app runs `step` with the request's writer;
    the port."""
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("test_answer.hypercorn")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        answer = answer_of(scope)
        assert isinstance(answer, ConnectionAnswer)
        await step(answer, pool)

    async with (
        UpstreamPool(connect_timeout=LIMIT, read_timeout=LIMIT) as pool,
        open_relay() as relay,
        trio.open_nursery() as nursery,
    ):
        urls = await nursery.start(
            partial(
                hypercorn_seam.serve,
                app,
                config,
                shutdown_trigger=trio.sleep_forever,
                options=hypercorn_seam.ServeOptions(relay=relay),
            )
        )
        yield int(urls[0].rsplit(":", 1)[1])
        nursery.cancel_scope.cancel()


async def ask(port: int) -> trio.SocketStream:
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    return client


async def test_a_relayed_body_can_be_followed_by_more_from_elsewhere() -> None:
    """The engine breaks off after two events: the relay raises, the answer stays open, and
    more body (as from a second engine) and the end follow with no seam in the framing."""
    script: list[bytes | float | None] = [
        SSE_HEAD,
        0.05,
        chunk(b"data: 1\n\n"),
        0.05,
        chunk(b"data: 2\n\n"),
        0.05,
        None,
    ]
    errors: list[Exception] = []

    async def step(answer: Answer, pool: UpstreamPool) -> None:
        answer.start(200, [(b"content-type", b"text/event-stream")])
        async with engine_response(pool, script) as response:
            try:
                await answer.relay(response)
            except EngineBrokeOffError as exc:
                errors.append(exc)
        await answer.body(b"data: 3\n\n")
        await answer.end(b"data: [DONE]\n\n")

    async with served(step) as port:
        with trio.fail_after(LIMIT):
            client = await ask(port)
            received = await read_until(client, b"0\r\n\r\n")
            await client.aclose()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head.lower()
    assert (
        body
        == b"".join(
            chunk(e) for e in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", b"data: [DONE]\n\n")
        )
        + b"0\r\n\r\n"
    )
    assert len(errors) == 1


async def test_a_relayed_body_s_last_read_goes_out_with_the_end() -> None:
    """The read that ended the engine's body is held by the writer: it reaches the client with
    the end of the answer, not before."""
    relayed = trio.Event()
    go = trio.Event()
    script: list[bytes | float | None] = [
        SSE_HEAD,
        0.05,
        chunk(b"data: 1\n\n"),
        0.05,
        chunk(USAGE) + b"0\r\n\r\n",
    ]
    tails: list[bytes] = []

    async def step(answer: Answer, pool: UpstreamPool) -> None:
        answer.start(200, [])
        async with engine_response(pool, script) as response:
            tails.append(await answer.relay(response))
        relayed.set()
        await go.wait()
        await answer.end()

    async with served(step) as port:
        with trio.fail_after(LIMIT):
            client = await ask(port)
            early = await read_until(client, b"data: 1\n\n\r\n")
            await relayed.wait()
            with trio.move_on_after(0.2):
                early += await client.receive_some()
            assert USAGE not in early  # held for the end
            go.set()
            received = early + await read_until(client, b"0\r\n\r\n")
            await client.aclose()
    assert received.endswith(chunk(USAGE) + b"0\r\n\r\n")
    assert USAGE in tails[0]  # framed as the engine sent it


async def test_a_head_with_the_body_already_there_goes_out_with_it() -> None:
    """An engine whose head came with its first event: the client gets them together, then
    the rest relayed; the engine's body counted once."""
    script: list[bytes | float | None] = [
        SSE_HEAD + chunk(b"data: 1\n\n"),
        0.05,
        chunk(b"data: 2\n\n"),
        b"0\r\n\r\n",
    ]
    sent: list[int] = []

    async def step(answer: Answer, pool: UpstreamPool) -> None:
        answer.start(200, [])
        async with engine_response(pool, script) as response:
            await answer.relay(response)
        await answer.end()
        sent.append(answer.sent)

    async with served(step) as port:
        with trio.fail_after(LIMIT):
            client = await ask(port)
            first = await client.receive_some()
            rest = (
                await read_until(client, b"0\r\n\r\n") if not first.endswith(b"0\r\n\r\n") else b""
            )
            await client.aclose()
    assert first.startswith(b"HTTP/1.1 200 OK") and first.endswith(chunk(b"data: 1\n\n"))
    assert (first + rest).endswith(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
    # The first event passed as body bytes, the rest relayed as the engine framed it.
    assert sent == [len(b"data: 1\n\n") + len(chunk(b"data: 2\n\n"))]


async def test_sent_counts_every_body_byte_once() -> None:
    """Body bytes given to `body` and `end` are counted as they are handed on."""
    sent = Recorder()
    answer = AsgiAnswer(sent)
    answer.start(200, [])
    await answer.body(b"abc")
    await answer.body(b"")
    await answer.end(b"de")
    assert answer.sent == 5
    assert [body for _, body, _ in sent.kinds()] == [b"", b"abc", b"de"]
