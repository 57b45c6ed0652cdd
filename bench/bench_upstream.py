"""CPU cost of the upstream client per request, against engines on 127.0.0.1.

    python bench/bench_upstream.py [--engine fake|canned|both] [--requests 3000]
                                   [--concurrency 64] [--tokens 64]

The engines run in a child process, so `time.process_time()` of this process counts only the
client: trio_router's UpstreamPool and, for comparison, one shared httpx.AsyncClient.

- `fake`: trio_router.testing's FakeEngine on Hypercorn, answering at once (streams are written
  event by event, as vLLM does), plus one streaming a token per millisecond.
- `canned`: a bare Trio server writing prepared bytes (a whole 64-event stream in one write); it
  needs little CPU, so on a small machine it disturbs the client least.

Reports requests/s and client CPU microseconds per request (and per body chunk received) for
sequential and concurrent non-streamed and streamed requests. Every run is bounded by
--max-seconds of wall time.
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

from trio_router.errors import RouterError
from trio_router.http import UpstreamPool
from trio_router.testing import FakeEngine, serve_fake_engine

CHAT = "/v1/chat/completions"
HEADERS = [
    (b"content-type", b"application/json"),
    (b"accept", b"*/*"),
    (b"user-agent", b"bench/1.0"),
    (b"x-request-id", b"0123456789abcdef"),
]

Send = Callable[[str, bool], Awaitable[int]]  # (url, streamed) -> body chunks received


def request_body(stream: bool) -> bytes:
    return json.dumps(
        {
            "model": "fake-model",
            "stream": stream,
            "messages": [{"role": "user", "content": "Say hello."}],
        }
    ).encode()


# -- engines (child process) ---------------------------------------------------------------
def canned_replies(tokens: int) -> tuple[bytes, bytes]:
    """A non-streamed reply with Content-Length and a chunked SSE reply of `tokens` events."""
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "fake-model",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "logprobs": None,
                    "message": {"role": "assistant", "content": "Hello from a fake"},
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    ).encode()
    plain = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"server: canned\r\n\r\n%s" % (len(body), body)
    )
    event = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
        b'"model":"fake-model","choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n'
    )
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(e), e) for e in [event] * tokens + [b"data: [DONE]\n\n"]
    )
    stream = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    )
    return plain, stream


async def serve_canned(tokens: int, *, task_status: trio.TaskStatus[str]) -> None:
    plain, stream = canned_replies(tokens)

    async def handle(conn: trio.SocketStream) -> None:
        buf = b""
        try:
            while data := await conn.receive_some(65536):
                buf += data
                while (end := buf.find(b"\r\n\r\n")) >= 0:
                    head = buf[:end].lower()
                    at = head.find(b"content-length:")
                    length = int(head[at + 15 :].split(b"\r\n")[0]) if at >= 0 else 0
                    if len(buf) < end + 4 + length:
                        break
                    body, buf = buf[end + 4 : end + 4 + length], buf[end + 4 + length :]
                    await conn.send_all(stream if b'"stream": true' in body else plain)
        except trio.BrokenResourceError:
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")


async def serve(kind: str, tokens: int) -> None:
    async with trio.open_nursery() as nursery:
        if kind == "canned":
            urls = [await nursery.start(serve_canned, tokens)]
        else:
            urls = [
                await nursery.start(serve_fake_engine, FakeEngine(tokens=tokens, keep_requests=1)),
                await nursery.start(
                    serve_fake_engine,
                    FakeEngine(tokens=tokens, inter_token_s=0.001, keep_requests=1),
                ),
            ]
        print(" ".join(urls), flush=True)


# -- the client (this process) ------------------------------------------------------------
async def run(
    send: Send, url: str, *, n: int, concurrency: int, stream: bool, max_seconds: float
) -> tuple[int, int, int, float, float]:
    """n requests over `concurrency` tasks; returns (requests, chunks, errors, cpu s, wall s).
    A failed request is counted and the run goes on (e.g. a stale keep-alive connection
    that a client does not retry)."""
    done = chunks = errors = 0

    async def worker() -> None:
        nonlocal done, chunks, errors
        while done < n:
            done += 1
            try:
                got = await send(url, stream)
            except (httpx.HTTPError, RouterError):
                errors += 1
                continue
            chunks += got  # not `chunks += await ...`: that reads `chunks` before the await

    cpu, wall = time.process_time(), time.perf_counter()
    with trio.move_on_after(max_seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return done, chunks, errors, time.process_time() - cpu, time.perf_counter() - wall


async def bench(kind: str, urls: list[str], args: argparse.Namespace) -> None:
    bodies = {False: request_body(False), True: request_body(True)}
    async with (
        UpstreamPool(connect_timeout=2, read_timeout=30) as pool,
        httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
        ) as client,
    ):

        async def via_pool(url: str, stream: bool) -> int:
            n = 0
            async with pool.request(url, b"POST", CHAT.encode(), HEADERS, bodies[stream]) as resp:
                async for _ in resp:
                    n += 1
            return n

        async def via_httpx(url: str, stream: bool) -> int:
            n = 0
            request = client.build_request(
                "POST", url + CHAT, content=bodies[stream], headers=HEADERS
            )
            response = await client.send(request, stream=True)
            try:
                async for _ in response.aiter_raw():
                    n += 1
            finally:
                await response.aclose()
            return n

        c = args.concurrency
        workloads = [
            ("non-streamed, sequential", urls[0], 1, False, args.requests),
            (f"non-streamed, {c} tasks", urls[0], c, False, args.requests),
            ("streamed, sequential", urls[0], 1, True, args.requests // 4),
            (f"streamed, {c} tasks", urls[0], c, True, args.requests // 4),
        ]
        if len(urls) > 1:
            workloads.append(
                (f"streamed 1 ms/token, {c} tasks", urls[1], c, True, args.requests // 4)
            )
        print(f"\nengine: {kind} ({args.tokens} events per stream); client CPU only")
        print(
            f"{'client':<6} {'workload':<30} {'requests':>8} {'errors':>6} {'req/s':>7} "
            f"{'CPU us/req':>10} {'chunks/req':>10} {'us/chunk':>8}"
        )
        for name, send in (("pool", via_pool), ("httpx", via_httpx)):
            for label, url, conc, stream, n in workloads:
                await run(
                    send,
                    url,
                    n=min(200, n),
                    concurrency=conc,
                    stream=stream,
                    max_seconds=args.max_seconds,
                )  # warm-up: connections, caches
                done, chunks, errors, cpu, wall = await run(
                    send, url, n=n, concurrency=conc, stream=stream, max_seconds=args.max_seconds
                )
                print(
                    f"{name:<6} {label:<30} {done:>8} {errors:>6} {done / wall:>7.0f} "
                    f"{cpu / done * 1e6:>10.1f} {chunks / done:>10.1f} "
                    f"{cpu / max(chunks, 1) * 1e6:>8.1f}"
                )
        print(f"pool connections opened: {pool.connections_opened}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["fake", "canned", "both"], default="both")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--serve", choices=["fake", "canned"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.serve, args.tokens)
        return
    for kind in ["canned", "fake"] if args.engine == "both" else [args.engine]:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", kind, "--tokens", str(args.tokens)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            urls = child.stdout.readline().split()
            if not urls or not all(u.startswith("http://") for u in urls):
                raise SystemExit(f"the {kind} engine did not start")
            trio.run(bench, kind, urls, args)
        finally:
            child.terminate()
            child.wait(timeout=10)


if __name__ == "__main__":
    main()
