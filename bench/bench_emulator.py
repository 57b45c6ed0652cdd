"""The emulated fleet (`trio-router emulate`) measured as a real process, and routing judged on
it.

    python bench/bench_emulator.py scale [--engines 64] [--streams 1000] [--time-scale 0.25]
                                         [--seconds 20] [--profile-out FILE]
    python bench/bench_emulator.py routing [--engines 16] [--policies round_robin,...]
                                           [--concurrency 64] [--json-out FILE]

`scale`: one `trio-router emulate` process serving `--engines` H100s on 127.0.1.1, .2, ...
at `--time-scale`, and `--streams` streamed completions kept in flight straight to the
engines (spread evenly; each ends after `--max-tokens` tokens and is replaced at once) by a
lean client in this process (raw sockets, one connection per stream, events counted, not
parsed). After a warm-up, over `--seconds`: the emulator's CPU (user + system of its process,
all threads, from /proc, in cores), this client's, the tokens the engines generated (their
`vllm:generation_tokens_total`), and whether the engines kept their emulated time: the mean
inter-token latency they report (emulated seconds, `vllm:inter_token_latency_seconds`) beside
the step the profile gives for the batch they ran (`vllm:num_requests_running`), and the
tokens generated per wall-clock second beside what the profile's step allows at that batch
and time scale (`kept_up`: 1.0 when the process keeps every engine's pace). An emulator that
falls behind by more than a step shows longer latencies, and fewer tokens than the profile
allows. `--profile-out` runs the
emulator under cProfile instead and writes its statistics there (slower: for finding where
the time goes, not for the figures).

`routing`: issue 37's skewed workload (bench_engines.py's shape: `--groups` groups sharing a
long system prompt, popularity 1/rank^`--skew`, plus multi-turn conversations, `--concurrency`
requests in flight) through one `trio-router` process per policy in front of `--engines`
fresh emulated engines (a new `emulate` process per policy, its engines publishing their
KV-cache events for `kv_aware`). Reports each policy's prefix-cache hit rate (the engines' own
counters, in tokens) and the client's TTFT p50 and p99 (streamed, converted to emulated
seconds). Peers (production-stack's router, the Rust vllm-router) are named by
`--peers` when their environment is set up as `../shared/bench` describes; not here.

Loopback only; every process is killed at the end; every load is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from trio_router.emulator.profiles import StepShape, load_profile
from trio_router.testing.processes import Output, open_command

FIRST_HOST: Final = "127.0.1.1"
MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"
START_S: Final = 120.0
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
_SAMPLE: Final = re.compile(rb"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([-+0-9.e]+)$", re.M)
_WORDS: Final = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
                 "india", "juliett", "kilo", "lima", "mike", "oscar", "papa")  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@asynccontextmanager
async def open_emulator(
    engines: int, time_scale: float, *extra: str, profile_out: str = ""
) -> AsyncIterator[tuple[trio.Process, list[str], Output]]:
    """`trio-router emulate` as a process of its own; yields it, its engines' URLs and its
    stderr once every engine serves."""
    command = [sys.executable]
    if profile_out:
        command += ["-m", "cProfile", "-o", profile_out]
    command += ["-m", "trio_router", "emulate", "--engines", str(engines), "--host", FIRST_HOST]
    command += ["--port", "0", "--time-scale", str(time_scale), *extra]
    async with open_command(command) as (process, stdout, stderr):
        with trio.fail_after(START_S):
            await stdout.wait_for(rf"(?:http://\S+\n){{{engines}}}")
        try:
            yield process, stdout.text.split(), stderr
        finally:
            if process.returncode is not None:
                print(f"the emulator exited with {process.returncode}:\n{stderr.text[-3000:]}")
        process.send_signal(signal.SIGINT)  # a clean exit: cProfile writes its statistics
        with trio.move_on_after(30):
            await process.wait()


async def scrape(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float]:
    """The engines' vLLM metrics (samples of one name summed over engines)."""
    total: dict[str, float] = {}

    async def one(url: str) -> None:
        body = (await client.get(f"{url}/metrics")).content
        for name, value in _SAMPLE.findall(body):
            key = name.decode()
            total[key] = total.get(key, 0.0) + float(value)

    async with trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(one, url)
    return total


# -- scale -------------------------------------------------------------------------------------
@dataclass
class StreamCounts:
    events: int = 0
    streams: int = 0
    errors: int = 0


async def one_stream(url: str, body: bytes, counts: StreamCounts) -> None:
    """One streamed completion over its own connection, read to its end; counts its SSE
    events (without parsing them)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    tail = b""
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(head + body)
        while data := await stream.receive_some(65536):
            counts.events += (tail + data).count(b"data: ")
            tail = data[-5:]
    counts.streams += 1


async def keep_streams(
    urls: Sequence[str], streams: int, max_tokens: int, counts: StreamCounts
) -> None:
    """`streams` streams in flight until cancelled, spread evenly over `urls`; each one that
    ends is replaced at once."""
    rng = random.Random(0)

    async def worker(i: int) -> None:
        url = urls[i % len(urls)]
        while True:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(64))
            request = {"model": MODEL, "prompt": f"{i} {prompt}", "max_tokens": max_tokens}
            body = json.dumps(request | {"ignore_eos": True, "stream": True}).encode()
            try:
                await one_stream(url, body, counts)
            except OSError:
                counts.errors += 1
                await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(worker, i)
            if i % 50 == 49:
                await trio.sleep(0.05)  # a ramp: not every connection in the same instant


def predicted_step(running: float, engines: int, context: float) -> float:
    """The h100 profile's decode step for the batch each engine ran (emulated seconds)."""
    batch = max(1, round(running / engines))
    shape = StepShape(
        sequences=batch,
        tokens=batch,
        context_tokens=int(batch * context),
        attention_pairs=int(batch * context),
    )
    return load_profile("h100").step.seconds(shape)


async def bench_scale(args: argparse.Namespace) -> dict[str, Any]:
    counts = StreamCounts()
    async with (
        open_emulator(args.engines, args.time_scale, profile_out=args.profile_out) as (
            process,
            urls,
            _,
        ),
        httpx.AsyncClient(timeout=30.0) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(keep_streams, urls, args.streams, args.max_tokens, counts)
        await trio.sleep(args.warmup)
        before, cpu0, own0 = await scrape(client, urls), cpu_seconds(process.pid), os.times()
        events0, start = counts.events, trio.current_time()
        await trio.sleep(args.seconds)
        wall = trio.current_time() - start
        after, cpu1, own1 = await scrape(client, urls), cpu_seconds(process.pid), os.times()
        events = counts.events - events0
        nursery.cancel_scope.cancel()

    def delta(name: str) -> float:
        return after[name] - before[name]

    itl = delta("vllm:inter_token_latency_seconds_sum") / max(
        1.0, delta("vllm:inter_token_latency_seconds_count")
    )
    running = (before["vllm:num_requests_running"] + after["vllm:num_requests_running"]) / 2
    tokens = delta("vllm:generation_tokens_total")
    context = 66 + args.max_tokens / 2  # prompt tokens, then half the answer on average
    step = predicted_step(running, args.engines, context)
    return {
        "engines": args.engines,
        "streams": args.streams,
        "time_scale": args.time_scale,
        "seconds": round(wall, 1),
        "running": running,
        "emulator_cores": round((cpu1 - cpu0) / wall, 3),
        "client_cores": round((own1.user + own1.system - own0.user - own0.system) / wall, 3),
        "emulator_us_per_token": round((cpu1 - cpu0) / max(tokens, 1) * 1e6, 1),
        "tokens_per_s": round(tokens / wall),
        "profile_tokens_per_s": round(running / step * args.time_scale),
        "kept_up": round(tokens / wall / (running / step * args.time_scale), 3),
        "events_per_s": round(events / wall),
        "itl_ms_emulated": round(itl * 1000, 2),
        "profile_step_ms": round(step * 1000, 2),
        "client_errors": counts.errors,
    }


# -- the command -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    scale = commands.add_parser("scale", help="the emulator's own cost at a fleet's size")
    scale.add_argument("--engines", type=int, default=64)
    scale.add_argument("--streams", type=int, default=1000)
    scale.add_argument("--time-scale", type=float, default=0.25)
    scale.add_argument("--max-tokens", type=int, default=1000)
    scale.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    scale.add_argument("--seconds", type=float, default=20.0, help="seconds measured")
    scale.add_argument("--profile-out", default="", help="run the emulator under cProfile")
    for command in (scale,):
        command.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = trio.run(bench_scale, args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
