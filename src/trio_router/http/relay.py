"""The relay: the chunked bodies of engine answers moved to their clients, for every relayed
stream at once, from one task, with the codec's framing check in between."""

from __future__ import annotations

import logging
import math
import os
import select
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from .codec import ProtocolError
from .connection import READ_SIZE
from .errors import ClientGoneError, EngineBrokeOffError, EngineTimeoutError, TransportError
from .pool import RelaySource, UpstreamResponse
from .stall import stalled

__all__ = [
    "CHECK_S",
    "PAUSE_AT",
    "PAUSE_S",
    "Relay",
    "RelayTarget",
    "Rewrite",
    "open_relay",
    "rewritten",
]

CHECK_S: Final = 0.25  # how often the relayed streams' deadlines are checked
PAUSE_S: Final = 0.001  # the pause after a busy pass, so that the next serves more events
PAUSE_AT: Final = 4  # a pass that served this many sockets is busy

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A rewriting of an answer's body on its way to the client. `data(piece, final)`: what
    goes out for a piece of the body's data (`final`: the body ends with it). `framed(chunk)`,
    when given: what goes out for a read that is one HTTP chunk as it came on the wire, the
    chunk to write, or None when the read is to be unframed and go through `data` (a relayed
    body's common read, rewritten without unframing and framing it again)."""

    data: Callable[[bytes, bool], bytes]
    framed: Callable[[bytes], bytes | None] | None = None


class RelayTarget(Protocol):
    """Where a relayed body goes: a client connection speaking HTTP/1.1 with a chunked
    response body under way, whose socket nothing else writes to meanwhile (see
    `connection.ClientSocket`). `fileno()` is -1 once the socket is closed."""

    def fileno(self) -> int: ...


class Relay:
    """Moves the chunked bodies of engine answers to their clients, for every relayed stream
    at once, in one task: what a token stream costs per event is a `recv` from the engine and
    a `write` to the client, with nothing in between but the chunk framing check.

    An HTTP/1.1 client with a chunked response under way can take the engine's chunks as they
    are. `relay()` hands such a body over: the engine's socket joins this relay's own epoll
    set (level-triggered, registered once per stream), and when it is readable, what it holds
    is read, its chunk framing checked by the codec (`ResponseParser.read_body_framed`:
    complete chunks in h11's form pass as they came, anything else is framed anew) and written
    to the client's socket at once; the last chunk is left to the client connection's own
    codec. Every socket ready at a wake-up is served in the same pass, so a burst of events
    on many streams costs one trip through the scheduler. After a pass that served
    `PAUSE_AT` sockets or more (load), the relay waits `PAUSE_S` and then serves what became
    ready meanwhile at once, without another wait on the epoll set: under load a pass serves
    many events and one trip through the scheduler is paid for all of them (an event waits at
    most `PAUSE_S`; at light load, not at all).

    - Backpressure: when the client's socket does not take everything, the engine's socket is
      no longer read until the rest is written (the client's socket joins the set for
      writability meanwhile): at most one read of an engine's bytes is held per stream. A
      client that takes nothing for `write_timeout` ends its stream with ClientGoneError.
    - Every CHECK_S the relayed streams' deadlines are checked: an engine silent for
      `read_timeout` with EngineTimeoutError, or once the body has begun past its stall bound
      (`http.stall`: the stream's own pace) with EngineStalledError. A write that fails
      (reset, closed) is a gone client; an engine that resets, closes early or breaks the
      framing ends its stream with EngineBrokeOffError; `response.break_off(error)` ends it
      with `error` at once (or once a write the client has not taken yet is done).
    - The task that called `relay()` owns its stream: cancelling it takes the stream out of
      the set at once (and the exchange then closes the engine's connection).

    Use from the Trio thread; run it with `open_relay()`.
    """

    def __init__(self, *, write_timeout: float = math.inf) -> None:
        self.write_timeout = write_timeout  # a client taking nothing this long is dropped
        self._epoll = select.epoll()
        self._by_fd: dict[int, _Relayed] = {}  # engine sockets, and client sockets being waited on
        self._streams: set[_Relayed] = set()
        self._shared = _Shared(self._epoll, self._by_fd, self._streams)
        self._streams_changed = trio.Event()
        self.relayed = 0  # streams handed over in all; for metrics and tests
        self.passes = 0  # passes over the ready sockets; for tests

    def __len__(self) -> int:
        return len(self._streams)

    async def relay(
        self,
        response: UpstreamResponse,
        client: RelayTarget,
        *,
        hold_last: bool = False,
        on_first: Callable[[float], None] | None = None,
        transform: Rewrite | None = None,
    ) -> tuple[bytes, int, bytes]:
        """Move the rest of `response`'s body (`response.relayable`) to `client`. Returns
        when the engine's last chunk has been read and everything before it written (the
        caller then ends its response, which writes the last chunk), with the end of what
        was relayed (up to 8 KiB: where the engine's usage summary would be), how many
        bytes were relayed, and, with `hold_last`, the bytes of the read that ended the body,
        not written: the caller writes them with the end of its response, in one write
        (b"" without `hold_last`, or when that read held nothing before the end).
        `on_first(now)` is called (from the relay's task) when the first bytes are passed on.
        With `transform`, the body's bytes are decoded and go through it (`transform.data(data,
        final)`, `final` at the end of the body) and what it returns is framed anew as one
        chunk per read (a read of one chunk goes through `transform.framed` first, when it
        has one): the relay's path, with a rewriting of the body between. Raises
        ClientGoneError, EngineTimeoutError, EngineBrokeOffError or the error the response was
        broken off with (then the client's response is left at a clean point, not ended). The
        time of the engine's last bytes goes back to `response.received_at`. Cancellation
        takes the stream out of the relay at once."""
        stream = _Relayed(
            self._shared,
            response.relay_source(),
            client,
            write_timeout=self.write_timeout,
            hold_last=hold_last,
            on_first=on_first,
            transform=transform,
        )
        self._streams.add(stream)
        self.relayed += 1
        self._wake_ticker()
        stream.received_at = response.received_at
        try:
            stream.start(trio.current_time())
            response.relayed_by(stream.break_off)
            await stream.finished.wait()
        finally:
            stream.detach()
            response.relayed_by(None)
            response.received_at = stream.received_at
        if stream.error is not None:
            raise stream.error
        return stream.before_last[-4096:] + stream.last[-4096:], stream.sent, stream.held

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve every relayed stream until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._check_forever)
            task_status.started()
            epoll, by_fd = self._epoll, self._by_fd
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                # Passes follow each other without waiting on the epoll set while they are
                # busy: after the pause, what became ready meanwhile is served at once.
                while ready := epoll.poll(0):
                    self.passes += 1
                    now = trio.current_time()
                    for fd, flags in ready:
                        stream = by_fd.get(fd)
                        if stream is not None:  # None: its stream ended earlier in this pass
                            stream.ready(fd, flags, now)
                    if len(ready) < PAUSE_AT:
                        break
                    await trio.sleep(PAUSE_S)

    def close(self) -> None:
        """Release the epoll set (streams still relayed were ended by their owners)."""
        self._epoll.close()

    async def _check_forever(self) -> None:
        while True:
            if not self._streams:
                await self._streams_changed.wait()
            await trio.sleep(CHECK_S)
            now = trio.current_time()
            for stream in list(self._streams):
                stream.check(now)

    def _wake_ticker(self) -> None:
        self._streams_changed.set()
        self._streams_changed = trio.Event()


@asynccontextmanager
async def open_relay(*, write_timeout: float = math.inf) -> AsyncIterator[Relay]:
    """A running `Relay`; leaving the block stops it (streams still relayed end with their
    owners' cancellation)."""
    relay = Relay(write_timeout=write_timeout)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            yield relay
            nursery.cancel_scope.cancel()
    finally:
        relay.close()


def rewritten(framed: bytes, final: bool, rewrite: Rewrite) -> bytes:
    """What a relayed read comes to through `rewrite` (`framed`: its chunks as the codec's
    `read_body_framed` gives them; `final`: the body ends with it), as the chunks to write:
    what `rewrite.framed` makes of it, else its data through `rewrite.data`, framed anew as
    one chunk (or as it came, when that leaves the data of a read of one chunk as it was)."""
    if rewrite.framed is not None and (out := rewrite.framed(framed)) is not None:
        return out
    return _data_rewritten(framed, final, rewrite.data)


def _data_rewritten(framed: bytes, final: bool, data: Callable[[bytes, bool], bytes]) -> bytes:
    """A read's data through `data` (see `rewritten`). A read of one whole chunk (a token
    stream's usual read) is unframed by hand."""
    size_end = framed.find(b"\r\n")
    if size_end > 0 and size_end + 4 + int(framed[:size_end], 16) == len(framed):
        piece = framed[size_end + 2 : -2]  # one chunk
    else:
        piece, framed = _unframed(framed), b""
    out = data(piece, final)
    if out is piece and framed:
        return framed
    return b"%x\r\n%s\r\n" % (len(out), out) if out else b""


def _unframed(framed: bytes) -> bytes:
    """The data of a run of chunks as `read_body_framed` gives them (whole, canonical or
    framed anew)."""
    parts, pos = [], 0
    while pos < len(framed):
        size_end = framed.index(b"\r\n", pos)
        start = size_end + 2
        stop = start + int(framed[pos:size_end], 16)
        parts.append(framed[start:stop])
        pos = stop + 2
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class _Shared:
    """What a relay's streams share: its epoll set, its fd -> stream map, its streams."""

    epoll: select.epoll
    by_fd: dict[int, _Relayed]
    streams: set[_Relayed]


class _Relayed:
    """One stream in a `Relay`: the engine's side (socket, parser), the client's socket, and
    the bytes read but not yet written."""

    __slots__ = (
        "_allowed",
        "_broken",
        "_by_fd",
        "_client",
        "_client_fd",
        "_conn",
        "_engine_fd",
        "_epoll",
        "_framed",
        "_gap",
        "_hold_last",
        "_on_first",
        "_parser",
        "_pending",
        "_read_timeout",
        "_silent_since",
        "_stall",
        "_started",
        "_streams",
        "_transform",
        "_url",
        "_write_timeout",
        "before_last",
        "deadline",
        "error",
        "finished",
        "held",
        "last",
        "received_at",
        "sent",
        "write_deadline",
    )

    def __init__(
        self,
        shared: _Shared,
        source: RelaySource,
        client: RelayTarget,
        *,
        write_timeout: float,
        hold_last: bool = False,
        on_first: Callable[[float], None] | None = None,
        transform: Rewrite | None = None,
    ) -> None:
        # The relay's epoll set, its fd -> stream map and its set of streams, shared by its
        # streams (each registers and unregisters its own sockets there).
        self._epoll, self._by_fd, self._streams = shared.epoll, shared.by_fd, shared.streams
        self._write_timeout = write_timeout
        self._hold_last = hold_last
        self._on_first = on_first
        self._transform = transform.data if transform is not None else None
        self._framed = transform.framed if transform is not None else None
        self._conn, self._parser = source.conn, source.parser
        self._url = source.url
        self._read_timeout = source.read_timeout
        self._stall = source.stall  # once the body has begun, if set
        self._started = False
        self._allowed = self._read_timeout  # the silence allowed now (see `_begun`)
        self._gap = math.inf  # the stream's longest silence so far (once begun, with a stall)
        self._silent_since = self.received_at = 0.0  # the engine's last bytes (or a resume)
        if source.started:
            self._begun()
        self._broken: TransportError | None = None  # break_off's, while a write waits
        self._client = client
        self._engine_fd = -1
        self._client_fd = -1  # registered for writability while a write waits
        self._pending = b""
        self.deadline = math.inf  # the engine's silence budget
        self.write_deadline = math.inf  # the client's, while a write waits
        self.error: TransportError | None = None
        self.finished = trio.Event()
        self.before_last = self.last = b""  # the last two pieces: where a usage summary is
        self.sent = 0  # bytes handed to the client's socket (or held for the caller)
        self.held = b""  # with hold_last: the read that ended the body, for the caller

    def start(self, now: float) -> None:
        """Watch the engine's socket, and relay what was already received."""
        self._silent_since = now
        self.deadline = now + self._allowed
        self._engine_fd = self._conn.raw.fileno()
        self._epoll.register(self._engine_fd, select.EPOLLIN)
        self._by_fd[self._engine_fd] = self
        self._forward(now)

    def ready(self, fd: int, flags: int, now: float) -> None:
        if fd == self._client_fd:
            self._flush(now)
            return
        try:
            data = self._conn.raw.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(
                EngineBrokeOffError(f"engine {self._url} reset the connection mid-response: {exc}")
            )
            return
        if data:
            self._parser.feed(data)
            if not self._started:
                self._begun()
            elif now - self._silent_since > self._gap:
                self._widen(now - self._silent_since)
            self._silent_since = self.received_at = now
            self.deadline = now + self._allowed
            self._forward(now)
        else:
            self._finish(
                EngineBrokeOffError(
                    f"engine {self._url} broke off the response body: connection closed "
                    "before the end of the response body"
                )
            )

    def check(self, now: float) -> None:
        """The periodic check: a client that takes nothing, an engine silent for too long."""
        if now >= self.write_deadline:
            logger.info(
                "a client took nothing of a relayed stream for %g s; dropping it",
                self._write_timeout,
            )
            self._finish(ClientGoneError())
        elif now >= self.deadline:
            self._finish(
                stalled(self._url, self._allowed, self._gap)
                if self._started and self._stall is not None
                else EngineTimeoutError(
                    f"engine {self._url} was silent for {self._read_timeout:g} s mid-response "
                    "(proxy.read_timeout_s)"
                )
            )

    def break_off(self, error: TransportError) -> None:
        """End the stream with `error` (`UpstreamResponse.break_off`): at once, or once the
        client's socket has taken the write it is given (its answer stays at a clean
        point). The engine's socket is not read meanwhile."""
        if self.finished.is_set():
            return
        if self._pending:
            self._broken = error
            self.deadline = math.inf
        else:
            self._finish(error)

    def _forward(self, now: float) -> None:
        parser = self._parser
        try:
            out = parser.read_body_framed()
            if self._transform is not None and (out or parser.done):
                # As `rewritten` does, its first call made here: the common read (one chunk
                # of one event) costs no call more.
                if (framed := self._framed) is None or (piece := framed(out)) is None:
                    piece = _data_rewritten(out, parser.done, self._transform)
                out = piece
        except ProtocolError as exc:
            self._finish(
                EngineBrokeOffError(f"engine {self._url} broke off the response body: {exc}")
            )
            return
        if out:
            if self._on_first is not None:
                self._on_first(now)
                self._on_first = None
            self.before_last, self.last = self.last, out
            self.sent += len(out)
            if self._hold_last and self._parser.done:
                self.held = out  # written by the caller, with the end of its response
                self._finish(None)
                return
            self._pending = out
            self._flush(now)
        elif self._parser.done:
            self._finish(None)

    def _begun(self) -> None:
        """The body's first bytes came: from now on, the silence allowed is the stall bound
        (`http.stall`), when one is set, for the longest gap so far (none yet)."""
        self._started = True
        if (stall := self._stall) is not None:
            self._gap = 0.0
            self._allowed = stall.allowed(0.0)

    def _widen(self, gap: float) -> None:
        """A gap longer than any before: the silence allowed follows."""
        assert self._stall is not None  # else the longest gap stays infinite
        self._gap = gap
        self._allowed = self._stall.allowed(gap)

    def _flush(self, now: float) -> None:
        """Write what is pending; wait for the client's socket if it does not take it all."""
        data = self._pending
        try:
            written = os.write(self._client.fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError:  # reset, broken pipe, or closed by the server (fileno() is -1)
            self._finish(ClientGoneError())
            return
        epoll = self._epoll
        if written < len(data):
            self._pending = data[written:]
            self.deadline = math.inf  # the client is slow, not the engine
            if written or self.write_deadline == math.inf:
                self.write_deadline = now + self._write_timeout
            if self._client_fd < 0:
                if self._engine_fd >= 0:
                    epoll.modify(self._engine_fd, 0)  # read no more until this is written
                self._client_fd = self._client.fileno()
                epoll.register(self._client_fd, select.EPOLLOUT)
                self._by_fd[self._client_fd] = self
            return
        self._pending = b""
        self.write_deadline = math.inf
        if self._parser.done:
            self._finish(None)
            return
        if self._broken is not None:
            self._finish(self._broken)
            return
        if self._client_fd >= 0:
            self._unregister(self._client_fd)
            self._client_fd = -1
            if self._engine_fd >= 0:
                epoll.modify(self._engine_fd, select.EPOLLIN)
            self._silent_since = now  # the wait for the client was not the engine's silence
            self.deadline = now + self._allowed

    def _finish(self, error: TransportError | None) -> None:
        if self.finished.is_set():
            return
        self.error = error
        self.detach()
        self.finished.set()

    def detach(self) -> None:
        """Leave the relay (synchronous; idempotent)."""
        for fd in (self._engine_fd, self._client_fd):
            if fd >= 0:
                self._unregister(fd)
        self._engine_fd = self._client_fd = -1
        self._streams.discard(self)

    def _unregister(self, fd: int) -> None:
        if self._by_fd.get(fd) is self:
            del self._by_fd[fd]
            with suppress(OSError, ValueError):  # closed meanwhile: the kernel dropped it
                self._epoll.unregister(fd)
