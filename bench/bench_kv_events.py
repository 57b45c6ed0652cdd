"""What the engines' KV events cost the router's event loop, in process.

    python bench/bench_kv_events.py [--scenario replay,bind] [--batches 10000] [--blocks 2]
                                    [--runs 3]

Each batch stores `--blocks` blocks of 16 tokens and, once the cache is full, removes as many;
`--batches` of them are what vLLM's buffer (10,000 steps by default) holds after a busy while.
The engine side runs in a process of its own and sends as fast as ZMQ takes the batches.

- `replay`: the engine's replay socket (a ZMQ ROUTER answering as vLLM's publisher does) holds
  the batches, and the router's subscriber asks for all of them, as every engine's
  subscription does when a router replica starts, and as a gap does.
- `bind`: the router binds its subscriber socket (`kv_events.mode = "bind"`) and an engine
  publishes the batches to it in one burst: a backlog, as after a pause of the router's event
  loop or from many busy engines at once.

Reported: the wall time until every batch is applied, and the longest the event loop went
without running another task meanwhile (a task that does nothing but checkpoint records the
gaps between its turns): how long requests would wait.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
import zmq

from trio_router.config import KvEventsConfig
from trio_router.kv.index import BlockIndex
from trio_router.kv.subscriber import KvEvents, SubscriberCounters, _Stream
from trio_router.table import Engine, RoutingTable

BLOCK = 16
END: bytes = struct.pack(">q", -1)
TOPIC = b"kv"


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


def engine_side(
    scenario: str, port: int, count: int, blocks: int, ready: Any, go: Any, stop: Any
) -> None:
    """Another process. `replay`: answer every replay request on 127.0.0.1:`port` with the
    batches from the asked number on, then the end. `bind`: publish to the router's socket
    there, every batch (numbered from 0) each time `go` is set."""
    payloads = batches(count, blocks)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.ROUTER if scenario == "replay" else zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    if scenario == "replay":
        sock.bind(f"tcp://127.0.0.1:{port}")
    else:
        sock.connect(f"tcp://127.0.0.1:{port}")
    ready.set()
    while not stop.is_set():
        if scenario == "bind":
            if go.wait(0.05):
                go.clear()
                for seq, payload in enumerate(payloads):
                    sock.send_multipart([TOPIC + b"e", struct.pack(">q", seq), payload])
            continue
        if not sock.poll(50):
            continue
        client, _, start = sock.recv_multipart()
        for seq in range(struct.unpack(">q", start)[0], len(payloads)):
            sock.send_multipart([client, b"", b"", struct.pack(">q", seq), payloads[seq]])
        sock.send_multipart([client, b"", b"", END, b""])
    sock.close(linger=0)
    context.destroy(linger=0)


async def timed(work: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(seconds `work` took, the longest another task waited for its turn meanwhile)."""
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        start = time.perf_counter()
        await work()
        elapsed = time.perf_counter() - start
        done.set()
    return elapsed, max(gaps)


async def one_replay(port: int, count: int, go: Any) -> dict[str, Any]:
    index = BlockIndex()
    events = KvEvents(index, KvEventsConfig(replay_timeout_s=60.0), RoutingTable())
    counters = SubscriberCounters()
    filled = False

    async def replay() -> None:
        nonlocal filled
        filled = await events._replay("e", "e", _Stream(), f"tcp://127.0.0.1:{port}", 0, counters)

    try:
        elapsed, stall = await timed(replay)
    finally:
        events.close()
    assert filled and counters.batches == count, "the replay did not fill the history"
    return {"applied_ms": round(1000 * elapsed, 1), "longest_stall_ms": round(1000 * stall, 1)}


async def one_burst(port: int, count: int, go: Any) -> dict[str, Any]:
    index, table = BlockIndex(), RoutingTable()
    table.put(Engine(uid="e", name="e", url="http://127.0.0.1:8000"))
    config = KvEventsConfig(mode="bind", endpoint=f"tcp://127.0.0.1:{port}", topic="kv")
    events = KvEvents(index, config, table)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(events.run_bound)
            await trio.sleep(1.0)  # the publisher reconnects and has the subscription

            async def burst() -> None:
                go.set()
                while (c := events.counters.get("e")) is None or c.batches < count:
                    await index.wait_changed()

            elapsed, stall = await timed(burst)
            nursery.cancel_scope.cancel()
    finally:
        events.close()
    return {"applied_ms": round(1000 * elapsed, 1), "longest_stall_ms": round(1000 * stall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="replay,bind")
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    for scenario in args.scenario.split(","):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ready, go, stop = spawn.Event(), spawn.Event(), spawn.Event()
        engine = spawn.Process(
            target=engine_side,
            args=(scenario, port, args.batches, args.blocks, ready, go, stop),
        )
        engine.start()
        run = one_replay if scenario == "replay" else one_burst
        try:
            if not ready.wait(30):
                raise SystemExit("the engine side did not start")
            for _ in range(args.runs):
                result = trio.run(run, port, args.batches, go)
                print(json.dumps({"scenario": scenario, "batches": args.batches, **result}))
        finally:
            stop.set()
            engine.join(5)


if __name__ == "__main__":
    main()
