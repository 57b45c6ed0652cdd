"""One emulated engine's KV-cache events over ZMQ, as vLLM 0.32's `ZmqEventPublisher` sends
them: a PUB socket, one message per step that changed the cache, and a ROUTER socket that
replays what is still buffered.

- A message is three frames: the topic, an 8-byte big-endian sequence number (from 0, one
  per batch) and the msgpack batch (`kv_events.encode_batch`).
- The PUB socket binds a wildcard, ipc:// or inproc:// endpoint and connects to any other
  (vLLM's rule), with the config's `hwm` as its send high-water mark: a subscriber that falls
  that far behind loses messages, as from vLLM.
- The last `buffer_steps` batches are kept. A replay request on the ROUTER socket at
  `replay_endpoint` (a DEALER sends an empty frame and an 8-byte start sequence) is answered
  with `[b"", topic, seq, payload]` per buffered batch from that number on, then
  `[b"", b"", seq -1, b""]`.

The sockets are driven from the Trio thread (each socket's `zmq.FD` awaited with
`trio.lowlevel.wait_readable`); `publish` is synchronous and never blocks.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import trio
import zmq

from .kv_events import KVCacheEvent, KvEndpoints, KvEventsConfig, encode_batch

__all__ = ["KvPublisher", "open_kv_publisher"]

logger = logging.getLogger(__name__)

_SEQ: Final = struct.Struct(">q")
_END: Final = _SEQ.pack(-1)
BIND_RETRY_S: Final = 2.0  # how long an endpoint in use is tried again (see _bind)


class KvPublisher:
    """Numbers, buffers and sends an engine's batches (see the module)."""

    def __init__(self, socket: zmq.Socket[bytes], topic: str, buffer_steps: int) -> None:
        self._socket, self._topic = socket, topic.encode()
        self._next = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)

    @property
    def topic(self) -> bytes:
        return self._topic

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch (the step's events) and keep it for replay."""
        seq, self._next = self._next, self._next + 1
        payload = encode_batch(time.time(), events)
        self.buffer.append((seq, payload))
        # A PUB drops what a subscriber cannot take; it never blocks, nor raises here.
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart([self._topic, _SEQ.pack(seq), payload], zmq.NOBLOCK)

    def replay(self, start: int) -> list[list[bytes]]:
        """The answer to a replay request from `start`: every buffered batch from it on,
        then the end marker (without the requester's identity)."""
        frames = [
            [b"", self._topic, _SEQ.pack(seq), payload]
            for seq, payload in self.buffer
            if seq >= start
        ]
        frames.append([b"", b"", _END, b""])
        return frames


@asynccontextmanager
async def open_kv_publisher(
    config: KvEventsConfig, where: KvEndpoints, context: zmq.Context[zmq.Socket[bytes]]
) -> AsyncIterator[KvPublisher]:
    """Open the PUB socket at `where` (and the replay socket, answered by a task here), with
    `config`'s high-water mark and buffer, until the block ends; leaving it closes both.
    Raises OSError if an endpoint cannot be bound (taken) or is malformed."""
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.setsockopt(zmq.SNDHWM, config.hwm)
    replay: zmq.Socket[bytes] | None = None
    try:
        try:
            if where.bind:
                await _bind(publisher, where.publish)
            else:
                publisher.connect(where.publish)
            if where.replay is not None:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                await _bind(replay, where.replay)
        except zmq.ZMQError as exc:
            raise OSError(
                f"cannot open the KV-event sockets at {where.publish} (replay {where.replay}): "
                f"{exc}"
            ) from exc
        logger.info("KV events on %s (replay %s)", where.publish, where.replay)
        kv = KvPublisher(publisher, where.topic, config.buffer_steps)
        async with trio.open_nursery() as nursery:
            if replay is not None:
                nursery.start_soon(_answer_replays, kv, replay)
            yield kv
            nursery.cancel_scope.cancel(reason="KV events closed")
    finally:
        publisher.close(linger=0)
        if replay is not None:
            replay.close(linger=0)


async def _bind(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Bind `endpoint`, trying again for up to BIND_RETRY_S while it is in use: the sockets of
    an engine this one replaces (a restart after a kill) are released by ZMQ's I/O thread
    some time after their close returns, and nothing signals when."""
    with trio.move_on_after(BIND_RETRY_S):
        while True:
            try:
                sock.bind(endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
            await trio.sleep(BIND_RETRY_S / 100)
    sock.bind(endpoint)  # the last try: its error is the caller's


async def _answer_replays(kv: KvPublisher, replay: zmq.Socket[bytes]) -> None:
    """Answer replay requests until cancelled; malformed ones are ignored, as by vLLM."""
    fd = int(replay.getsockopt(zmq.FD))
    while True:
        try:
            frames = replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await trio.lowlevel.wait_readable(fd)
            continue
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("invalid KV-event replay request: %d frames", len(frames))
            continue
        identity, _, start = frames
        for answer in kv.replay(_SEQ.unpack(start)[0]):
            try:
                replay.send_multipart([identity, *answer], zmq.NOBLOCK)
            except zmq.Again:  # the requester stopped reading: the rest is dropped
                break
