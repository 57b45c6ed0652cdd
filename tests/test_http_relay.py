"""The relay of chunked token streams: the codec's framing on any chunking and read split, the
`Relay` on virtual time (socket pairs), and the router end to end (real Hypercorn, an engine
writing scripted bytes, raw HTTP/1.1, HTTP/1.0 and HTTP/2 clients)."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import h11
import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_router import server
from trio_router.http import (
    ClientGoneError,
    EngineLeavingError,
    EngineStalledError,
    EngineTimeoutError,
    Stall,
    UpstreamPool,
    open_relay,
)
from trio_router.http.codec import ResponseParser
from trio_router.http.relay import CHECK_S, PAUSE_S
from trio_router.table import RoutingTable
from trio_router.testing.fake_network import FakeNetwork, FakeReply, FakeRequest
from trio_router.testing.harness import router_config, sample

LIMIT: Final = 10.0
HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunked(chunks: Sequence[bytes], *, spelling: str = "h11", trailers: bool = False) -> bytes:
    """A chunked body carrying `chunks`: sizes as h11 writes them, or in another valid
    spelling (uppercase, leading zeros, extensions), and optional trailers."""
    out = []
    for i, data in enumerate(chunks):
        size = b"%x" % len(data)
        if spelling == "upper":
            size = size.upper()
        elif spelling == "zeros":
            size = b"00" + size
        elif spelling == "ext":
            size += b";n=%d" % i
        out.append(size + b"\r\n" + data + b"\r\n")
    out.append(b"0\r\nx-trailer: 1\r\n\r\n" if trailers else b"0\r\n\r\n")
    return b"".join(out)


def decode_chunked(wire: bytes) -> bytes:
    """The body of a chunked message, decoded by h11 (the oracle); fails if it is not one
    complete, well-formed chunked body."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + wire)
    body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body
        assert event is not h11.NEED_DATA, "incomplete chunked body"


# -- the codec ----------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=200), max_size=10),
    st.sampled_from(["h11", "upper", "zeros", "ext"]),
    st.booleans(),
    st.lists(st.integers(1, 64), min_size=1, max_size=12),
)
def test_framed_relay_carries_exactly_the_body_at_any_split(
    chunks: list[bytes], spelling: str, trailers: bool, splits: list[int]
) -> None:
    """Whatever the engine's chunking and however its bytes are split into reads, what the
    relay writes plus the server's last chunk is a well-formed chunked body with exactly the
    engine's data, and the same data the general path (de-chunk, re-frame) delivers. Chunks in
    h11's form that arrive whole are passed byte for byte."""
    wire = chunked(chunks, spelling=spelling, trailers=trailers)
    relayed, general = ResponseParser(), ResponseParser()
    for parser in (relayed, general):
        parser.feed(HEAD)
        assert parser.read_head() and parser.chunked
    out, data, pos, turn = [], [], 0, 0
    while pos < len(wire):
        piece = wire[pos : pos + splits[turn % len(splits)]]
        pos, turn = pos + len(piece), turn + 1
        relayed.feed(piece)
        out.append(relayed.read_body_framed())
        general.feed(piece)
        data.append(general.read_body())
    assert relayed.done and general.done and relayed.reusable
    assert decode_chunked(b"".join(out) + b"0\r\n\r\n") == b"".join(data) == b"".join(chunks)


def test_chunks_in_h11_form_pass_as_they_came() -> None:
    """Chunks that arrive whole in h11's spelling are the engine's own bytes, not re-framed;
    a chunk cut by the end of a read, or in another spelling, is framed anew."""
    events = [b"data: %d\n\n" % i for i in range(3)]
    wire = chunked(events)
    parser = ResponseParser()
    parser.feed(HEAD + wire[:-5])
    assert parser.read_head()
    assert parser.read_body_framed() == wire[:-5]  # the very same bytes
    parser.feed(b"0\r\n\r\n")
    assert parser.read_body_framed() == b"" and parser.done

    parser = ResponseParser()
    parser.feed(HEAD + b"A\r\n0123")
    assert parser.read_head()
    assert parser.read_body_framed() == b"4\r\n0123\r\n"  # cut: what came, as a chunk
    parser.feed(b"456789\r\n")
    assert parser.read_body_framed() == b"6\r\n456789\r\n"


def test_a_read_of_one_whole_chunk_passes_as_the_very_object_read() -> None:
    """The relay's usual read, one event as one chunk in h11's form at a chunk boundary, comes
    back as the very bytes object read (nothing copied); a chunk in another spelling, or one
    cut by a read, is framed anew."""
    parser = ResponseParser()
    parser.feed(HEAD)
    assert parser.read_head()
    payload = b'data: {"choices": [1, 2]}\n\n'
    event = b"%x\r\n%s\r\n" % (len(payload), payload)
    assert event.startswith(b"1b\r\n")  # a hex letter: its case matters
    parser.feed(event)
    assert parser.read_body_framed() is event
    parser.feed(b"1B\r\n" + event[4:])
    assert parser.read_body_framed() == event  # uppercase: framed anew
    parser.feed(event[:9])
    assert parser.read_body_framed() == b"5\r\ndata:\r\n"  # cut: what came, as a chunk
    parser.feed(event[9:])
    assert parser.read_body_framed() == b"%x\r\n%s\r\n" % (len(payload) - 5, payload[5:])
    parser.feed(b"0\r\n\r\n")
    assert parser.read_body_framed() == b"" and parser.done and parser.reusable


def test_framed_relay_rejects_broken_framing() -> None:
    parser = ResponseParser()
    parser.feed(HEAD + b"5\r\nabcdeXY")
    assert parser.read_head()
    with pytest.raises(Exception, match="CRLF"):
        parser.read_body_framed()


# -- the Relay on virtual time ------------------------------------------------------------------
class EngineScript:
    """A fake engine answering every POST with a chunked stream: `chunks` (one per write,
    the first `first_after` seconds after the head, then `gap` seconds apart, or `gaps[i]`
    after chunk i), then the last chunk unless `hang`."""

    def __init__(
        self,
        chunks: Sequence[bytes],
        *,
        gap: float = 0.0,
        hang: bool = False,
        gaps: Sequence[float] = (),
        first_after: float = 0.0,
    ) -> None:
        self.chunks, self.gap, self.hang, self.gaps = list(chunks), gap, hang, list(gaps)
        self.first_after = first_after
        self.sent = 0  # chunks the engine has written

    async def __call__(self, request: FakeRequest) -> FakeReply:
        return FakeReply(200, self._body(), [("content-type", "text/event-stream")])

    async def _body(self) -> AsyncIterator[bytes]:
        await trio.sleep(self.first_after)
        for i, chunk in enumerate(self.chunks):
            yield chunk
            self.sent += 1
            await trio.sleep(self.gaps[i] if i < len(self.gaps) else self.gap)
        if self.hang:
            await trio.sleep_forever()


@dataclass
class Client:
    """The client's end of a socket pair, as the relay sees a client socket."""

    ours: socket.socket
    theirs: socket.socket
    received: bytearray = field(default_factory=bytearray)

    @classmethod
    def make(cls) -> Client:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        return cls(ours, theirs)

    def fileno(self) -> int:
        return self.ours.fileno()

    def receive(self) -> None:
        """Read what the relay has written so far into `received`."""
        while True:
            try:
                data = self.theirs.recv(1 << 20)
            except BlockingIOError:
                return
            self.received += data

    def drain(self) -> bytes:
        """Everything received until now."""
        self.receive()
        return bytes(self.received)

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


@asynccontextmanager
async def relayed_exchange(
    script: EngineScript, *, read_timeout: float = 600.0, stall: Stall | None = None
) -> AsyncIterator[tuple[Any, Any, FakeNetwork]]:
    network = FakeNetwork(script)
    async with network.open(), open_relay() as relay:
        pool = UpstreamPool(connect_timeout=5.0, read_timeout=read_timeout, connect=network.connect)
        async with pool.request(
            "http://10.0.0.1:8000", b"POST", b"/v1/completions", [], b"{}"
        ) as response:
            assert response.relayable
            response.stall = stall
            yield relay, response, network
        pool.close()


async def test_relay_moves_a_stream_and_ends_it(autojump_clock: trio.testing.MockClock) -> None:
    events = [b"data: %d\n\n" % i for i in range(20)]
    client = Client.make()
    async with relayed_exchange(EngineScript(events, gap=0.005)) as (relay, response, _):
        last, sent, _ = await relay.relay(response, client)
        assert last.endswith(b"data: 19\n\n\r\n")  # the last event, as it was written
        assert sent == len(client.drain())
        assert response.complete and len(relay) == 0 and relay.relayed == 1
    assert decode_chunked(client.drain() + b"0\r\n\r\n") == b"".join(events)
    client.close()


async def test_with_hold_last_an_end_that_comes_alone_leaves_nothing_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine's end comes in a read of its own (after a gap): every event is written, and
    nothing is held for the caller (the bytes of the read that ends a body are held only
    when it carries some: see the end-to-end tests at every read split)."""
    events = [b"data: %d\n\n" % i for i in range(5)]
    client = Client.make()
    async with relayed_exchange(EngineScript(events, gap=0.005)) as (relay, response, _):
        _, sent, held = await relay.relay(response, client, hold_last=True)
        assert held == b"" and sent == len(client.drain())
    assert decode_chunked(client.drain() + b"0\r\n\r\n") == b"".join(events)
    client.close()


async def test_a_busy_relay_serves_many_events_per_pass_and_delays_none_by_more_than_the_pause(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Eight streams whose events come 0.2 ms apart: after a pass that found four sockets or
    more ready, the relay pauses PAUSE_S, so that a pass serves many events; no stream ends
    later than its engine's last event plus that pause."""
    events = [b"data: %d\n\n" % i for i in range(50)]
    gap = 0.0002
    network = FakeNetwork(EngineScript(events, gap=gap))
    clients = [Client.make() for _ in range(8)]
    ends: list[float] = []
    async with network.open(), open_relay() as relay:
        pool = UpstreamPool(connect_timeout=5.0, read_timeout=60.0, connect=network.connect)
        ready = trio.Event()
        waiting = 0

        async def one(client: Client) -> None:
            nonlocal waiting
            async with pool.request(
                "http://10.0.0.1:8000", b"POST", b"/v1/completions", [], b"{}"
            ) as response:
                waiting += 1
                if waiting == len(clients):
                    ready.set()
                await ready.wait()  # every stream handed over together
                started = trio.current_time()
                await relay.relay(response, client)
                ends.append(trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(one, client)
        pool.close()
    assert relay.passes <= 20  # not one pass per 0.2 ms but about one per PAUSE_S
    assert max(ends) <= len(events) * gap + PAUSE_S + 1e-6
    for client in clients:
        assert decode_chunked(client.drain() + b"0\r\n\r\n") == b"".join(events)
        client.close()


async def test_relay_ends_a_silent_engine_at_the_read_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client = Client.make()
    async with relayed_exchange(EngineScript([b"data: 1\n\n"], hang=True), read_timeout=5.0) as (
        relay,
        response,
        _,
    ):
        start = trio.current_time()
        with pytest.raises(EngineTimeoutError, match="silent for 5 s"):
            await relay.relay(response, client)
        assert 5.0 <= trio.current_time() - start <= 5.0 + CHECK_S + 0.01
        assert len(relay) == 0
    assert decode_chunked(client.drain() + b"0\r\n\r\n") == b"data: 1\n\n"
    client.close()


async def test_a_relayed_stream_whose_client_left_leaves_the_relay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client = Client.make()
    async with (
        relayed_exchange(EngineScript([b"data: 1\n\n"], hang=True)) as (relay, response, network),
        trio.open_nursery() as nursery,
    ):
        request = trio.CancelScope()

        async def leave() -> None:
            await trio.sleep(10)
            request.cancel()  # as the server's disconnect hook does

        nursery.start_soon(leave)
        with request:
            await relay.relay(response, client)
        assert request.cancelled_caught and trio.current_time() == 10.0
        assert len(relay) == 0  # out of the relay at once
    # Leaving the exchange closed the engine's connection: the engine saw it.
    with trio.fail_after(1):
        await network.wait_for(lambda: network.open_now["10.0.0.1"] == 0)
    client.close()


async def test_relay_holds_back_the_engine_for_a_client_that_does_not_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that stops reading: the relay stops reading the engine (at most one read is
    held, the rest stays with the engine), and carries on where it was once the client reads
    again."""
    events = [bytes([65 + i % 26]) * 16384 for i in range(2000)]  # 32 MiB in all
    script = EngineScript(events)
    client = Client.make()
    async with relayed_exchange(script) as (relay, response, _), trio.open_nursery() as nursery:
        done = trio.Event()

        async def run() -> None:
            await relay.relay(response, client)
            done.set()

        nursery.start_soon(run)
        await trio.sleep(60)
        assert not done.is_set()
        (stream,) = relay._streams
        assert 0 < len(stream._pending) <= 65536 + 16  # one read, framed
        assert script.sent < len(events) // 2  # the engine's writes are blocked

        async def read() -> None:
            while True:
                await trio.lowlevel.wait_readable(client.theirs)
                client.receive()

        nursery.start_soon(read)
        await done.wait()
        nursery.cancel_scope.cancel()
    assert decode_chunked(client.drain() + b"0\r\n\r\n") == b"".join(events)
    client.close()


async def test_relay_stops_when_the_client_resets(autojump_clock: trio.testing.MockClock) -> None:
    client = Client.make()
    async with (
        relayed_exchange(EngineScript([b"x" * 100] * 3, gap=1.0, hang=True)) as (
            relay,
            response,
            _,
        ),
        trio.open_nursery() as nursery,
    ):

        async def reset_client() -> None:
            await trio.sleep(1.5)
            client.theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.theirs.close()

        nursery.start_soon(reset_client)
        with pytest.raises(ClientGoneError):
            await relay.relay(response, client)
    client.ours.close()


# -- stalls at the stream's own pace, and streams broken off -----------------------------------
STALL: Final = Stall(ceiling_s=30.0, floor_s=2.0, factor=4.0)


async def read_stream(how: str, response: Any, relay: Any, client: Client) -> None:
    """The rest of `response`'s body, through the relay or by iterating it (the pool's own
    path)."""
    if how == "relay":
        await relay.relay(response, client)
    else:
        async for _ in response:
            pass


@pytest.mark.parametrize("how", ["relay", "iterate"])
async def test_a_silent_engine_is_left_at_the_stream_pace_not_the_stall_timeout(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """A stream whose events came 0.1 s apart, its engine silent from then on: stalled at
    the floor (2 s), not at the ceiling (30 s, the fixed bound of old). Its first event came
    after 5 s: the time to first token is not judged by the stall bound."""
    events = [b"data: %d\n\n" % i for i in range(10)]
    client = Client.make()
    script = EngineScript(events, gap=0.1, hang=True, first_after=5.0)
    async with relayed_exchange(script, stall=STALL) as (relay, response, _):
        start = trio.current_time()
        with pytest.raises(EngineStalledError, match=r"silent for 2 s .* largest gap so far"):
            await read_stream(how, response, relay, client)
        silent_since = start + 5.0 + 0.1 * 9
        assert 2.0 - 1e-6 <= trio.current_time() - silent_since <= 2.0 + CHECK_S + 0.01
        assert response.received_at == pytest.approx(silent_since)
    client.close()


@pytest.mark.parametrize("how", ["relay", "iterate"])
async def test_a_stream_that_paused_long_before_may_pause_as_long_again(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """Gaps of 0.1 s, one of 1.5 s (under the floor), then one of 5 s (past the floor, under
    4 x 1.5 s): the stream goes on. Silent after that, it is left at 4 x 5 s = 20 s."""
    events = [b"data: %d\n\n" % i for i in range(12)]
    gaps = [0.1, 0.1, 0.1, 1.5, 0.1, 0.1, 5.0, 0.1, 0.1, 0.1, 0.1]
    client = Client.make()
    script = EngineScript(events, gaps=gaps, hang=True)
    async with relayed_exchange(script, stall=STALL) as (relay, response, _):
        start = trio.current_time()
        with pytest.raises(EngineStalledError, match="silent for 20 s"):
            await read_stream(how, response, relay, client)
        assert script.sent == len(events)  # every event was read before the stall
        silent_since = start + sum(gaps)
        assert 20.0 - 1e-6 <= trio.current_time() - silent_since <= 20.0 + CHECK_S + 0.01
    client.close()


@pytest.mark.parametrize("how", ["relay", "iterate"])
async def test_a_stream_broken_off_ends_at_once_with_the_error_given(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """The engine is going away: `break_off` ends the stream's reading at once (its engine
    still streaming, or silent), with the error given, the client's bytes at a clean point."""
    events = [b"data: %d\n\n" % i for i in range(1000)]
    client = Client.make()
    script = EngineScript(events, gap=0.1)
    async with (
        relayed_exchange(script, stall=STALL) as (relay, response, _),
        trio.open_nursery() as nursery,
    ):
        error = EngineLeavingError("engine 10.0.0.1 is going away")

        async def leave() -> None:
            await trio.sleep(1.05)
            response.break_off(error)
            response.break_off(EngineLeavingError("again"))  # the first error holds

        nursery.start_soon(leave)
        with pytest.raises(EngineLeavingError) as caught:
            await read_stream(how, response, relay, client)
        assert caught.value is error and trio.current_time() == pytest.approx(1.05)
        assert len(relay) == 0
    assert script.sent < 20
    if how == "relay":
        body = decode_chunked(client.drain() + b"0\r\n\r\n")
        assert body == b"".join(events[: body.count(b"\n\n")])
    client.close()


async def test_a_stream_broken_off_while_its_client_is_slow_ends_once_the_write_is_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The client's socket has not taken a write when the stream is broken off: the error
    comes once it has, so the client's bytes end at a clean point (whole chunks), and
    nothing more is read from the engine meanwhile."""
    events = [bytes([65 + i % 26]) * 16384 for i in range(2000)]
    script = EngineScript(events)
    client = Client.make()
    async with relayed_exchange(script) as (relay, response, _), trio.open_nursery() as nursery:
        failed: list[BaseException] = []

        async def run() -> None:
            try:
                await relay.relay(response, client)
            except EngineLeavingError as exc:
                failed.append(exc)

        nursery.start_soon(run)
        await trio.sleep(10)
        (stream,) = relay._streams
        assert stream._pending  # a write waits for the client
        sent = script.sent
        response.break_off(EngineLeavingError("going away"))
        await trio.sleep(10)
        assert failed == [] and script.sent == sent  # the write still waits; the engine too
        while not failed:
            # Bounded (virtual time): the stream may end in the step that wakes this loop,
            # after the last bytes are read here and before `run` notes its error.
            with trio.move_on_after(1):
                await trio.lowlevel.wait_readable(client.theirs)
                client.receive()
    body = decode_chunked(client.drain() + b"0\r\n\r\n")
    assert 0 < len(body) < len(b"".join(events)) and body == b"".join(events)[: len(body)]
    client.close()


# -- many streams at once, on the real clock ----------------------------------------------------
async def test_many_streams_cross_the_relay_whole() -> None:
    """Many streams at once through the relay, their events interleaved (real clock): every
    client gets exactly its engine's body, every owner is woken, and the relay is empty
    after."""
    streams = 40
    events = [b"data: %d %s\n\n" % (i, b"x" * (i % 7)) for i in range(30)]
    network = FakeNetwork(EngineScript(events, gap=0.001))
    clients = [Client.make() for _ in range(streams)]
    results: list[tuple[bytes, int, bytes]] = []
    with trio.fail_after(LIMIT):
        async with network.open(), open_relay() as relay:
            pool = UpstreamPool(connect_timeout=5.0, read_timeout=60.0, connect=network.connect)

            async def one(client: Client) -> None:
                async with pool.request(
                    "http://10.0.0.1:8000", b"POST", b"/v1/completions", [], b"{}"
                ) as response:
                    results.append(await relay.relay(response, client))

            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(one, client)
            assert len(relay) == 0 and relay.relayed == streams
            pool.close()
    assert len(results) == streams
    bodies = [client.drain() for client in clients]
    for body in bodies:
        assert decode_chunked(body + b"0\r\n\r\n") == b"".join(events)
    assert sorted(sent for _, sent, _ in results) == sorted(len(body) for body in bodies)
    for client in clients:
        client.close()


async def test_owners_cancelled_mid_stream_leave_nothing_behind() -> None:
    """Owners cancelled at random points while the relay moves their streams (real clock):
    each leaves the relay at once, its engine connection is closed, and the relay keeps
    serving the others."""
    events = [b"data: %d\n\n" % i for i in range(200)]
    network = FakeNetwork(EngineScript(events, gap=0.001))
    clients = [Client.make() for _ in range(20)]
    completed = 0
    with trio.fail_after(LIMIT):
        async with network.open(), open_relay() as relay:
            pool = UpstreamPool(connect_timeout=5.0, read_timeout=60.0, connect=network.connect)

            async def one(index: int, client: Client) -> None:
                nonlocal completed
                with trio.move_on_after(0.01 * index if index % 2 else math.inf):
                    async with pool.request(
                        "http://10.0.0.1:8000", b"POST", b"/v1/completions", [], b"{}"
                    ) as response:
                        await relay.relay(response, client)
                        completed += 1

            async with trio.open_nursery() as nursery:
                for index, client in enumerate(clients):
                    nursery.start_soon(one, index, client)
            assert len(relay) == 0 and not relay._by_fd
            await network.wait_for(lambda: network.open_now["10.0.0.1"] <= completed)
            pool.close()
    assert completed == 10  # the even ones, never cancelled
    for index, client in enumerate(clients):
        body = decode_chunked(client.drain() + b"0\r\n\r\n")
        assert body == b"".join(events) if index % 2 == 0 else b"".join(events).startswith(body)
        client.close()


async def test_a_client_socket_closed_meanwhile_is_not_confused_with_a_new_one() -> None:
    """The server closes a client's socket while its stream is relayed, and a new socket gets
    the same descriptor number: the relay ends the stream (the client is gone) at its next
    write and never writes into the new socket (real clock)."""
    events = [b"data: %d\n\n" % i for i in range(100)]
    network = FakeNetwork(EngineScript(events, gap=0.002))
    client = Client.make()
    gone = trio.Event()
    with trio.fail_after(LIMIT):
        async with network.open(), open_relay() as relay:
            pool = UpstreamPool(connect_timeout=5.0, read_timeout=60.0, connect=network.connect)
            async with (
                pool.request(
                    "http://10.0.0.1:8000", b"POST", b"/v1/completions", [], b"{}"
                ) as response,
                trio.open_nursery() as nursery,
            ):

                async def run() -> None:
                    with pytest.raises(ClientGoneError):
                        await relay.relay(response, client)
                    gone.set()

                number = client.fileno()
                nursery.start_soon(run)
                await trio.sleep(0.02)
                client.ours.close()  # as the server closes a connection
                ours, theirs = socket.socketpair()
                try:
                    if ours.fileno() != number:  # make the new socket take the old number
                        os.dup2(ours.fileno(), number)
                        ours.close()
                        ours = socket.socket(fileno=number)
                    theirs.setblocking(False)
                    await gone.wait()
                    await trio.sleep(0.05)  # the engine goes on sending meanwhile
                    with pytest.raises(BlockingIOError):
                        theirs.recv(1 << 16)  # nothing of the old stream reached it
                finally:
                    ours.close()
                    theirs.close()
                assert len(relay) == 0
            pool.close()
    # The old client's peer got the stream until its socket closed, then the end.
    received = bytearray()
    while data := client.theirs.recv(1 << 16):
        received += data
    assert received.startswith(b"9\r\ndata: 0\n\n\r\n")
    client.theirs.close()


# -- end to end -------------------------------------------------------------------------------
@dataclass
class ScriptedEngine:
    """An engine on a real socket answering every POST with `head` and then `pieces`, each
    written once the router has taken the one before (every task blocked), so that each is a
    read of its own; then it ends, resets the connection, or hangs. GET /v1/models answers
    the probe."""

    pieces: list[bytes]
    then: str = "end"  # "end", "reset", or "hang"
    head: bytes = HEAD
    closed: trio.Event = field(default_factory=trio.Event)  # the router closed a stream
    gate: trio.Event | None = None  # if given, the pieces wait for it after the head

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.2.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.serve_listeners, self._handle, listeners))
            task_status.started(f"http://127.0.2.1:{port}")

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                request = None
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some()
                        if not data:
                            return
                        conn.receive_data(data)
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.EndOfMessage):
                        break
                assert request is not None
                if request.method == b"GET":
                    body = json.dumps({"object": "list", "data": [{"id": "fake-model"}]})
                    await stream.send_all(
                        conn.send(
                            h11.Response(
                                status_code=200, headers=[("content-length", str(len(body)))]
                            )
                        )
                        + conn.send(h11.Data(data=body.encode()))
                        + conn.send(h11.EndOfMessage())
                    )
                    conn.start_next_cycle()
                    continue
                await stream.send_all(self.head)
                if self.gate is not None:
                    await self.gate.wait()
                for piece in self.pieces:
                    await trio.testing.wait_all_tasks_blocked()
                    await stream.send_all(piece)
                if self.then == "reset":
                    await trio.testing.wait_all_tasks_blocked()
                    stream.socket.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    return
                if self.then == "hang":
                    if not await stream.receive_some():  # only the router's close ends it
                        self.closed.set()
                    return
                return  # "end": the pieces held the whole body; no keep-alive needed


@asynccontextmanager
async def open_scripted_router(
    engine: ScriptedEngine, **sections: Any
) -> AsyncIterator[tuple[str, str]]:
    """The router in front of `engine`: (router URL, the engine's name in metrics)."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(engine.serve)
        table = RoutingTable()
        bound = await nursery.start(
            partial(server.run, router_config([url], **sections), table=table, handle_signals=False)
        )
        while not table.routable("fake-model"):
            await table.wait_changed()
        yield bound[0], url.removeprefix("http://")
        nursery.cancel_scope.cancel()


async def requests_with_status(url: str, engine: str, status: int) -> float:
    async with httpx.AsyncClient() as client:
        return sample(
            (await client.get(f"{url}/metrics")).text,
            "trio_router_requests_total",
            model="fake-model",
            engine=engine,
            status=str(status),
        )


async def raw_request(url: str, version: str) -> tuple[trio.SocketStream, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    body = json.dumps({"model": "fake-model", "stream": True}).encode()
    await stream.send_all(
        f"POST /v1/completions HTTP/{version}\r\nhost: r\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return stream, body


async def fetch_raw(url: str, version: str) -> tuple[bytes, bytes]:
    """A streamed request over a raw HTTP/`version` connection: the answer's head and body
    (as sent: chunked for HTTP/1.1)."""
    stream, _ = await raw_request(url, version)
    async with stream:
        head, _, body = (await read_all(stream)).partition(b"\r\n\r\n")
    return head, body


async def read_all(stream: trio.SocketStream) -> bytes:
    """Everything until the router closes the connection or ends a chunked body."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        piece = await stream.receive_some()
        if not piece:
            break
        data += piece
    return data


async def relayed_count(url: str) -> float:
    async with httpx.AsyncClient() as client:
        return sample(
            (await client.get(f"{url}/metrics")).text, "trio_router_relayed_responses_total"
        )


EVENTS: Final = [b'data: {"i": %d, "text": "tok\\r\\nen"}\n\n' % i for i in range(6)]
SCRIPTS: Final = {
    "one chunk per read": [chunked([e])[:-5] for e in EVENTS] + [b"0\r\n\r\n"],
    "several chunks per read": [chunked(EVENTS[:3])[:-5], chunked(EVENTS[3:])],
    "chunks cut anywhere": (lambda w: [w[i : i + 7] for i in range(0, len(w), 7)])(chunked(EVENTS)),
    "other spellings and trailers": [
        chunked(EVENTS[:2], spelling="upper")[:-5],
        chunked(EVENTS[2:4], spelling="ext")[:-5],
        chunked(EVENTS[4:], spelling="zeros", trailers=True),
    ],
    "last chunk split": (lambda w: [w[:-3], w[-3:-1], w[-1:]])(chunked(EVENTS)),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
async def test_http11_relay_and_http10_general_path_deliver_the_same_body(script: str) -> None:
    engine = ScriptedEngine(SCRIPTS[script])
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, _):
            before = await relayed_count(url)
            head, relayed = await fetch_raw(url, "1.1")
            assert b"transfer-encoding: chunked" in head.lower()
            assert decode_chunked(relayed) == b"".join(EVENTS)
            assert await relayed_count(url) == before + 1

            head, general = await fetch_raw(url, "1.0")
            assert b"transfer-encoding" not in head.lower() and general == b"".join(EVENTS)
            assert await relayed_count(url) == before + 1  # HTTP/1.0: not relayed


async def test_a_streamed_head_goes_out_before_the_first_event_comes() -> None:
    """The head is written with the body's first bytes only when they came with it: a
    streamed answer's head reaches the client while the engine has not sent an event yet."""
    engine = ScriptedEngine(SCRIPTS["several chunks per read"], gate=trio.Event())
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, _):
            stream, _ = await raw_request(url, "1.1")
            async with stream:
                received = b""
                while b"\r\n\r\n" not in received:  # the engine waits for the gate
                    received += await stream.receive_some()
                assert received.startswith(b"HTTP/1.1 200 OK\r\n")
                assert received.endswith(b"\r\n\r\n")
                assert engine.gate is not None
                engine.gate.set()
                while not received.endswith(b"\r\n0\r\n\r\n"):
                    received += await stream.receive_some()
            assert decode_chunked(received.partition(b"\r\n\r\n")[2]) == b"".join(EVENTS)


@pytest.mark.parametrize("script", ["one chunk per read", "several chunks per read"])
async def test_events_that_came_with_the_head_go_out_with_it_and_the_relay_takes_the_rest(
    script: str,
) -> None:
    pieces = SCRIPTS[script]
    engine = ScriptedEngine(pieces[1:], head=HEAD + pieces[0])
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, _):
            before = await relayed_count(url)
            head, body = await fetch_raw(url, "1.1")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert decode_chunked(body) == b"".join(EVENTS)
            assert await relayed_count(url) == before + 1


async def test_a_stream_relayed_from_its_first_event_has_its_time_to_first_byte(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No body byte came with the head: the relay takes the body from its first byte, and
    the time to first byte is when that byte came (5 virtual seconds after the head)."""
    engine = ScriptedEngine(SCRIPTS["several chunks per read"], gate=trio.Event())
    with trio.fail_after(60.0):
        async with open_scripted_router(engine) as (url, _):
            before = await relayed_count(url)
            stream, _ = await raw_request(url, "1.1")
            async with stream:
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await stream.receive_some()
                await trio.sleep(5.0)  # the engine's time to its first event
                assert engine.gate is not None
                engine.gate.set()
                while not received.endswith(b"\r\n0\r\n\r\n"):
                    received += await stream.receive_some()
            assert decode_chunked(received.partition(b"\r\n\r\n")[2]) == b"".join(EVENTS)
            assert await relayed_count(url) == before + 1
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"{url}/metrics")).text
    ttfb = "trio_router_time_to_first_byte_seconds"
    assert sample(text, f"{ttfb}_count", model="fake-model") == 1
    assert 5.0 <= sample(text, f"{ttfb}_sum", model="fake-model") < 5.5


async def test_http2_clients_take_the_general_path() -> None:
    engine = ScriptedEngine(SCRIPTS["one chunk per read"])
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, _):
            before = await relayed_count(url)
            async with httpx.AsyncClient(http1=False, http2=True) as client:
                response = await client.post(
                    f"{url}/v1/completions", json={"model": "fake-model", "stream": True}
                )
            assert response.http_version == "HTTP/2" and response.content == b"".join(EVENTS)
            assert await relayed_count(url) == before


async def test_engine_reset_mid_relay_ends_the_stream_with_an_error_event() -> None:
    """The events relayed before the reset reach the client, then an OpenAI-style error event
    and a clean end of the body: a client cannot take the stream for a finished one (no
    [DONE]), and the request counts as a 502."""
    engine = ScriptedEngine(SCRIPTS["one chunk per read"][:3], then="reset")
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, name):
            stream, _ = await raw_request(url, "1.1")
            async with stream:
                data = await read_all(stream)
            body = decode_chunked(data.partition(b"\r\n\r\n")[2])
            assert body.startswith(b"".join(EVENTS[:3]))
            error = json.loads(body[len(b"".join(EVENTS[:3])) :].removeprefix(b"data: "))
            assert error["error"]["code"] == "bad_engine_response"
            assert b"[DONE]" not in body
            assert await requests_with_status(url, name, 502) == 1


async def test_a_body_broken_in_the_read_of_the_head_still_gives_the_client_the_head() -> None:
    """The body's first bytes, here with the head, break the framing: the head (held for
    them) still reaches the client, then the error event that ends the stream."""
    engine = ScriptedEngine([], head=HEAD + b"zz\r\nbanana\r\n")
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, name):
            head, body = await fetch_raw(url, "1.1")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            error = json.loads(decode_chunked(body).removeprefix(b"data: "))
            assert error["error"]["code"] == "bad_engine_response"
            assert await requests_with_status(url, name, 502) == 1


async def test_client_leaving_mid_relay_closes_the_engine_connection() -> None:
    engine = ScriptedEngine(SCRIPTS["one chunk per read"][:2], then="hang")
    with trio.fail_after(LIMIT):
        async with open_scripted_router(engine) as (url, name):
            stream, _ = await raw_request(url, "1.1")
            first = b""
            while b"data: {" not in first:
                first += await stream.receive_some()
            await stream.aclose()
            start = trio.current_time()
            await engine.closed.wait()
            assert trio.current_time() - start < 1.0  # a client check comes every 0.25 s
            assert await requests_with_status(url, name, 499) == 1
