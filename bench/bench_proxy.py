"""Load run of the whole router process: req/s, latency and router CPU per request.

    python bench/bench_proxy.py [--duration 15] [--connections 64] [--policy NAME] [--profile]
    python bench/bench_proxy.py --all-policies [--duration 10]
    python bench/bench_proxy.py --limits [--duration 10] [--repeat 3]

Three processes on 127.0.0.1: fake engines (two listeners in one lean Trio process that answers
at once with canned vLLM-like replies), the router (`python -m trio_router --config ...`,
static discovery of those engines) and the load generator (`wrk` if installed, else a Python
generator in its own process). Scenarios, each for --duration seconds after a short warm-up:

- chat: non-streamed chat completion (~400-byte JSON reply)
- stream64: streamed chat completion of 64 SSE events that the engine answers at once (the
  whole event stream in one write)
- stream64-paced: the same 64 events as a token stream: the first 20 ms after the request, the
  others 5 ms apart, each its own chunk, so the router forwards each one on its own (the
  per-event cost, which the relay keeps low for HTTP/1.1 clients)
- baseline: Hypercorn's trio worker serving a fixed answer (no proxying), for comparison, once
  as released and once on trio_router's own connections (`hypercorn_seam.serve`)

Router CPU is utime+stime of its process from /proc/<pid>/stat, divided by the requests
completed. `--profile` runs the router under cProfile for the chat and stream64 scenarios and
prints where its time goes. `--policy` sets `routing.policy` (default round_robin).
`--all-policies` runs only the non-streamed scenario, once per policy, each on a fresh router
process, with a request that carries a session key (`"user"`) and a 2-chunk prompt, so that
`session` and `prefix_aware` do their full work rather than fall back to least_loaded; it prints
one row per policy. `--limits` runs only the non-streamed scenario for a tenant with limits
(a request rate and a concurrency bound it never reaches), on a fresh router each: with no
tenants, with local limits, and with `[limits] store = "redis"` (a redis-server on loopback
started for the run); it prints the router's CPU per request and the store's. Bounded: every
scenario stops after --duration seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from trio_router.asgi import answer_lifespan
from trio_router.config import POLICIES

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
MODEL: Final = "bench-model"
CHAT_BODY: Final = (
    '{"model":"bench-model","messages":[{"role":"user","content":'
    '"Say hello to the benchmark."}],"max_tokens":64}'
)
STREAM_BODY: Final = CHAT_BODY[:-1] + ',"stream":true}'
# --all-policies: the non-streamed chat with a session key and a system prompt of two full
# prefix chunks (routing.prefix_chunk_chars = 256), so every policy takes its full path.
POLICY_BODY: Final = (
    '{"model":"bench-model","user":"bench-user","messages":[{"role":"system",'
    '"content":"'
    + "You are a helpful assistant for the benchmark. "
    * 12
    + '"},{"role":"user","content":"Say hello to the benchmark."}],'
    '"max_tokens":64}'
)
EVENTS: Final = 64

_REPLY = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,'
    b'"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"Hello, benchmark! This is a canned reply from a fake engine that '
    b'answers at once.","tool_calls":[]},"logprobs":null,"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":20,"total_tokens":32}}'
)
REPLY: Final = (
    b"HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(_REPLY), _REPLY)
)
STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
    b"server: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# A streamed chat as vLLM writes it: the role first, then one event per token (the last one
# with the finish, "length"), then [DONE]; each event with its token ids when the request
# asked (`"return_token_ids": true`, what `proxy.resume` asks for and follows), else with
# `null` in their place (as vLLM writes them then): one stream either way, whatever the
# router asks. The role comes with the head (a stream's first bytes), the tokens each in its
# own chunk (see `_stream`).
_FIRST = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null}\n\n'
)
_EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","choices":[{"index":0,"delta":{"content":" token"},'
    b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
)
_PROMPT_IDS = b"[%s]" % b",".join(b"%d" % (1000 + i) for i in range(12))
FIRST_CHUNK: Final = _chunk(_FIRST)
FIRST_WITH_IDS_CHUNK: Final = _chunk(_FIRST.replace(b"null}\n", _PROMPT_IDS + b"}\n"))
EVENT_CHUNK: Final = _chunk(_EVENT)
EVENT_WITH_IDS_CHUNK: Final = _chunk(_EVENT.replace(b"null}]}", b"[31337]}]}"))
# --serve-reasoning: the first half of the tokens are reasoning (vLLM's `--reasoning-parser`).
REASONING_CHUNK: Final = _chunk(_EVENT.replace(b'"content"', b'"reasoning"'))
REASONING_WITH_IDS_CHUNK: Final = _chunk(
    _EVENT.replace(b'"content"', b'"reasoning"').replace(b"null}]}", b"[31337]}]}")
)
_LAST = _EVENT.replace(b'null,"token_ids"', b'"length","stop_reason":null,"token_ids"')
LAST_CHUNK: Final = _chunk(_LAST)
LAST_WITH_IDS_CHUNK: Final = _chunk(_LAST.replace(b"null}]}", b"[31337]}]}"))
DONE_CHUNK: Final = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
REASONING = False  # set by --serve-reasoning
TOKENS = EVENTS  # a stream's token events; set by --serve-tokens
_MODELS = (
    b'{"object":"list","data":[{"id":"bench-model","object":"model","created":0,'
    b'"owned_by":"vllm","root":"bench-model","parent":null,"max_model_len":4096}]}'
)
MODELS: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
    b"\r\n\r\n%s" % (len(_MODELS), _MODELS)
)
NOT_FOUND: Final = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")


# -- child process: the fake engines ------------------------------------------------------------
async def _engine_connection(gap_s: float, stream: trio.SocketStream) -> None:
    """A keep-alive HTTP/1.1 connection answered with canned bytes (no parsing beyond
    Content-Length): the engine costs as little CPU as possible."""
    with contextlib.suppress(trio.BrokenResourceError):  # a load generator stopping
        await _answer(gap_s, stream)


async def _answer(gap_s: float, stream: trio.SocketStream) -> None:
    buffer = b""
    async with stream:
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
            head, _, rest = buffer.partition(b"\r\n\r\n")
            match = _LENGTH.search(head)
            length = int(match.group(1)) if match else 0
            while len(rest) < length:
                data = await stream.receive_some(65536)
                if not data:
                    return
                rest += data
            body, buffer = rest[:length], rest[length:]
            if head.startswith(b"GET /v1/models "):
                await stream.send_all(MODELS)
            elif head.startswith(b"GET "):
                await stream.send_all(NOT_FOUND)
            elif b'"stream":true' in body:
                await _stream(stream, gap_s, ids=b'"return_token_ids":true' in body)
            else:
                await stream.send_all(REPLY)


async def _stream(stream: trio.SocketStream, gap_s: float, *, ids: bool) -> None:
    """A streamed chat (its token ids when `ids`): the head and the role at once, then after
    the time to first token the tokens, `gap_s` apart (at once, in one write, when 0)."""
    if ids:
        first, token, thought = FIRST_WITH_IDS_CHUNK, EVENT_WITH_IDS_CHUNK, REASONING_WITH_IDS_CHUNK
    else:
        first, token, thought = FIRST_CHUNK, EVENT_CHUNK, REASONING_CHUNK
    last = LAST_WITH_IDS_CHUNK if ids else LAST_CHUNK
    if not REASONING:
        thought = token
    tokens = [thought] * (TOKENS // 2) + [token] * (TOKENS - TOKENS // 2 - 1) + [last]
    await stream.send_all(STREAM_HEAD + first)
    if not gap_s:
        await stream.send_all(b"".join(tokens) + DONE_CHUNK)
        return
    await trio.sleep(TTFT_S - gap_s)
    for chunk in tokens:
        await trio.sleep(gap_s)
        await stream.send_all(chunk)
    await stream.send_all(DONE_CHUNK)


async def _serve_engines(count: int, gap_s: float) -> None:
    async with trio.open_nursery() as nursery:
        ports = []
        for _ in range(count):
            listeners = await nursery.start(
                partial(trio.serve_tcp, partial(_engine_connection, gap_s), 0, host="127.0.0.1")
            )
            ports.append(listeners[0].socket.getsockname()[1])
        print(" ".join(map(str, ports)), flush=True)


# -- child process: the baseline ------------------------------------------------------------
async def _baseline_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(_REPLY)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": _REPLY})


async def _serve_baseline(kind: str) -> None:
    import hypercorn.config
    import hypercorn.trio

    from trio_router.serving import hypercorn_seam

    # "lean": Hypercorn's protocols on trio_router's connections, nothing else of it.
    serve = hypercorn_seam.serve if kind == "lean" else hypercorn.trio.serve
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.keep_alive_timeout = 75.0
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            app: Any = _baseline_app  # plain-dict ASGI typing, not hypercorn's TypedDicts
            urls = await nursery.start(partial(serve, app, config, shutdown_trigger=stop.wait))
            print(urls[0], flush=True)
            async for _ in signals:
                stop.set()
                break


# -- the harness ----------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid`, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Result:
    name: str
    requests: int
    errors: int
    seconds: float
    cpu_s: float
    p50_ms: float
    p99_ms: float
    rss_mb: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_s / max(1, self.requests)


@contextmanager
def child(
    args: list[str], *, stderr_path: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """A child process (stdout piped, text, `env` added), terminated with SIGTERM at the
    end."""
    err = stderr_path.open("w") if stderr_path else subprocess.DEVNULL
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})}
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if stderr_path is not None:
            err.close()  # type: ignore[union-attr]


def wait_for_line(path: Path, pattern: str, *, timeout: float, count: int = 1) -> None:
    """Block until `pattern` occurs `count` times in the file `path` (a child's log)."""
    deadline = time.monotonic() + timeout
    while len(re.findall(pattern, path.read_text())) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {pattern!r}:\n{path.read_text()}")
        time.sleep(0.05)


def run_wrk(
    url: str, body: str, *, connections: int, duration: float
) -> tuple[int, int, float, float, float]:
    """(requests, errors, seconds, p50 ms, p99 ms) of one wrk run."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = '{body}'\n"
        )
        if AUTHORIZATION:
            script.write(f'wrk.headers["Authorization"] = "{AUTHORIZATION}"\n')
    try:
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{connections}",
                f"-d{duration:g}s",
                "--latency",
                "-s",
                script.name,
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=duration + 30,
        ).stdout
    finally:
        os.unlink(script.name)
    requests = int(re.search(r"(\d+) requests in ([\d.]+)(m?s)", out).group(1))  # type: ignore[union-attr]
    span = re.search(r"requests in ([\d.]+)(m?s)", out)
    assert span is not None
    seconds = float(span.group(1)) / (1000 if span.group(2) == "ms" else 1)
    errors = 0
    for pattern in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: .*?(\d+) timeout"):
        if m := re.search(pattern, out):
            errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return requests, errors, seconds, _percentile(out, "50"), _percentile(out, "99")


def _percentile(out: str, which: str) -> float:
    m = re.search(rf"^\s*{which}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    assert m is not None, out
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_python_load(
    url: str, body: str, *, connections: int, duration: float
) -> tuple[int, int, float, float, float]:
    """The fallback load generator (no wrk): httpx in a child process."""
    code = f"""
import json, sys, time, trio, httpx
async def main():
    lat, errors = [], 0
    end = trio.current_time() + {duration}
    async def worker(client):
        nonlocal errors
        while trio.current_time() < end:
            t = time.perf_counter()
            r = await client.post({url!r}, content={body!r}.encode(),
                                  headers={{"content-type": "application/json"}})
            await r.aread()
            errors += r.status_code != 200
            lat.append(time.perf_counter() - t)
    limits = httpx.Limits(max_connections={connections}, max_keepalive_connections={connections})
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        start = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range({connections}):
                n.start_soon(worker, client)
        span = time.perf_counter() - start
    lat.sort()
    print(json.dumps([len(lat), errors, span, lat[len(lat) // 2] * 1000,
                      lat[int(len(lat) * 0.99)] * 1000]))
trio.run(main)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=duration + 60,
    ).stdout
    n, errors, span, p50, p99 = json.loads(out)
    return n, errors, span, p50, p99


def load(
    url: str, body: str, *, connections: int, duration: float
) -> tuple[int, int, float, float, float]:
    if shutil.which("wrk"):
        return run_wrk(url, body, connections=connections, duration=duration)
    return run_python_load(url, body, connections=connections, duration=duration)


ACCESS_LOG = True  # the router's access record per request (--no-access-log: off)
AUTHORIZATION = ""  # sent with every request (--limits: the tenant's key)
TENANT_KEY: Final = "bench-tenant-key"
TTFT_S = 0.020  # paced streams: the first event this long after the request
REPEAT = 1  # runs per scenario (--repeat); the median run by CPU per request is reported


def measure(
    name: str, pid: int, url: str, body: str, *, connections: int, duration: float
) -> Result:
    load(url, body, connections=connections, duration=min(2.0, duration))  # warm-up
    runs = []
    for _ in range(REPEAT):
        before = cpu_seconds(pid)
        requests, errors, seconds, p50, p99 = load(
            url, body, connections=connections, duration=duration
        )
        runs.append(
            Result(
                name, requests, errors, seconds, cpu_seconds(pid) - before, p50, p99, rss_mb(pid)
            )
        )
    runs.sort(key=lambda r: r.cpu_ms_per_request)
    return runs[len(runs) // 2]


def router_config(
    ports: list[str], path: Path, *, policy: str = "round_robin", extra: str = ""
) -> Path:
    urls = ", ".join(f'"http://127.0.0.1:{p}"' for p in ports)
    path.write_text(f"""
[routing]
policy = "{policy}"
[server]
bind = "127.0.0.1:0"
drain_s = 5.0
access_log = {"true" if ACCESS_LOG else "false"}
[discovery]
mode = "static"
[discovery.static]
urls = [{urls}]
[probe]
interval_s = 10.0
[stats]
interval_s = 0.0
{extra}""")
    return path


def bench_router(
    tmp: Path,
    *,
    gap_s: float,
    scenarios: list[tuple[str, str]],
    connections: int,
    duration: float,
    profile: Path | None,
    policy: str = "round_robin",
    extra: str = "",
    env: dict[str, str] | None = None,
) -> list[Result]:
    """Engines + router with `policy` and `extra` config (optionally under cProfile); run
    `scenarios` against the router."""
    me = [sys.executable, __file__]
    with child([*me, "--serve-engines", str(gap_s)]) as engines:
        assert engines.stdout is not None
        ports = engines.stdout.readline().split()
        config = router_config(ports, tmp / "router.toml", policy=policy, extra=extra)
        log = tmp / f"router-{time.monotonic_ns()}.log"
        prefix = [sys.executable]
        if profile is not None:
            prefix += ["-m", "cProfile", "-o", str(profile)]
        with child(
            [*prefix, "-m", "trio_router", "--config", str(config), "--log-level", "info"],
            stderr_path=log,
            env=env,
        ) as router:
            wait_for_line(log, r"is routable", timeout=30, count=len(ports))
            wait_for_line(log, r"Running on http://", timeout=30)
            url_match = re.search(r"Running on (http://\S+)", log.read_text())
            assert url_match is not None
            url = url_match.group(1) + "/v1/chat/completions"
            return [
                measure(name, router.pid, url, body, connections=connections, duration=duration)
                for name, body in scenarios
            ]


def soak(tmp: Path, *, connections: int, seconds: float, policy: str) -> None:
    """Non-streamed load for `seconds`, in consecutive 15 s windows on one router process."""
    global REPEAT
    REPEAT = 1
    windows = max(1, round(seconds / 15))
    scenarios = [(f"chat, window {i + 1} of {windows}", CHAT_BODY) for i in range(windows)]
    results = bench_router(
        tmp,
        gap_s=0.0,
        scenarios=scenarios,
        connections=connections,
        duration=seconds / windows,
        profile=None,
        policy=policy,
    )
    print(
        f"\n{'window':34} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>11} "
        f"{'RSS MiB':>8}"
    )
    for r in results:
        print(
            f"{r.name:34} {r.rps:8.0f} {r.p50_ms:8.1f} {r.p99_ms:8.1f} "
            f"{r.cpu_ms_per_request:11.3f} {r.rss_mb:8.1f}"
        )


def bench_policies(tmp: Path, *, connections: int, duration: float) -> None:
    """The non-streamed scenario once per routing policy, each on a fresh router process."""
    results = [
        bench_router(
            tmp,
            gap_s=0.0,
            scenarios=[(policy, POLICY_BODY)],
            connections=connections,
            duration=duration,
            profile=None,
            policy=policy,
        )[0]
        for policy in POLICIES
    ]
    print(
        f"\n{'policy (non-streamed chat)':34} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU ms/req':>11} {'errors':>7}"
    )
    for r in results:
        print(
            f"{r.name:34} {r.rps:8.0f} {r.p50_ms:8.1f} {r.p99_ms:8.1f} "
            f"{r.cpu_ms_per_request:11.3f} {r.errors:7d}"
        )


REDIS_EPHEMERAL: Final = ("--save", "", "--appendonly", "no")  # nothing written to disk
LIMITS_TENANT: Final = """
[[tenants]]
name = "bench"
key_env = "BENCH_TENANT_KEY"
requests_per_minute = 100000000
max_concurrent = 100000
"""


def bench_limits(tmp: Path, *, connections: int, duration: float) -> None:
    """The non-streamed scenario for one tenant: no tenants, local limits, the shared store
    (a redis-server of its own on 127.0.0.1, its CPU per request counted too)."""
    global AUTHORIZATION
    port = free_port()
    redis = subprocess.Popen(
        [*("redis-server", "--port", str(port), "--bind", "127.0.0.1"), *REDIS_EPHEMERAL],
        stdout=subprocess.DEVNULL,
    )
    try:
        env = {"BENCH_TENANT_KEY": TENANT_KEY, "BENCH_STORE": f"redis://127.0.0.1:{port}/0"}
        rows = []
        for name, extra in (
            ("no tenants", ""),
            ("tenant, local limits", LIMITS_TENANT),
            (
                "tenant, shared store (redis)",
                LIMITS_TENANT + '[limits]\nstore = "redis"\nredis_url_env = "BENCH_STORE"\n',
            ),
        ):
            AUTHORIZATION = f"Bearer {TENANT_KEY}" if extra else ""
            store_before = cpu_seconds(redis.pid)
            (result,) = bench_router(
                tmp,
                gap_s=0.0,
                scenarios=[(name, CHAT_BODY)],
                connections=connections,
                duration=duration,
                profile=None,
                extra=extra,
                env=env,
            )
            store = cpu_seconds(redis.pid) - store_before
            rows.append((result, store))
    finally:
        AUTHORIZATION = ""
        redis.terminate()
        redis.wait(timeout=10)
    print(
        f"\n{'non-streamed chat':34} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU ms/req':>11} {'store ms/req':>13} {'errors':>7}"
    )
    for r, store in rows:
        runs = REPEAT + 1  # the warm-up run also reached the store
        store_ms = 1000 * store / max(1, r.requests * runs)
        print(
            f"{r.name:34} {r.rps:8.0f} {r.p50_ms:8.1f} {r.p99_ms:8.1f} "
            f"{r.cpu_ms_per_request:11.3f} {store_ms:13.3f} {r.errors:7d}"
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


BASELINES: Final = {
    "stock": "baseline (hypercorn, fixed answer)",
    "lean": "  the same, trio_router's connection",
}


def bench_baseline(kind: str, *, connections: int, duration: float) -> Result:
    with child([sys.executable, __file__, "--serve-baseline", kind]) as server:
        assert server.stdout is not None
        url = server.stdout.readline().strip() + "/v1/chat/completions"
        return measure(
            BASELINES[kind], server.pid, url, CHAT_BODY, connections=connections, duration=duration
        )


def print_profile(path: Path, *, top: int = 25) -> None:
    import pstats

    stats = pstats.Stats(str(path))
    total = sum(entry[2] for entry in stats.stats.values())  # type: ignore[attr-defined]
    print(f"\nWhere the router's time goes (cProfile, tottime; {total:.1f} s profiled):")
    by_module: dict[str, float] = {}
    for (filename, _, _), entry in stats.stats.items():  # type: ignore[attr-defined]
        key = _module_of(filename)
        by_module[key] = by_module.get(key, 0.0) + entry[2]
    for key, seconds in sorted(by_module.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {100 * seconds / total:5.1f}%  {key}")
    print(f"\nTop {top} functions by own time:")
    stats.sort_stats("tottime").print_stats(top)


def _module_of(filename: str) -> str:
    for marker in ("site-packages/", "trio_router/", "python3.11/"):
        if marker in filename:
            rest = filename.split(marker, 1)[1]
            if marker == "trio_router/":
                return "trio_router/" + rest
            return rest.split("/", 1)[0]
    return filename


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration",
        type=float,
        default=15.0,
        help="seconds per scenario (default 15; capped at 120)",
    )
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per scenario; the median by CPU per request is reported",
    )
    parser.add_argument(
        "--soak",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="only a long non-streamed run (at most 300 s), reported per "
        "15 s window, to show whether the router slows down over time",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="round_robin",
        help="routing.policy of the router (default round_robin)",
    )
    parser.add_argument(
        "--all-policies",
        action="store_true",
        help="only the non-streamed scenario, once per policy, one row each",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="only the non-streamed scenario: no tenants, local limits, the shared store",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the router with cProfile and print the hot spots",
    )
    parser.add_argument(
        "--no-access-log", action="store_true", help="run the router with server.access_log = false"
    )
    parser.add_argument("--serve-engines", type=float, metavar="GAP_S", help=argparse.SUPPRESS)
    parser.add_argument("--serve-reasoning", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-tokens", type=int, default=EVENTS, help=argparse.SUPPRESS)
    parser.add_argument("--serve-baseline", choices=BASELINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global ACCESS_LOG
    ACCESS_LOG = not args.no_access_log
    if args.serve_engines is not None:
        global REASONING, TOKENS
        REASONING, TOKENS = args.serve_reasoning, args.serve_tokens
        trio.run(_serve_engines, 2, args.serve_engines)  # until SIGTERM kills it
        return
    if args.serve_baseline:
        trio.run(_serve_baseline, args.serve_baseline)
        return
    duration = min(args.duration, 120.0)
    global REPEAT
    REPEAT = max(1, min(args.repeat, 5))
    generator = "wrk -t1" if shutil.which("wrk") else "python/httpx"
    print(
        f"load: {generator}, {args.connections} connections, {duration:g} s per run, "
        f"{REPEAT} run(s) per scenario; {os.cpu_count()} CPUs; policy "
        f"{'each in turn' if args.all_policies else args.policy}"
    )
    results: list[Result] = []
    if args.soak > 0:
        with tempfile.TemporaryDirectory() as tmp_name:
            soak(
                Path(tmp_name),
                connections=args.connections,
                seconds=min(args.soak, 300.0),
                policy=args.policy,
            )
        return
    if args.all_policies:
        with tempfile.TemporaryDirectory() as tmp_name:
            bench_policies(Path(tmp_name), connections=args.connections, duration=duration)
        return
    if args.limits:
        with tempfile.TemporaryDirectory() as tmp_name:
            bench_limits(Path(tmp_name), connections=args.connections, duration=duration)
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        results += bench_router(
            tmp,
            gap_s=0.0,
            scenarios=[
                ("chat (non-streamed)", CHAT_BODY),
                ("stream64 (answered at once)", STREAM_BODY),
            ],
            connections=args.connections,
            duration=duration,
            profile=None,
            policy=args.policy,
        )
        results += bench_router(
            tmp,
            gap_s=0.005,
            scenarios=[("stream64-paced (5 ms apart)", STREAM_BODY)],
            connections=args.connections,
            duration=duration,
            profile=None,
            policy=args.policy,
        )
        results += [
            bench_baseline(kind, connections=args.connections, duration=duration)
            for kind in BASELINES
        ]
        print(
            f"\n{'scenario':34} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'CPU ms/req':>11} {'errors':>7}"
        )
        for r in results:
            print(
                f"{r.name:34} {r.rps:8.0f} {r.p50_ms:8.1f} {r.p99_ms:8.1f} "
                f"{r.cpu_ms_per_request:11.3f} {r.errors:7d}"
            )
        if args.profile:
            profile = tmp / "router.prof"
            bench_router(
                tmp,
                gap_s=0.0,
                scenarios=[("chat", CHAT_BODY), ("stream64", STREAM_BODY)],
                connections=args.connections,
                duration=min(duration, 10.0),
                profile=profile,
                policy=args.policy,
            )
            print_profile(profile)


if __name__ == "__main__":
    main()
