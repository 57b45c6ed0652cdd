"""Hostile clients against the real router process: what they cost, measured black box.

    python bench/bench_hostile.py [--scenario slow-reader,big-bodies,burst] [--big-body array]

Two fake engines (bench/fleet.py, fast, on 127.0.8.1 and 127.0.8.2) and the router
(`trio-router --config FILE`, static discovery, default settings but `server.drain_s`),
all on loopback; every load is bounded in count and time.

- `slow-reader`: a client asks for a long stream with a tiny receive buffer and never reads;
  the router gets SIGTERM: how long until the process has exited (goal: `drain_s` + 5 s).
- `big-bodies`: six clients each post a 30 MB JSON body at once, while another sends small
  requests: the router's peak RSS (goal: under 400 MB) and the small requests' p99 (goal:
  under 300 ms), and what the big ones got. The body is a chat whose one message is 30 MB
  of text (`--big-body text`, the default) or a small chat with a 15-million element array
  beside its messages (`--big-body array`: decoded, it would be 15 million objects).
- `burst`: 600 concurrent clients send chat requests for 8 s: outcomes, p99, and engines
  ejected (from the router's log; goal: no error, no ejection).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
import trio.lowlevel

from bench_scale import ROOT, free_port, router_command, rss_mib

ENGINE_PORT = 18810
ENGINES = ["127.0.8.1", "127.0.8.2"]
CHAT = "/v1/chat/completions"


@dataclass
class Router:
    process: trio.Process
    url: str
    log: Path


@asynccontextmanager
async def router(workdir: Path, *, drain_s: float = 5.0) -> AsyncIterator[Router]:
    spec = workdir / "fleet.json"
    spec.write_text(json.dumps({"port": ENGINE_PORT, "engines": dict.fromkeys(ENGINES, "ok")}))
    fleet = await trio.lowlevel.open_process(
        [sys.executable, str(ROOT / "bench" / "fleet.py"), str(spec)], stdout=subprocess.PIPE
    )
    assert fleet.stdout is not None
    await fleet.stdout.receive_some()  # "ready 2"
    port = free_port()
    config = workdir / "router.toml"
    urls = ", ".join(f'"http://{ip}:{ENGINE_PORT}"' for ip in ENGINES)
    config.write_text(f"""
[server]
bind = "127.0.0.1:{port}"
drain_s = {drain_s}

[discovery]
mode = "static"

[discovery.static]
urls = [{urls}]
""")
    log = workdir / "router.log"
    with log.open("wb") as log_file:
        process = await trio.lowlevel.open_process(
            [*router_command(), "--config", str(config)], stdout=log_file, stderr=subprocess.STDOUT
        )
    handle = Router(process, f"http://127.0.0.1:{port}", log)
    try:
        async with httpx.AsyncClient() as client:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get(f"{handle.url}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
        yield handle
    finally:
        for p in (process, fleet):
            if p.returncode is None:
                p.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await p.wait()


def ejections(log: Path) -> int:
    return sum("ejected" in line for line in log.read_text(errors="replace").splitlines())


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return (
        round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1)
        if ordered
        else math.nan
    )


async def slow_reader(workdir: Path) -> dict[str, Any]:
    drain_s = 5.0
    async with router(workdir, drain_s=drain_s) as r:
        host, port = r.url.removeprefix("http://").rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        body = json.dumps({"model": "fake-model", "stream": True, "messages": []}).encode()
        sock.sendall(
            b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n"
            % (CHAT.encode(), len(body))
            + body
        )
        await trio.sleep(1.0)  # the router has filled the client's buffers by now
        start = time.perf_counter()
        r.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(drain_s + 30):
            await r.process.wait()
        exited = time.perf_counter() - start if r.process.returncode is not None else None
        sock.close()
        return {
            "scenario": "slow-reader",
            "drain_s": drain_s,
            "exit_after_sigterm_s": None if exited is None else round(exited, 2),
            "exit_code": r.process.returncode,
        }


def big_body(kind: str) -> bytes:
    if kind == "array":
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        return json.dumps({**chat, "extra": [0] * 15_000_000}, separators=(",", ":")).encode()
    return json.dumps(
        {"model": "fake-model", "messages": [{"role": "user", "content": "x" * (30 * 1000 * 1000)}]}
    ).encode()


async def big_bodies(workdir: Path, *, body: str = "text") -> dict[str, Any]:
    big = big_body(body)
    async with router(workdir) as r:
        peak, small, outcomes = 0.0, [], Counter[str]()
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(base_url=r.url, timeout=60.0, limits=limits) as client:
            done = trio.Event()

            async def post_big() -> None:
                response = await client.post(
                    CHAT, content=big, headers={"content-type": "application/json"}
                )
                outcomes[str(response.status_code)] += 1

            async def post_small() -> None:
                while not done.is_set():
                    start = time.perf_counter()
                    await client.post(CHAT, json={"model": "fake-model", "messages": []})
                    small.append(time.perf_counter() - start)
                    await trio.sleep(0.02)

            async def watch_rss() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss_mib(r.process.pid))
                    await trio.sleep(0.02)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post_small)
                nursery.start_soon(watch_rss)
                async with trio.open_nursery() as bigs:
                    for _ in range(6):
                        bigs.start_soon(post_big)
                done.set()
        return {
            "scenario": "big-bodies",
            "body": body,
            "body_mb": round(len(big) / 1e6, 1),
            "big_outcomes": dict(outcomes),
            "router_peak_rss_mib": round(peak, 1),
            "small_requests": len(small),
            "small_p99_ms": p99(small),
        }


async def burst(workdir: Path, *, clients: int = 600, seconds: float = 8.0) -> dict[str, Any]:
    """Each client is its own keep-alive connection on raw sockets (a Python HTTP client
    with hundreds of connections would be the bottleneck, not the router)."""
    body = json.dumps({"model": "fake-model", "messages": []}).encode()
    request = (
        b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (CHAT.encode(), len(body)) + body
    )
    async with router(workdir) as r:
        outcomes, latencies = Counter[str](), []
        host, port = r.url.removeprefix("http://").rsplit(":", 1)
        stop = trio.current_time() + seconds

        async def one_client() -> None:
            try:
                stream = await trio.open_tcp_stream(host, int(port))
            except OSError as exc:
                outcomes[f"connect: {exc.strerror}"] += 1
                return
            async with stream:
                buffer = b""
                while trio.current_time() < stop:
                    start = time.perf_counter()
                    await stream.send_all(request)
                    while b"\r\n\r\n" not in buffer:
                        data = await stream.receive_some()
                        if not data:
                            outcomes["closed"] += 1
                            return
                        buffer += data
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    while len(buffer) < length:
                        data = await stream.receive_some()
                        if not data:
                            outcomes["closed"] += 1
                            return
                        buffer += data
                    buffer = buffer[length:]
                    outcomes[head[9:12].decode()] += 1
                    latencies.append(time.perf_counter() - start)

        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(one_client)
        total = sum(outcomes.values())
        return {
            "scenario": "burst",
            "clients": clients,
            "seconds": seconds,
            "outcomes": dict(outcomes),
            "requests_per_s": round(total / seconds),
            "p99_ms": p99(latencies),
            "ejections": ejections(r.log),
        }


async def main_async(args: argparse.Namespace) -> None:
    runs: dict[str, Callable[[Path], Awaitable[dict[str, Any]]]] = {
        "slow-reader": slow_reader,
        "big-bodies": partial(big_bodies, body=args.big_body),
        "burst": burst,
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenario.split(","):
            workdir = Path(tmp) / name
            workdir.mkdir()
            result = await runs[name](workdir)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.json_out:
        await trio.Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="slow-reader,big-bodies,burst")
    parser.add_argument("--big-body", choices=["text", "array"], default="text")
    parser.add_argument("--json-out", default="")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
