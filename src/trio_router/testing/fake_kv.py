"""A fake engine's prefix cache and its KV-cache events, as vLLM publishes them.

`FakeKvCache` is a bounded LRU cache of fixed-size blocks of prompt tokens, chained by a hash
of the engine's own (a secret per cache: the router must never depend on reproducing it). A
prompt is served as vLLM serves one: its longest cached prefix of whole blocks is a hit (at
most all its tokens but the last), the rest is stored, evicting the least recently used blocks
when the cache is full. The cache counts queries and hits in tokens, as vLLM's
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` do.

Every change is published as vLLM does over ZMQ PUB: [topic, 8-byte big-endian sequence,
msgpack `[ts, [event...], 0]`], `BlockStored`, one-block `BlockRemoved` events (tail first),
and `AllBlocksCleared` on `reset()`; as maps with "type" (vLLM 0.32) or, with
`encoding="array"`, as positional arrays (older releases). Every batch is kept for replay, on
a ROUTER socket answering [b"", start] with [b"", topic, seq, payload] per batch from `start`
and [b"", b"", -1, b""] at the end. Knobs break the stream the ways a network or a restart
does: `drop_next` (batches numbered but never sent: a gap), `restart()` (the sequence and the
cache start again, as a restarted engine's).

`open_fake_kv(cache, host, port)` binds the publisher (and the replay socket on
`replay_port`) on `host`; sockets are driven from the Trio thread (no threads).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import trio
import zmq

__all__ = ["FakeKvCache", "open_fake_kv"]

_SEQ: Final = struct.Struct(">q")
_encode: Final = msgspec.msgpack.Encoder().encode


@dataclass(eq=False)
class FakeKvCache:
    """See the module's docstring."""

    port: int = 0  # the publisher's port (on the engine's host); 0: not published
    replay_port: int = 0  # the replay socket's port; 0: none
    block_size: int = 4
    capacity: int = 64  # blocks
    encoding: str = "map"  # "map" (vLLM 0.32) or "array" (older releases)
    topic: bytes = b""
    drop_next: int = 0  # the next this many batches are numbered but not sent
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(8))
    # observations
    queries: int = 0  # prompt tokens asked of the cache
    hits: int = 0  # of them, found cached
    _blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)  # hash -> parent, LRU
    _seq: int = 0
    history: list[tuple[int, bytes]] = field(default_factory=list)  # (seq, payload) published
    socket: zmq.Socket[bytes] | None = None  # the publisher, while open_fake_kv runs

    def chain(self, tokens: Sequence[int]) -> list[int]:
        """This engine's hashes of the full blocks of `tokens` (its own secret chain)."""
        out: list[int] = []
        parent = b""
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = struct.pack(f"<{size}Q", *tokens[start : start + size])
            parent = hashlib.blake2b(self.secret + parent + block, digest_size=8).digest()
            out.append(int.from_bytes(parent, "big"))
        return out

    def serve(self, tokens: Sequence[int]) -> int:
        """Serve a prompt: returns the tokens found cached; stores the rest, evicting, and
        publishes what changed."""
        hashes = self.chain(tokens)
        size = self.block_size
        self.queries += len(tokens)
        hit = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            hit += 1
        cached = min(hit * size, max(0, len(tokens) - 1))
        self.hits += cached
        events: list[Any] = []
        stored = hashes[hit:]
        for block_hash in stored:
            self._make_room(events)
            self._blocks[block_hash] = 0
        if stored:
            parent = hashes[hit - 1] if hit else None
            events.append(
                self._event(
                    "BlockStored",
                    block_hashes=stored,
                    parent_block_hash=parent,
                    token_ids=list(tokens[hit * size : len(hashes) * size]),
                    block_size=size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            )
        if events:
            self.publish(events)
        return cached

    def _make_room(self, events: list[Any]) -> None:
        while len(self._blocks) >= self.capacity:
            evicted, _ = self._blocks.popitem(last=False)
            events.append(self._event("BlockRemoved", block_hashes=[evicted], medium="GPU"))

    def holds(self, tokens: Sequence[int]) -> int:
        """Leading full blocks of `tokens` cached now."""
        count = 0
        for block_hash in self.chain(tokens):
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def reset(self) -> None:
        """Empty the cache (vLLM's /reset_prefix_cache): AllBlocksCleared."""
        self._blocks.clear()
        self.publish([self._event("AllBlocksCleared")])

    def restart(self) -> None:
        """As a restarted engine: an empty cache, a new secret, the sequence from 0 again."""
        self._blocks.clear()
        self.secret = secrets.token_bytes(8)
        self._seq = 0
        self.history.clear()

    def _event(self, kind: str, **fields: Any) -> Any:
        if self.encoding == "map":
            return {"type": kind, **fields}
        order = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
            "AllBlocksCleared": (),
        }[kind]
        return [kind, *(fields[name] for name in order)]

    def publish(self, events: list[Any]) -> None:
        """One batch: numbered, kept for replay, and sent (unless dropped on purpose)."""
        seq = self._seq
        self._seq += 1
        payload = _encode([time.time(), events, 0])
        self.history.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        if self.socket is not None:
            self.socket.send_multipart([self.topic, _SEQ.pack(seq), payload], zmq.NOBLOCK)


@asynccontextmanager
async def open_fake_kv(
    cache: FakeKvCache, host: str, port: int, *, replay_port: int = 0
) -> AsyncIterator[FakeKvCache]:
    """Publish `cache`'s events on tcp://host:port (and answer replays on `replay_port`)
    until the block ends."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(f"tcp://{host}:{port}")
    cache.socket = publisher
    try:
        async with trio.open_nursery() as nursery:
            if replay_port:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(f"tcp://{host}:{replay_port}")
                nursery.start_soon(_answer_replays, cache, router)
            yield cache
            nursery.cancel_scope.cancel()
    finally:
        cache.socket = None
        context.destroy(linger=0)


async def _answer_replays(cache: FakeKvCache, router: zmq.Socket[bytes]) -> None:
    fd = int(router.getsockopt(zmq.FD))
    try:
        while True:
            try:
                identity, _, start = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await trio.lowlevel.wait_readable(fd)
                continue
            (first,) = _SEQ.unpack(start)
            for seq, payload in list(cache.history):
                if seq >= first:
                    router.send_multipart(
                        [identity, b"", cache.topic, _SEQ.pack(seq), payload], zmq.NOBLOCK
                    )
            router.send_multipart([identity, b"", b"", _SEQ.pack(-1), b""], zmq.NOBLOCK)
    finally:
        router.close(linger=0)
