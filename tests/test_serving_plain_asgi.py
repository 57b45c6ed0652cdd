"""The fallback path end to end: the router's app (`server.open_router`) served by Hypercorn's
own `hypercorn.trio.serve`, which builds no answer writer, so the app answers through plain
ASGI (`answer.open_asgi_answer`), as it would on a Hypercorn that trio_router's connections
do not fit, or on any other ASGI server. A fake engine over real HTTP on 127.0.1.1, raw TCP
clients on 127.0.0.1; real clock, each test bounded."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final

import hypercorn.config
import hypercorn.trio
import trio

from trio_router import server
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.harness import (
    CHAT,
    chat,
    open_raw,
    receive_until,
    router_config,
    send_request,
)

LIMIT: Final = 10.0


@asynccontextmanager
async def plain_router(engine: FakeEngine) -> AsyncIterator[tuple[str, str]]:
    """`engine` on 127.0.1.1 and the router's app on Hypercorn's own serve; the router's URL
    (once the engine is routable) and the engine's."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_fake_engine, engine, "127.0.1.1", 0)
        table = RoutingTable()
        async with server.open_router(router_config([url]), table=table) as router:
            while not table.routable("fake-model"):
                await table.wait_changed()
            config = hypercorn.config.Config()
            config.bind = ["127.0.0.1:0"]
            config.accesslog = None
            config.errorlog = logging.getLogger("test_plain_asgi.hypercorn")
            app: Any = router.app  # plain-dict ASGI, not Hypercorn's TypedDicts
            binds = await nursery.start(partial(hypercorn.trio.serve, app, config))
            yield binds[0], url
            nursery.cancel_scope.cancel()


async def open_stream(url: str) -> trio.SocketStream:
    stream = await open_raw(url)
    await send_request(stream, CHAT, chat(stream=True, max_tokens=2000))
    return stream


async def test_a_stream_passes_whole_over_plain_asgi() -> None:
    """The same events as straight from the engine, ended once."""
    engine = FakeEngine(tokens=6, inter_token_s=0.01)
    answers = []
    with trio.fail_after(LIMIT):
        async with plain_router(engine) as urls:
            for url in urls:  # through the router, then straight to the engine
                stream = await open_stream(url)
                answers.append(await receive_until(stream, b"0\r\n\r\n"))
                await stream.aclose()
    (routed_head, routed), (_, direct) = (a.partition(b"\r\n\r\n")[::2] for a in answers)
    assert routed_head.startswith(b"HTTP/1.1 200")
    assert b"x-trio-router-engine: " in routed_head.lower()
    assert [_kind(e) for e in _events(routed)] == [_kind(e) for e in _events(direct)]
    assert _events(routed)[-1] == b"[DONE]" and routed.count(b"[DONE]") == 1
    assert len(_events(routed)) >= 6 + 2  # the role, six tokens, the end
    assert engine.completed == 2 and engine.disconnects == 0


def _events(chunked: bytes) -> list[bytes]:
    """The SSE events' data of a chunked body (its framing dropped)."""
    body, rest = b"", chunked
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]


def _kind(event: bytes) -> object:
    """What an event says, without its id and time."""
    if event == b"[DONE]":
        return event
    decoded = json.loads(event)
    return [(c.get("delta"), c.get("finish_reason")) for c in decoded["choices"]]


async def test_a_client_leaving_mid_stream_aborts_the_engine_over_plain_asgi() -> None:
    """The app's watcher sees the server's `http.disconnect` and cancels the exchange, which
    closes the engine's connection: the engine sees its client go before its answer ended
    (vLLM then aborts the generation), long before the stream would have finished."""
    engine = FakeEngine(tokens=1000, inter_token_s=0.05)
    with trio.fail_after(LIMIT):
        async with plain_router(engine) as (url, _):
            stream = await open_stream(url)
            await receive_until(stream, b"data: {")
            left = trio.current_time()
            await stream.aclose()
            await engine.wait_until(lambda: engine.disconnects == 1)
            assert trio.current_time() - left < 5.0  # the stream had 50 s to go
    assert engine.completed == 0
