"""The emulated fleet (`trio-router emulate`) measured as a real process, and routing judged on
it.

    python bench/bench_emulator.py scale [--engines 64] [--streams 1000] [--time-scale 0.25]
                                         [--seconds 20] [--profile-out FILE]
    python bench/bench_emulator.py routing [--engines 16] [--policies round_robin,...]
                                           [--concurrency 64] [--json-out FILE]
    python bench/bench_emulator.py flow [--engines 16] [--load 1.5] [--capacity 16]
                                        [--reserve 4] [--engine-max-num-seqs 0]

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
counters, in tokens), the client's TTFT p50 and p99 (streamed, converted to emulated
seconds: the router's and this client's own time is in them, scaled the same way) and the
engines' own mean TTFT (`vllm:time_to_first_token_seconds`, emulated: from arrival at the
engine). Peers (production-stack's router, the Rust vllm-router) are named by
`--peers` when their environment is set up as `../shared/bench` describes; not here.

`flow`: issue 35's workload (bench_flow.py's load, tenants and trio-flow router) at
`--engines` emulated H100s scheduling by priority (`--engine-max-num-seqs`, 0: the profile's
1024). trio_router (`round_robin`, `max_in_flight_per_engine` = `--capacity`, the top band
`--reserve` past it, `priority_to_engines`; tenants `interactive`, priority 10 with a
first-token deadline of `--deadline-ms` emulated, and `batch`, priority 0) in front of one
`emulate` process. The fleet's capacity is measured first (engines x capacity streams back to
back, straight to the engines); then interactive requests alone at `--unloaded-load` x it,
and the mix (`--interactive-share` interactive) at `--load` x it, Poisson, `--duration` wall
seconds. Reports the interactive TTFT p99, unloaded and loaded (emulated: wall x the time
scale), their ratio, and what the router refused (shed, queue full, deadline) per tenant.

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
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import httpx
import trio

import bench_flow as flow
from trio_router.emulator.profiles import StepShape, load_profile
from trio_router.testing.processes import Output, open_command, router_url
from trio_router.testing.vllm_engines import free_ports

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


# -- routing ------------------------------------------------------------------------------------
@dataclass
class Conversation:
    messages: list[dict[str, str]]
    questions: list[str]
    lock: trio.Lock = field(default_factory=trio.Lock)  # one turn at a time


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(count))


def skewed_workload(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, list[str]]], list[Conversation], list[tuple[str, int]]]:
    """Issue 37's shape (bench_engines.py's `make_workload`): groups sharing a long system
    prompt, drawn with weight 1/(rank+1)^skew, and multi-turn conversations, shuffled."""
    rng = random.Random(args.seed)
    groups = [
        (f"group {g}: {words(rng, args.system_words)}", [f"{words(rng, 20)}?" for _ in range(8)])
        for g in range(args.groups)
    ]
    conversations = [
        Conversation(
            [{"role": "system", "content": words(rng, 40)}],
            [words(rng, rng.randrange(30, 60)) for _ in range(args.turns)],
        )
        for _ in range(args.conversations)
    ]
    weights = [1 / (rank + 1) ** args.skew for rank in range(args.groups)]
    drawn = rng.choices(range(args.groups), weights, k=args.groups * args.per_group)
    order = [("group", g) for g in drawn]
    order += [("chat", c) for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)
    return groups, conversations, order


async def stream_chat(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """One streamed chat through the router: seconds to its first token, and its text."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    started, ttft = trio.current_time(), float("nan")
    parts: list[str] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {(await answer.aread())!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if content := choice.get("delta", {}).get("content"):
                    if not parts:
                        ttft = trio.current_time() - started
                    parts.append(content)
    return ttft, "".join(parts)


async def run_skewed(
    args: argparse.Namespace, client: httpx.AsyncClient, url: str
) -> tuple[list[float], int]:
    """The workload through the router at `url`, `concurrency` at a time, in order; each
    request's TTFT (wall seconds) and the errors."""
    groups, conversations, order = skewed_workload(args)
    ttfts: list[float] = []
    errors, asked = 0, [0] * len(groups)
    limiter = trio.CapacityLimiter(args.concurrency)

    async def one(kind: str, which: int) -> None:
        nonlocal errors
        async with limiter:
            if kind == "group":
                system, questions = groups[which]
                asked[which] += 1
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": questions[asked[which] % 8]}]  # fmt: skip
                try:
                    ttfts.append((await stream_chat(client, url, messages, args.max_tokens))[0])
                except (httpx.HTTPError, RuntimeError):
                    errors += 1
                return
            talk = conversations[which]
            async with talk.lock:
                turn = len(talk.messages) // 2
                talk.messages.append({"role": "user", "content": talk.questions[turn]})
                try:
                    ttft, text = await stream_chat(
                        client, url, list(talk.messages), args.max_tokens
                    )
                    ttfts.append(ttft)
                except (httpx.HTTPError, RuntimeError):
                    errors, text = errors + 1, ""
                talk.messages.append({"role": "assistant", "content": text})

    async with trio.open_nursery() as nursery:
        for kind, which in order:
            nursery.start_soon(one, kind, which)
            await trio.lowlevel.checkpoint()  # in order: the limiter serves first come first
    return ttfts, errors


def router_toml(policy: str, port: int, urls: Sequence[str], kv: tuple[int, int]) -> str:
    listed = ", ".join(f'"{u}"' for u in urls)
    text = (
        f'[server]\nbind = "127.0.0.1:{port}"\ndrain_s = 1.0\naccess_log = false\n'
        f'[routing]\npolicy = "{policy}"\nkv_block_size = 16\n'
        f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
        "[stats]\ninterval_s = 1.0\n"
    )
    if policy == "kv_aware":
        text += f'[kv_events]\nmode = "connect"\nport = {kv[0]}\nreplay_port = {kv[1]}\n'
    return text


async def bench_policy(args: argparse.Namespace, policy: str, workdir: Path) -> dict[str, Any]:
    """One policy in front of fresh emulated engines: hit rate and TTFT."""
    port, kv_port, replay_port = free_ports(["127.0.0.1", FIRST_HOST], 3)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_port}",
              "replay_endpoint": f"tcp://*:{replay_port}"}  # fmt: skip
    extra = ["--kv-events-config", json.dumps(events)]
    async with open_emulator(args.engines, args.time_scale, *extra) as (_, urls, _):
        config = workdir / f"{policy}.toml"
        config.write_text(router_toml(policy, port, urls, (kv_port, replay_port)))
        command = [sys.executable, "-m", "trio_router", "--config", str(config)]
        async with (
            open_command(command) as (_, _, stderr),
            httpx.AsyncClient(timeout=120.0) as client,
        ):
            with trio.fail_after(START_S):
                url = await router_url(stderr, engines=args.engines)
            before = await scrape(client, urls)
            started = trio.current_time()
            ttfts, errors = await run_skewed(args, client, url)
            seconds = trio.current_time() - started
            after = await scrape(client, urls)
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    queries = after["vllm:prefix_cache_queries_total"] - before.get(
        "vllm:prefix_cache_queries_total", 0
    )
    engine_ttft = (
        after["vllm:time_to_first_token_seconds_sum"]
        - before.get("vllm:time_to_first_token_seconds_sum", 0)
    ) / max(
        1.0,
        after["vllm:time_to_first_token_seconds_count"]
        - before.get("vllm:time_to_first_token_seconds_count", 0),
    )
    emulated = sorted(t * args.time_scale for t in ttfts if t == t)
    return {
        "policy": policy,
        "requests": len(ttfts) + errors,
        "errors": errors,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_p50_ms": round(percentile(emulated, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(emulated, 99) * 1000, 1),
        "engine_ttft_mean_ms": round(engine_ttft * 1000, 1),
        "wall_s": round(seconds, 1),
    }


def percentile(ordered: Sequence[float], p: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))]


async def bench_routing(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for policy in args.policies.split(","):
            results.append(await bench_policy(args, policy, Path(workdir)))
            print(json.dumps(results[-1]), flush=True)
    return {"engines": args.engines, "time_scale": args.time_scale, "results": results}


# -- flow ---------------------------------------------------------------------------------------
async def flow_run(
    workload: flow.Workload,
    schedule: Sequence[flow.Arrival],
    window_s: float,
    workdir: Path,
    emulator_pid: int,
) -> dict[str, Any]:
    """bench_flow's trio-flow router (tenants, bands, deadline) in front of the emulated
    engines, and `schedule` sent through it; its figures (wall milliseconds)."""
    await flow.wait_idle(workload.upstreams)
    async with flow.open_trio("trio-flow", workload.upstreams, workload, workdir) as running:
        pids = running.pids | {"emulator": emulator_pid}
        load = await flow.run_load(running.url, schedule, window_s, workload, pids)
    return {
        "interactive": flow.interactive_figures(load.sent, workload.deadline_s),
        "batch": flow.batch_figures(load.sent, load.window_s),
        "cpu": {role: round(cores, 3) for role, cores in load.cpu.items()},
    }


async def bench_flow(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 35's workload (bench_flow.py's) at `--load` x the emulated fleet's capacity."""
    wall = 1 / args.time_scale  # wall seconds per emulated second
    extra = ["--scheduling-policy", "priority"]
    if args.engine_max_num_seqs:
        extra += ["--max-num-seqs", str(args.engine_max_num_seqs)]
    async with open_emulator(args.engines, args.time_scale, *extra) as (process, urls, _):
        workload = flow.Workload(
            engines=args.engines, capacity=args.capacity, prefill_s=0.0, itl_s=0.0,
            tokens=args.max_tokens, deadline_s=args.deadline_ms / 1000 * wall,
            drain_s=args.drain, reserve=args.reserve, model=MODEL, upstreams=tuple(urls),
        )  # fmt: skip
        rps = await flow.calibrate(urls, workload, args.calibrate)
        workload = replace(workload, measured_rps=rps)
        print(json.dumps({"capacity_rps_wall": round(rps, 2)}), flush=True)
        light = flow.arrivals(args.unloaded_load * rps, args.unloaded_duration, 1.0, args.seed,
                              workload)  # fmt: skip
        heavy = flow.arrivals(args.load * rps, args.duration, args.interactive_share,
                              args.seed, workload)  # fmt: skip
        with tempfile.TemporaryDirectory() as workdir:
            unloaded = await flow_run(
                workload, light, args.unloaded_duration, Path(workdir), process.pid
            )
            print(json.dumps({"unloaded": unloaded}), flush=True)
            loaded = await flow_run(workload, heavy, args.duration, Path(workdir), process.pid)
    quiet, busy = unloaded["interactive"]["ttft_p99_ms"], loaded["interactive"]["ttft_p99_ms"]
    refused = {
        tenant: sum(loaded[tenant]["refused"].values()) for tenant in ("interactive", "batch")
    }
    return {
        "engines": args.engines,
        "time_scale": args.time_scale,
        "capacity_rps_emulated": round(rps / args.time_scale, 1),
        "load": args.load,
        "interactive_ttft_p99_ms_emulated": {
            "unloaded": None if quiet is None else round(quiet * args.time_scale, 2),
            "loaded": None if busy is None else round(busy * args.time_scale, 2),
        },
        "ratio": round(busy / quiet, 2) if quiet and busy else None,
        "refused": refused,
        "unloaded": unloaded,
        "loaded": loaded,
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
    routing.add_argument("--groups", type=int, default=8)
    routing.add_argument("--per-group", type=int, default=48)
    routing.add_argument("--skew", type=float, default=1.2)
    routing.add_argument("--system-words", type=int, default=1500)
    routing.add_argument("--conversations", type=int, default=32)
    routing.add_argument("--turns", type=int, default=4)
    routing.add_argument("--concurrency", type=int, default=64)
    routing.add_argument("--max-tokens", type=int, default=64)
    routing.add_argument("--seed", type=int, default=0)
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
