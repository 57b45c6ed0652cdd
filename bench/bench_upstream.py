"""CPU cost of the upstream client per request, against a fake engine on 127.0.0.1.

    python bench/bench_upstream.py [--requests 3000] [--concurrency 64] [--tokens 64]

The fake engine (trio_router.testing on Hypercorn, answering at once) runs in a child process,
so `time.process_time()` of this process counts only the client: UpstreamPool, and for
comparison one shared httpx.AsyncClient. Reports CPU microseconds per request (and per
streamed event) for sequential and concurrent non-streamed requests and for streamed ones.
Bounded: every run stops after --max-seconds of wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import trio

from trio_router.proxy import UpstreamPool
from trio_router.testing import FakeEngine, serve_fake_engine

CHAT = "/v1/chat/completions"


def body(stream: bool) -> bytes:
    return json.dumps({"model": "fake-model", "stream": stream,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()


HEADERS = [(b"content-type", b"application/json"), (b"accept", b"*/*"),
           (b"user-agent", b"bench/1.0"), (b"x-request-id", b"0123456789abcdef")]

Send = Callable[[bool], Awaitable[int]]  # one request (streamed or not) -> chunks received


async def run(send: Send, *, n: int, concurrency: int, stream: bool,
              max_seconds: float) -> tuple[int, int, float, float]:
    """n requests over `concurrency` tasks; returns (requests, chunks, cpu s, wall s)."""
    done = chunks = 0

    async def worker() -> None:
        nonlocal done, chunks
        while done < n:
            done += 1
            got = await send(stream)
            chunks += got  # not `chunks += await ...`: that reads `chunks` before the await

    cpu, wall = time.process_time(), time.perf_counter()
    with trio.move_on_after(max_seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return done, chunks, time.process_time() - cpu, time.perf_counter() - wall


async def bench(url: str, args: argparse.Namespace) -> None:
    bodies = {False: body(False), True: body(True)}
    async with UpstreamPool(connect_timeout=2, read_timeout=30) as pool, httpx.AsyncClient(
            base_url=url, timeout=30, limits=httpx.Limits(max_connections=None)) as client:

        async def via_pool(stream: bool) -> int:
            n = 0
            async with pool.request(url, b"POST", CHAT.encode(), HEADERS,
                                    bodies[stream]) as resp:
                async for _ in resp:
                    n += 1
            return n

        async def via_httpx(stream: bool) -> int:
            n = 0
            request = client.build_request("POST", CHAT, content=bodies[stream],
                                           headers=HEADERS)
            response = await client.send(request, stream=True)
            try:
                async for _ in response.aiter_raw():
                    n += 1
            finally:
                await response.aclose()
            return n

        print(f"fake engine {url}: {args.tokens} tokens per streamed reply; "
              f"client CPU per request (this process only)")
        print(f"{'client':<8} {'workload':<26} {'requests':>8} {'req/s':>8} "
              f"{'CPU us/req':>10} {'us/event':>9}")
        for name, send in (("pool", via_pool), ("httpx", via_httpx)):
            for label, conc, stream in (("non-streamed, sequential", 1, False),
                                        (f"non-streamed, {args.concurrency} tasks",
                                         args.concurrency, False),
                                        ("streamed, sequential", 1, True),
                                        (f"streamed, {args.concurrency} tasks",
                                         args.concurrency, True)):
                await run(send, n=min(200, args.requests), concurrency=conc, stream=stream,
                          max_seconds=args.max_seconds)  # warm-up: connections, caches
                n, chunks, cpu, wall = await run(send, n=args.requests, concurrency=conc,
                                                 stream=stream, max_seconds=args.max_seconds)
                per_event = f"{cpu / chunks * 1e6:9.1f}" if stream and chunks else f"{'':9}"
                print(f"{name:<8} {label:<26} {n:>8} {n / wall:>8.0f} "
                      f"{cpu / n * 1e6:>10.1f} {per_event}")
        print(f"pool connections opened: {pool.connections_opened}")


async def serve(tokens: int) -> None:
    engine = FakeEngine(tokens=tokens, keep_requests=1)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_fake_engine, engine)
        print(url, flush=True)
        await trio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.tokens)
        return
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--tokens", str(args.tokens)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        url = child.stdout.readline().strip()
        if not url.startswith("http://"):
            raise SystemExit(f"fake engine did not start (got {url!r})")
        trio.run(bench, url, args)
    finally:
        child.terminate()
        child.wait(timeout=10)


if __name__ == "__main__":
    main()
