"""What a KV-event replay costs the router's event loop, in process.

    python bench/bench_kv_replay.py [--batches 10000] [--blocks 2] [--runs 3]

An engine's replay socket (a ZMQ ROUTER answering as vLLM's publisher does, in a process of its
own, as fast as ZMQ takes the batches) holds `--batches` batches, each storing `--blocks`
blocks of 16 tokens and, once the cache is full, removing as many: what vLLM's buffer (10,000
steps by default) holds after a busy while. The router's subscriber asks for all of it, as on a
new subscription (every engine's, when a router replica starts) or after a gap. Reported: the
replay's wall time, and the longest the event loop went without running another task meanwhile
(a task that does nothing but checkpoint records the gaps between its turns): how long requests
would wait.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import struct
import time
from typing import Any

import msgspec
import trio
import zmq

from trio_router.config import KvEventsConfig
from trio_router.kv.index import BlockIndex
from trio_router.kv.subscriber import KvEvents, SubscriberCounters, _Stream
from trio_router.table import RoutingTable

BLOCK = 16
END: bytes = struct.pack(">q", -1)


def batches(count: int, blocks: int, capacity: int = 4096) -> list[bytes]:
    """vLLM 0.32's batch payloads (map-encoded events)."""
    encode = msgspec.msgpack.Encoder().encode
    out: list[bytes] = []
    stored: list[int] = []
    for n in range(count):
        hashes = [n * blocks + i + 1 for i in range(blocks)]
        events: list[Any] = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": stored[-1] if stored else None,
                "token_ids": list(range(blocks * BLOCK)),
                "block_size": BLOCK,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ]
        stored.extend(hashes)
        if len(stored) > capacity:
            evicted, stored = stored[:blocks], stored[blocks:]
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        out.append(encode([time.time(), events, 0]))
    return out


def serve_replays(port: int, count: int, blocks: int, ready: Any, stop: Any) -> None:
    """Another process: answer every replay request on 127.0.0.1:`port` with the batches
    from the asked number on, then the end."""
    payloads = batches(count, blocks)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    while not stop.is_set():
        if not router.poll(50):
            continue
        client, _, start = router.recv_multipart()
        for seq in range(struct.unpack(">q", start)[0], len(payloads)):
            router.send_multipart([client, b"", b"", struct.pack(">q", seq), payloads[seq]])
        router.send_multipart([client, b"", b"", END, b""])
    router.close(linger=0)
    context.destroy(linger=0)


async def one_replay(endpoint: str) -> dict[str, float]:
    index = BlockIndex()
    events = KvEvents(index, KvEventsConfig(replay_timeout_s=60.0), RoutingTable())
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    counters = SubscriberCounters()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.lowlevel.checkpoint()
            start = time.perf_counter()
            filled = await events._replay("uid", "engine", _Stream(), endpoint, 0, counters)
            elapsed = time.perf_counter() - start
            done.set()
    finally:
        events.close()
    assert filled, "the replay did not fill the history"
    return {
        "batches": counters.batches,
        "replay_ms": round(1000 * elapsed, 1),
        "longest_stall_ms": round(1000 * max(gaps), 1),
        "blocks_held": index.blocks("uid"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    server = spawn.Process(
        target=serve_replays, args=(port, args.batches, args.blocks, ready, stop)
    )
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the replay server did not start")
        for _ in range(args.runs):
            print(json.dumps(trio.run(one_replay, f"tcp://127.0.0.1:{port}")))
    finally:
        stop.set()
        server.join(5)


if __name__ == "__main__":
    main()
