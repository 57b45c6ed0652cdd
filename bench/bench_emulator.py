"""The emulated fleet (`trio-router emulate`) measured as a real process, and routing judged on
it.

    python bench/bench_emulator.py scale [--engines 64] [--streams 1000] [--time-scale 0.25]
                                         [--seconds 20] [--profile-out FILE]
    python bench/bench_emulator.py routing [--engines 16] [--policies round_robin,...]
                                           [--routers trio,production-stack,vllm-router-rs]
                                           [--concurrency 64] [--json-out FILE]
                                           [--load 0.8 [--capacity-rps R]] [--warmup 200]
                                           [--engine-max-num-seqs 16]
    python bench/bench_emulator.py flow [--engines 16] [--load 1.5] [--capacity 16]
                                        [--reserve 4] [--engine-max-num-seqs 0]
                                        [--routers trio,production-stack,vllm-router-rs]

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

`routing` (bench/emulator_routing.py): issue 37's skewed workload (bench_engines.py's shape:
`--groups` groups sharing a long system prompt, popularity 1/rank^`--skew`, plus multi-turn
conversations, `--concurrency` requests in flight) through each router and policy of
`--routers` in front of `--engines` fresh emulated engines (a new `emulate` process per
router and policy, its engines publishing their KV-cache events for trio_router's
`kv_aware`). `--routers`: `trio` (each policy of `--policies`), `production-stack` (its
`roundrobin` and `prefixaware`), `vllm-router-rs` (its `round_robin` and `cache_aware`), or
ROUTER:POLICY for one; the peers are started by bench/peers.py when their environment is set
up as `../shared/bench`'s README describes (`PEER_PS_PYTHON` + `PEER_PS_SRC`, `PEER_VR_BIN`),
else listed as skipped. Reports for each: the prefix-cache hit rate (the engines' own
counters, in tokens), the client's TTFT p50 and p99 (streamed, converted to emulated seconds:
the router's and this client's own time is in them, scaled the same way), the engines' own
mean TTFT (`vllm:time_to_first_token_seconds`, emulated: from arrival at the engine), the
errors, the slowest requests (which group request or conversation turn, where in the order,
and the engine trio_router named in its `x-trio-router-engine` header), how many of the
hottest group's requests each engine got (trio_router only), the busiest engine's generated
tokens over the mean engine's, and the CPU (cores) of the router, the emulator, this client
and every other process. By default the requests go out `--concurrency` at a time (a closed
loop); with `--load L` they arrive open loop, Poisson at L x the fleet's throughput, so that
a busy fleet can be judged: `--capacity-rps` (emulated requests a second) or, when 0, as
calibrated first on fresh engines (the workload sent straight to them in turn with
`--calibrate-streams` per engine in flight, answers counted over `--calibrate` wall seconds).
`--engine-max-num-seqs` caps each engine's running sequences (the rest wait in its queue), so
that the fleet fills at a stream count this client can keep; `--warmup N` leaves the first N
requests of the order (the cold start) out of the TTFT percentiles and reports their p99
apart. The hit rate counts the whole run. `--slowdown K` runs engines K times as slow as the
h100 profile (a profile file written for it) and reports every time divided by K, in H100
seconds: at `--time-scale 1` the engines' clock is then the router's, as kv_aware's
predicted waits need (they add the engines' own figures to the router's clock, and learn
their error from first tokens timed by it), where a time scale below 1 puts the engines' time
and the router's apart by that factor.

`flow` (bench/emulator_flow.py): issue 35's workload (bench_flow.py's load and tenants) at
`--engines` emulated H100s scheduling by priority (`--engine-max-num-seqs`, 0: the profile's
1024), one `emulate` process for every router of `--routers`. `trio`: bench_flow's trio-flow
router (`round_robin`, `max_in_flight_per_engine` = `--capacity`, the top band `--reserve` past
it, `priority_to_engines`; tenants `interactive`, priority 10 with a first-token deadline of
`--deadline-ms` emulated, and `batch`, priority 0); `production-stack`, `vllm-router-rs`: the
peers (round robin; no flow control, the same load). The fleet's capacity is measured first
(engines x capacity streams back to back, straight to the engines); then through each router
interactive requests alone at `--unloaded-load` x it, and the mix (`--interactive-share`
interactive) at `--load` x it, Poisson, `--duration` wall seconds. Reports per router the
interactive TTFT p99, unloaded and loaded (emulated: wall x the time scale), their ratio, what
the router refused (shed, queue full, deadline) per tenant, and the interactive requests whose
clients gave up at the deadline.

Loopback only; every process is killed at the end; every load is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from emulator_fleet import MODEL, WORDS, cpu_seconds, open_emulator, scrape
from emulator_flow import bench_flow
from emulator_routing import bench_routing
from trio_router.emulator.profiles import StepShape, load_profile


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
            prompt = " ".join(rng.choice(WORDS) for _ in range(64))
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
    routing = commands.add_parser("routing", help="routing policies on a skewed workload")
    routing.add_argument("--engines", type=int, default=16)
    routing.add_argument("--time-scale", type=float, default=0.5)
    routing.add_argument("--policies", default="round_robin,least_loaded,prefix_aware,kv_aware")
    routing.add_argument("--routers", default="trio", help="trio, production-stack, ...")
    routing.add_argument("--groups", type=int, default=8)
    routing.add_argument("--per-group", type=int, default=48)
    routing.add_argument("--skew", type=float, default=1.2)
    routing.add_argument("--system-words", type=int, default=1500)
    routing.add_argument("--conversations", type=int, default=32)
    routing.add_argument("--turns", type=int, default=4)
    routing.add_argument("--concurrency", type=int, default=64)
    routing.add_argument("--max-tokens", type=int, default=64)
    routing.add_argument("--seed", type=int, default=0)
    routing.add_argument("--load", type=float, default=0.0, help="x capacity; 0: closed loop")
    routing.add_argument("--capacity-rps", type=float, default=0.0, help="0: calibrate")
    routing.add_argument("--calibrate", type=float, default=20.0, help="wall seconds")
    routing.add_argument("--calibrate-streams", type=int, default=24, help="per engine")
    routing.add_argument("--engine-max-num-seqs", type=int, default=0, help="0: the profile's")
    routing.add_argument("--warmup", type=int, default=0, help="first requests not measured")
    routing.add_argument("--slowdown", type=float, default=1.0, help="h100 this many x slower")
    flows = commands.add_parser("flow", help="flow control at 150 % load (issue 35's workload)")
    flows.add_argument("--engines", type=int, default=16)
    flows.add_argument("--time-scale", type=float, default=0.05)
    flows.add_argument(
        "--capacity", type=int, default=16, help="the router's max_in_flight_per_engine"
    )
    flows.add_argument(
        "--engine-max-num-seqs", type=int, default=0, help="the engines' (0: the profile's)"
    )
    flows.add_argument("--max-tokens", type=int, default=32)
    flows.add_argument("--load", type=float, default=1.5)
    flows.add_argument("--duration", type=float, default=30.0, help="wall seconds of arrivals")
    flows.add_argument("--drain", type=float, default=20.0, help="wall seconds")
    flows.add_argument("--interactive-share", type=float, default=0.3)
    flows.add_argument("--deadline-ms", type=float, default=2000.0, help="emulated")
    flows.add_argument("--reserve", type=int, default=4)
    flows.add_argument("--unloaded-load", type=float, default=0.2)
    flows.add_argument("--unloaded-duration", type=float, default=15.0)
    flows.add_argument("--calibrate", type=float, default=20.0, help="wall seconds")
    flows.add_argument("--seed", type=int, default=0)
    flows.add_argument("--routers", default="trio", help="trio, production-stack, ...")
    for command in (scale, routing, flows):
        command.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    commands = {"scale": bench_scale, "routing": bench_routing, "flow": bench_flow}
    result = trio.run(commands[args.command], args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
