"""The relay: the chunked bodies of engine answers moved to their clients, for every relayed
stream at once, by one thread of its own, with the codec's framing check in between."""

from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Final, Protocol

import trio

from .codec import ProtocolError
from .connection import READ_SIZE
from .errors import ClientGoneError, EngineBrokeOffError, EngineTimeoutError
from .pool import RelaySource, UpstreamResponse

__all__ = ["CHECK_S", "PAUSE_AT", "PAUSE_S", "Relay", "RelayTarget", "open_relay"]

CHECK_S: Final = 0.25  # how often the relayed streams' deadlines are checked
PAUSE_S: Final = 0.001  # the pause after a busy pass, so that the next serves more events
PAUSE_AT: Final = 4  # a pass that served this many sockets is busy

logger = logging.getLogger(__name__)


class RelayTarget(Protocol):
    """Where a relayed body goes: a client connection speaking HTTP/1.1 with a chunked
    response body under way, whose socket nothing else writes to meanwhile (see
    `connection.ClientSocket`). `fileno()` is -1 once the socket is closed."""

    def fileno(self) -> int: ...


class Relay:
    """Moves the chunked bodies of engine answers to their clients, for every relayed stream
    at once, in a thread of its own: what a token stream costs per event is a `recv` from the
    engine and a `write` to the client, with nothing in between but the chunk framing check,
    and no trip through Trio's scheduler.

    An HTTP/1.1 client with a chunked response under way can take the engine's chunks as they
    are. `relay()` hands such a body over: the engine's socket joins this relay's own epoll
    set (level-triggered, registered once per stream), and when it is readable, the relay's
    thread (blocked in `epoll_wait` with the GIL released, otherwise) reads what it holds,
    has the codec check its chunk framing (`ResponseParser.feed_framed`: complete chunks in
    h11's form pass as they came, anything else is framed anew) and writes it to the client's
    socket at once; the last chunk is left to the client connection's own codec. Every socket
    ready at a wake-up is served in the same pass; after a pass that served `PAUSE_AT` sockets
    or more (load), the thread waits `PAUSE_S` before the next, so that a pass serves many
    events and a wake-up is paid for many (an event waits at most that long; at light load,
    not at all).

    - Backpressure: when the client's socket does not take everything, the engine's socket is
      no longer read until the rest is written (the client's socket joins the set for
      writability meanwhile): at most one read of an engine's bytes is held per stream. A
      client that takes nothing for `write_timeout` ends its stream with ClientGoneError.
    - Every CHECK_S the relayed streams' deadlines are checked, on Trio's clock, by a task of
      the relay: an engine silent for `read_timeout` ends its stream with EngineTimeoutError
      (found between `read_timeout` and `read_timeout` + 2 CHECK_S after its last read: the
      thread counts reads, the check sees the count move). A write that fails (reset, closed)
      is a gone client; an engine that resets, closes early or breaks the framing ends its
      stream with EngineBrokeOffError.
    - The task that called `relay()` owns its stream: cancelling it takes the stream out of
      the set at once (and the exchange then closes the engine's connection).
    - Threads: everything a stream holds is used under the relay's lock, by its thread for a
      pass and by the Trio thread to hand a stream in, take it out or check it; the thread
      wakes the owners of the streams a pass ended through the Trio token, once per pass. The
      relay writes to a duplicate of the client's descriptor, closed when the stream leaves,
      so a socket the server closes meanwhile is never confused with one opened since.

    Use from the Trio thread; run it with `open_relay()`.
    """

    def __init__(self, *, write_timeout: float = math.inf) -> None:
        self._shared = shared = _Shared(write_timeout)
        self._epoll, self._streams = shared.epoll, shared.streams
        self._lock = threading.Lock()
        self._streams_changed = trio.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # stops the thread
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._stopping = False
        self.relayed = 0  # streams handed over in all; for metrics and tests

    @property
    def write_timeout(self) -> float:
        return self._shared.write_timeout

    def __len__(self) -> int:
        return len(self._streams)

    async def relay(
        self,
        response: UpstreamResponse,
        client: RelayTarget,
    ) -> tuple[bytes, int]:
        """Move the rest of `response`'s body (`response.relayable`) to `client`. Returns
        when the engine's last chunk has been read and everything before it written (the
        caller then ends its response, which writes the last chunk), with the end of what
        was relayed (up to 8 KiB: where the engine's usage summary would be) and how many
        bytes were relayed. Raises
        ClientGoneError, EngineTimeoutError or EngineBrokeOffError (then the client's response
        cannot be ended cleanly). Cancellation takes the stream out of the relay at once."""
        stream = _Relayed(self._shared, response.relay_source(), client)
        self.relayed += 1
        try:
            with self._lock:
                self._streams.add(stream)
                stream.start(trio.current_time())
                self._wake_owners_now()
            self._wake_ticker()
            await stream.finished.wait()
        finally:
            with self._lock:
                stream.detach()
        if stream.error is not None:
            raise stream.error
        return stream.before_last[-4096:] + stream.last[-4096:], stream.sent

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve every relayed stream until cancelled (the thread stops with it)."""
        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._check_forever)
            task_status.started()
            # Not abandoned on cancellation: the check task's cancellation stops the thread,
            # and this waits for it, so nothing of the relay runs once `run` has returned.
            await trio.to_thread.run_sync(
                self._serve, token, limiter=trio.CapacityLimiter(1), abandon_on_cancel=False
            )

    def close(self) -> None:
        """Release the epoll set (streams still relayed were ended by their owners)."""
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the relay's thread ----------------------------------------------------------------------
    def _serve(self, token: trio.lowlevel.TrioToken) -> None:
        shared, lock = self._shared, self._lock
        epoll, by_fd = shared.epoll, shared.by_fd
        while True:
            ready = epoll.poll()
            with lock:
                if self._stopping:
                    return
                for fd, _ in ready:
                    stream = by_fd.get(fd)
                    if stream is not None:  # None: its stream left earlier (or the stop pipe)
                        stream.ready(fd)
                ended, shared.ended = shared.ended, []
            if ended:
                try:
                    token.run_sync_soon(_wake_owners, ended)
                except trio.RunFinishedError:
                    return
            if len(ready) >= PAUSE_AT:
                time.sleep(PAUSE_S)

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True
        with suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    # -- the Trio side ---------------------------------------------------------------------------
    async def _check_forever(self) -> None:
        try:
            while True:
                if not self._streams:
                    await self._streams_changed.wait()
                await trio.sleep(CHECK_S)
                now = trio.current_time()
                with self._lock:
                    for stream in list(self._streams):
                        stream.check(now)
                    self._wake_owners_now()
        finally:
            self._stop()

    def _wake_owners_now(self) -> None:
        """Wake the owners of the streams ended so far (on the Trio thread, under the lock)."""
        if ended := self._shared.ended:
            self._shared.ended = []
            _wake_owners(ended)

    def _wake_ticker(self) -> None:
        self._streams_changed.set()
        self._streams_changed = trio.Event()


class _Shared:
    """What a relay's streams share: the epoll set, the map from its descriptors to their
    streams (engine sockets, and client sockets being waited on), the streams, and those
    ended whose owners are not woken yet."""

    __slots__ = ("by_fd", "ended", "epoll", "streams", "write_timeout")

    def __init__(self, write_timeout: float) -> None:
        self.epoll = select.epoll()
        self.by_fd: dict[int, _Relayed] = {}
        self.streams: set[_Relayed] = set()
        self.ended: list[_Relayed] = []
        self.write_timeout = write_timeout  # a client taking nothing this long is dropped


def _wake_owners(streams: list[_Relayed]) -> None:
    for stream in streams:
        stream.finished.set()


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


class _Relayed:
    """One stream in a `Relay`: the engine's side (socket, parser), the client's socket (a
    duplicate of its descriptor), and the bytes read but not yet written. Used under the
    relay's lock only."""

    __slots__ = (
        "_client",
        "_conn",
        "_ended",
        "_engine_fd",
        "_out",
        "_parser",
        "_pending",
        "_read_timeout",
        "_reads_seen",
        "_shared",
        "_url",
        "_waiting",
        "_writes_seen",
        "before_last",
        "deadline",
        "error",
        "finished",
        "last",
        "reads",
        "sent",
        "write_deadline",
        "writes",
    )

    def __init__(self, shared: _Shared, source: RelaySource, client: RelayTarget) -> None:
        self._shared = shared
        self._conn, self._parser = source.conn, source.parser
        self._url = source.url
        self._read_timeout = source.read_timeout
        self._client = client
        self._engine_fd = -1
        self._out = -1  # the relay's duplicate of the client's descriptor
        self._waiting = False  # for the client's socket to take more (registered for it)
        self._pending = b""
        self._ended = False
        # The thread counts; the check (on Trio's clock) turns the counts into deadlines.
        self.reads = self.writes = 0  # engine reads; partial writes while the client lags
        self._reads_seen = self._writes_seen = 0
        self.deadline = math.inf  # the engine's silence budget
        self.write_deadline = math.inf  # the client's, while a write waits
        self.error: Exception | None = None
        self.finished = trio.Event()
        self.before_last = self.last = b""  # the last two pieces: where a usage summary is
        self.sent = 0  # bytes handed to the client's socket

    def start(self, now: float) -> None:
        """Watch the engine's socket, and relay what was already received."""
        self.deadline = now + self._read_timeout
        try:
            self._out = os.dup(self._client.fileno())  # -1 (closed by the server): EBADF
        except OSError:
            self._end(ClientGoneError())
            return
        shared = self._shared
        self._engine_fd = self._conn.raw.fileno()
        shared.epoll.register(self._engine_fd, select.EPOLLIN)
        shared.by_fd[self._engine_fd] = self
        self._take(b"")

    def ready(self, fd: int) -> None:
        """The relay's thread found `fd` (the engine's socket, or the client's while a write
        waits) ready."""
        try:
            if fd == self._out:
                self._flush()
                return
            try:
                data = self._conn.raw.recv(READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._end(
                    EngineBrokeOffError(
                        f"engine {self._url} reset the connection mid-response: {exc}"
                    )
                )
                return
            if not data:
                self._end(
                    EngineBrokeOffError(
                        f"engine {self._url} broke off the response body: connection closed "
                        "before the end of the response body"
                    )
                )
                return
            self.reads += 1
            self._take(data)
        except Exception as exc:  # a defect: this stream ends with it, the others go on
            logger.exception("the relay failed on a stream from %s", self._url)
            self._end(exc)

    def check(self, now: float) -> None:
        """The periodic check: a client that takes nothing, an engine silent for too long."""
        if self._waiting:
            if self.writes != self._writes_seen or self.write_deadline == math.inf:
                self._writes_seen = self.writes
                self.write_deadline = now + self._shared.write_timeout
            elif now >= self.write_deadline:
                logger.info(
                    "a client took nothing of a relayed stream for %g s; dropping it",
                    self._shared.write_timeout,
                )
                self._end(ClientGoneError())
        elif self.reads != self._reads_seen:
            self._reads_seen = self.reads
            self.deadline = now + self._read_timeout
        elif now >= self.deadline:
            self._end(
                EngineTimeoutError(
                    f"engine {self._url} was silent for {self._read_timeout:g} s mid-response "
                    "(proxy.read_timeout_s)"
                )
            )

    def _take(self, data: bytes) -> None:
        """Frame what the engine sent (and what the parser held) and write it."""
        try:
            out = self._parser.feed_framed(data) if data else self._parser.read_body_framed()
        except ProtocolError as exc:
            self._end(EngineBrokeOffError(f"engine {self._url} broke off the response body: {exc}"))
            return
        if out:
            self.before_last, self.last = self.last, out
            self.sent += len(out)
            self._pending = out
            self._flush()
        elif self._parser.done:
            self._end(None)

    def _flush(self) -> None:
        """Write what is pending; wait for the client's socket if it does not take it all."""
        data = self._pending
        try:
            written = os.write(self._out, data)
        except BlockingIOError:
            written = 0
        except OSError:  # reset, broken pipe
            self._end(ClientGoneError())
            return
        shared = self._shared
        if written < len(data):
            self._pending = data[written:]
            if written:
                self.writes += 1
            if not self._waiting:
                self._waiting = True
                if self._engine_fd >= 0:
                    shared.epoll.modify(self._engine_fd, 0)  # read no more until this is written
                shared.epoll.register(self._out, select.EPOLLOUT)
                shared.by_fd[self._out] = self
            return
        self._pending = b""
        if self._waiting:
            self._waiting = False
            self._unregister(self._out)
            if self._engine_fd >= 0:
                shared.epoll.modify(self._engine_fd, select.EPOLLIN)
            self.write_deadline = math.inf
            self._reads_seen = -1  # the engine's silence budget starts again at the next check
        if self._parser.done:
            self._end(None)

    def _end(self, error: Exception | None) -> None:
        if self._ended:
            return
        self._ended = True
        self.error = error
        self.detach()
        self._shared.ended.append(self)

    def detach(self) -> None:
        """Leave the relay (synchronous; idempotent)."""
        if self._engine_fd >= 0:
            self._unregister(self._engine_fd)
            self._engine_fd = -1
        if self._out >= 0:
            if self._waiting:
                self._unregister(self._out)
                self._waiting = False
            os.close(self._out)
            self._out = -1
        self._shared.streams.discard(self)

    def _unregister(self, fd: int) -> None:
        shared = self._shared
        if shared.by_fd.get(fd) is self:
            del shared.by_fd[fd]
            with suppress(OSError, ValueError):  # closed meanwhile: the kernel dropped it
                shared.epoll.unregister(fd)
