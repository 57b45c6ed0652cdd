"""KV-cache events from the engines into the block index, over ZMQ, on Trio.

Two ways to reach the engines' publishers (`[kv_events] mode`):

- `connect`: every engine binds its publisher (`tcp://*:PORT`, in Kubernetes each pod on its
  own IP) and every router replica subscribes to each engine, at `tcp://ENGINE_HOST:port` or
  the endpoint a static engine names. Each engine's subscriber is a task in that engine's
  discovery scope (`run_engine`, a supervisor worker like the metrics scraper): it starts and
  stops with the engine, and its socket closes with the scope.
- `bind`: the router binds one subscriber socket at `endpoint` and the engines connect to
  it, each publishing under its own topic, `topic` followed by its address (its host, or
  host:port, as the router names it): for a single router, or a laptop (`run_bound`).

ZMQ sockets are driven from the Trio thread without threads: each socket's notification
descriptor (`zmq.FD`) is awaited with `trio.lowlevel.wait_readable`, and every message ready
is read without blocking before waiting again; nothing polls.

Sequence numbers (per publisher, one per batch) are watched. A batch that skips numbers is a
gap: with a replay endpoint (`replay_port`, or a static engine's `kv_replay`), the missing
batches are asked of the engine's replay socket (a DEALER request for everything from the
first missing number, answered batch by batch and ended by sequence -1) and applied in order;
without one, or when the replay cannot fill the gap, the engine's index entries are dropped
(they may have missed removals) and rebuilt from the events that follow. A number that goes
back means the engine restarted: its entries are dropped. With a replay endpoint, a new
subscription first asks for the engine's history, once the publisher has the subscription
(ZMQ's handshake event): what the engine holds from before, and any batch published before
the subscription took effect, are known at once. Without one, a subscriber's first batch with
a number above 0 is a late start.
Messages that cannot be read are skipped and counted, never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import trio
import zmq

from ..config import KvEventsConfig
from ..http import UpstreamPool
from ..table import Engine, RoutingTable
from .events import Batch, MalformedMessage, decode_message, decode_payload
from .index import BlockIndex

__all__ = ["KvEvents", "SubscriberCounters"]

logger = logging.getLogger(__name__)

_END_OF_REPLAY: Final = struct.pack(">q", -1)
_SEQ: Final = struct.Struct(">q")
MAX_BURST: Final = 64  # messages read without waiting before a checkpoint


@dataclass(slots=True)
class SubscriberCounters:
    """What one engine's events did (for metrics)."""

    batches: int = 0
    events: int = 0
    skipped: int = 0  # events or messages that could not be read or applied
    gaps: int = 0
    replays: int = 0  # gaps (or late starts) filled by a replay
    replay_failures: int = 0
    resets: int = 0  # the engine's entries dropped: restart, lost events, AllBlocksCleared


@dataclass(slots=True)
class _Stream:
    """One publisher's sequence, as far as it has been applied."""

    last: int | None = None
    replayed: bool = False  # the last batches applied came from a replay


def _fd(sock: zmq.Socket[bytes]) -> int:
    """The descriptor that becomes readable when `sock` may have something to read."""
    return int(sock.getsockopt(zmq.FD))


async def _receive(sock: zmq.Socket[bytes], fd: int) -> list[bytes]:
    """The next message of `sock`, waiting on its notification descriptor."""
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        await trio.lowlevel.wait_readable(fd)


class _Reader:
    """One socket's messages in order: it waits only when none is ready, and lets other tasks
    run after MAX_BURST messages read without waiting (a backlog, a long replay)."""

    __slots__ = ("_fd", "_ready", "_sock")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock, self._fd = sock, _fd(sock)
        self._ready = 0  # messages read in a row without waiting

    async def next(self) -> list[bytes]:
        """The next message, waiting for it if none is ready."""
        frames = await self.ready()
        return frames if frames is not None else await self.wait()

    async def ready(self) -> list[bytes] | None:
        """The next message if one is ready (None if not)."""
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        self._ready += 1
        if self._ready >= MAX_BURST:
            self._ready = 0
            await trio.lowlevel.checkpoint()
        return frames

    async def wait(self) -> list[bytes]:
        """The next message, once one comes."""
        self._ready = 0
        return await _receive(self._sock, self._fd)


class KvEvents:
    """The engines' KV events into `index` (see the module's docstring). One per router
    process; `close()` ends its ZMQ context."""

    def __init__(
        self,
        index: BlockIndex,
        config: KvEventsConfig,
        table: RoutingTable,
        *,
        endpoints: Callable[[Engine], tuple[str, str]] | None = None,
    ) -> None:
        self.index, self._config, self._table = index, config, table
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._endpoints = endpoints or self._default_endpoints
        self._streams: dict[str, _Stream] = {}  # by engine uid
        self.counters: dict[str, SubscriberCounters] = {}  # by engine name
        self._unsubscribe = table.add_remove_listener(self._forget)

    def close(self) -> None:
        """End the subscription to the table and the ZMQ context (its sockets are closed by
        the tasks that own them)."""
        self._unsubscribe()
        self._context.destroy(linger=0)

    def snapshot(self) -> dict[str, tuple[dict[str, int], int]]:
        """Per engine name: its counters, and the blocks the index holds for it."""
        out = {}
        for engine in self._table:
            counters = self.counters.get(engine.name)
            if counters is not None:
                out[engine.name] = (
                    {key: getattr(counters, key) for key in SubscriberCounters.__slots__},
                    self.index.blocks(engine.uid),
                )
        return out

    def _forget(self, engine: Engine) -> None:
        """`engine` left the table: its sequence and counters go (the server drops its index
        entries)."""
        self._streams.pop(engine.uid, None)
        self.counters.pop(engine.name, None)

    def _default_endpoints(self, engine: Engine) -> tuple[str, str]:
        """(publisher, replay) endpoints of `engine`: its host at the configured ports."""
        host = urlsplit(engine.url).hostname or ""
        if ":" in host:
            host = f"[{host}]"
        replay = f"tcp://{host}:{self._config.replay_port}" if self._config.replay_port else ""
        return f"tcp://{host}:{self._config.port}", replay

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._config.receive_hwm)
        return sock

    # -- connect mode: one subscription per engine, in the engine's scope -----------------
    async def run_engine(self, engine: Engine, generation: int, pool: UpstreamPool) -> None:
        """Subscribe to `engine`'s events until cancelled (the engine's supervisor scope)."""
        endpoint, replay = self._endpoints(engine)
        sock = self._socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._config.topic.encode())
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            try:
                sock.connect(endpoint)
                logger.info(
                    "subscribing to the KV events of engine %s at %s", engine.name, endpoint
                )
                stream = self._streams.setdefault(engine.uid, _Stream())
                if replay:
                    # What the engine published before this subscription took effect is in
                    # its replay buffer: asked for once the publisher has the subscription.
                    with trio.move_on_after(self._config.replay_timeout_s):
                        await _receive(monitor, _fd(monitor))
                    await self._catch_up(engine, stream, replay)
            finally:
                # Stopped before its peer is closed: stopping sends a last event to the peer,
                # a send on a PAIR socket that blocks for good once the peer is gone.
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                monitor.close(linger=0)
            reader = _Reader(sock)
            while True:
                await self._handle(engine, stream, await reader.next(), replay)
        finally:
            sock.close(linger=0)

    async def _handle(
        self, engine: Engine, stream: _Stream, frames: list[bytes], replay: str
    ) -> None:
        counters = self.counters.setdefault(engine.name, SubscriberCounters())
        try:
            batch = decode_message(frames)
        except MalformedMessage as exc:
            counters.skipped += 1
            logger.debug("engine %s sent an unreadable KV-event message: %s", engine.name, exc)
            return
        if self._table.get(engine.uid) is not engine:
            return  # removed meanwhile
        await self._take(engine.uid, engine.name, stream, batch, replay, counters)

    async def _take(
        self,
        uid: str,
        name: str,
        stream: _Stream,
        batch: Batch,
        replay: str,
        counters: SubscriberCounters,
    ) -> None:
        """Apply `batch` in sequence: fill a gap first (or drop the engine's entries), and
        drop them when the sequence went back (a restart)."""
        last = stream.last
        if last is not None and batch.seq <= last:
            if stream.replayed and batch.seq > 0:
                return  # queued live while the replay already applied it
            logger.info(
                "engine %s restarted its KV events (sequence %d after %d)", name, batch.seq, last
            )
            self._reset(uid, counters)
        elif batch.seq > (-1 if last is None else last) + 1:
            start = 0 if last is None else last + 1
            counters.gaps += last is not None
            filled = bool(replay) and await self._replay(uid, name, stream, replay, start, counters)
            if not filled:
                if last is not None or stream.last != last:  # entries that may be stale
                    logger.warning(
                        "KV events of engine %s lost batches %d..%d: its index entries are "
                        "dropped and rebuilt from what follows",
                        name,
                        start,
                        batch.seq - 1,
                    )
                    self._reset(uid, counters)
                # Rebuilt from this batch on, whatever a partial replay had applied.
            elif stream.last is not None and batch.seq <= stream.last:
                return  # the replay covered it
        self._apply(uid, batch, counters)
        stream.last = batch.seq
        stream.replayed = False

    async def _catch_up(self, engine: Engine, stream: _Stream, replay: str) -> None:
        """A new subscription: the engine's history from its replay buffer, when it has any
        (an engine that published nothing yet has none; that is not a failure)."""
        if self._table.get(engine.uid) is not engine:
            return
        counters = self.counters.setdefault(engine.name, SubscriberCounters())
        before = counters.replay_failures
        start = 0 if stream.last is None else stream.last + 1
        filled = await self._replay(engine.uid, engine.name, stream, replay, start, counters)
        if not filled and stream.last is None:  # nothing to replay yet: not a failure
            counters.replay_failures = before

    def _apply(self, uid: str, batch: Batch, counters: SubscriberCounters) -> None:
        result = self.index.apply(uid, batch.events)
        counters.batches += 1
        counters.events += len(batch.events)
        counters.skipped += batch.skipped + result.skipped
        counters.resets += result.cleared

    def _reset(self, uid: str, counters: SubscriberCounters) -> None:
        self.index.clear(uid)
        counters.resets += 1

    async def _replay(
        self,
        uid: str,
        name: str,
        stream: _Stream,
        endpoint: str,
        start: int,
        counters: SubscriberCounters,
    ) -> bool:
        """Ask `endpoint` for every batch from `start` on and apply them in order. True if
        the replay filled everything from `start` (the engine still had it). The engine may
        stay silent for `replay_timeout_s` before each batch; a long replay (vLLM keeps 10,000
        batches) lets other tasks run as the live stream does (`_Reader`)."""
        sock = self._socket(zmq.DEALER)
        first: int | None = None
        silent = False
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", _SEQ.pack(start)], zmq.NOBLOCK)
            reader = _Reader(sock)
            while True:
                frames = await reader.ready()
                if frames is None:
                    with trio.move_on_after(self._config.replay_timeout_s):
                        frames = await reader.wait()
                    if silent := frames is None:
                        break
                if len(frames) != 4 or frames[2] == _END_OF_REPLAY:
                    break
                _, topic, seq_bytes, payload = frames
                try:
                    batch = decode_payload(topic, _SEQ.unpack(seq_bytes)[0], payload)
                except (MalformedMessage, struct.error):
                    counters.skipped += 1
                    continue
                if first is None:
                    first = batch.seq
                    if first > start:  # the engine no longer had the first ones
                        self._reset(uid, counters)
                if stream.last is None or batch.seq > stream.last:
                    self._apply(uid, batch, counters)
                    stream.last = batch.seq
                    stream.replayed = True
        except zmq.ZMQError as exc:
            logger.warning(
                "cannot replay the KV events of engine %s at %s: %s", name, endpoint, exc
            )
            counters.replay_failures += 1
            return False
        finally:
            sock.close(linger=0)
        if silent:
            logger.warning(
                "replay of the KV events of engine %s at %s: nothing for %g s",
                name,
                endpoint,
                self._config.replay_timeout_s,
            )
            counters.replay_failures += 1
            return False
        if first is None or first > start:
            counters.replay_failures += 1
            return False
        counters.replays += 1
        return True

    # -- bind mode: one socket, engines told apart by topic -------------------------------
    async def run_bound(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind `endpoint` and apply what every engine publishes there, until cancelled."""
        sock = self._socket(zmq.SUB)
        try:
            prefix = self._config.topic.encode()
            sock.setsockopt(zmq.SUBSCRIBE, prefix)
            sock.bind(self._config.endpoint)
            reader = _Reader(sock)
            logger.info(
                "KV events: bound %s, topic prefix %r", self._config.endpoint, self._config.topic
            )
            task_status.started()
            unknown: Counter[bytes] = Counter()
            while True:
                frames = await reader.next()
                engine = self._engine_of(frames[0][len(prefix) :]) if frames else None
                if engine is None:
                    unknown[frames[0] if frames else b""] += 1
                    if unknown[frames[0] if frames else b""] == 1:
                        logger.warning(
                            "KV events under topic %r match no engine", frames[0] if frames else b""
                        )
                    continue
                stream = self._streams.setdefault(engine.uid, _Stream())
                await self._handle(engine, stream, frames, "")
        finally:
            sock.close(linger=0)

    def _engine_of(self, address: bytes) -> Engine | None:
        """The engine a bind-mode topic names: by its host, host:port, name or URL."""
        name = address.decode(errors="replace")
        for engine in self._table:
            parts = urlsplit(engine.url)
            if name in (parts.hostname, parts.netloc, engine.name, engine.url):
                return engine
        return None
