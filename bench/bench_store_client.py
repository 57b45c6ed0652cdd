"""The shared limit store's client, in process: CPU per EVALSHA of a small script, one caller
after another, against a redis-server of its own on 127.0.0.1.

    python bench/bench_store_client.py [--calls 3000]

Measures trio_router's connection (`limits.redis`: Trio transport, hiredis parsing) and, when
they are installed (they are not dependencies), the official `redis` client called from Trio
through a worker thread (and directly, for what the thread adds) and `coredis` on Trio. This
explains the choice of client; what the shared store costs the router per request is
`bench_proxy.py --limits`. Bounded: a few seconds per client.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from trio_router.limits.redis import RedisConnection, RedisURL
from trio_router.testing.redis_store import open_redis

SCRIPT = "local v = redis.call('INCR', KEYS[1]) redis.call('PEXPIRE', KEYS[1], 60000) return v"


async def timed(name: str, calls: int, call: Callable[[], Awaitable[Any]]) -> None:
    await call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await call()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name:44} {1e6 * cpu / calls:9.1f} µs CPU {1e6 * wall / calls:9.1f} µs wall")


async def main(calls: int) -> None:
    async with open_redis() as url, trio.open_nursery() as nursery:
        ours = RedisConnection(RedisURL.parse(url), connect_timeout=2.0)
        await nursery.start(ours.run)
        sha = await ours.call("SCRIPT", "LOAD", SCRIPT)
        print(f"{'client (one EVALSHA per call)':44} {'per call':>16} {'':>9}")
        await timed("trio_router (limits.redis)", calls, partial(ours.call, "EVALSHA", sha, 1, "k"))
        if importlib.util.find_spec("redis"):
            redis: Any = importlib.import_module("redis")  # not a dependency
            client = redis.Redis.from_url(url)
            limiter = trio.CapacityLimiter(4)

            async def direct() -> Any:
                return client.evalsha(sha, 1, "k")  # blocks the Trio thread: for comparison

            async def threaded() -> Any:
                return await trio.to_thread.run_sync(
                    partial(client.evalsha, sha, 1, "k"), limiter=limiter
                )

            await timed("redis (sync, called directly)", calls, direct)
            await timed("redis (sync, in a worker thread)", calls, threaded)
        if importlib.util.find_spec("coredis"):
            coredis: Any = importlib.import_module("coredis")  # not a dependency
            async with coredis.Redis.from_url(url) as core:
                await timed("coredis (anyio on Trio)", calls, partial(core.evalsha, sha, ["k"]))
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    trio.run(main, min(parser.parse_args().calls, 100_000))
