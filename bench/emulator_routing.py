"""bench_emulator.py's `routing`: issue 37's skewed workload through trio_router's policies and
the peers' (production-stack's router, the Rust vllm-router), each in front of its own fresh
emulated fleet; hit rate, TTFT and what each process spent."""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from bench_picker import tree_cpu
from emulator_fleet import FIRST_HOST, MODEL, START_S, WORDS, open_emulator, percentile, scrape
from peers import available, open_router, wait_routing
from trio_router.testing.processes import open_command
from trio_router.testing.vllm_engines import free_ports

# Each peer's policies, in its own words: its round robin, then its best cache-aware one that
# needs nothing beyond the engines (production-stack's `kvaware` needs an LMCache controller,
# `session` a session header the workload's group requests do not carry).
PEER_POLICIES: Final = {
    "production-stack": ("roundrobin", "prefixaware"),
    "vllm-router-rs": ("round_robin", "cache_aware"),
}


SLOWEST: Final = 8  # the slowest requests reported (the p99 of 512 is the sixth slowest)


@dataclass(frozen=True)
class Contender:
    """A router and the routing policy it runs (in that router's own words)."""

    router: str  # trio | production-stack | vllm-router-rs
    policy: str


def contenders(routers: str, policies: str) -> tuple[list[Contender], dict[str, str]]:
    """`--routers` (ROUTER or ROUTER:POLICY, comma-separated; a bare `trio` runs `--policies`,
    a bare peer PEER_POLICIES) as contenders, and the routers that cannot run here, with why."""
    chosen: list[Contender] = []
    skipped: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in routers.split(","))):
        router, _, policy = item.partition(":")
        if router == "trio":
            names = [policy] if policy else policies.split(",")
        elif router in PEER_POLICIES:
            names = [policy] if policy else list(PEER_POLICIES[router])
            if why := available(router):
                skipped[router] = why
                continue
        else:
            raise SystemExit(f"--routers: unknown router {router!r}")
        chosen += [Contender(router, name) for name in names]
    return chosen, skipped


# -- the workload -------------------------------------------------------------------------------
@dataclass
class Conversation:
    messages: list[dict[str, str]]
    questions: list[str]
    lock: trio.Lock = field(default_factory=trio.Lock)  # one turn at a time


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(count))


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
) -> tuple[float, str, str]:
    """One streamed chat through the router: seconds to its first token, its text, and the
    engine trio_router names in its `x-trio-router-engine` header ("" from a peer)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    started, ttft = trio.current_time(), float("nan")
    parts: list[str] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {(await answer.aread())!r}")
        engine = answer.headers.get("x-trio-router-engine", "")
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if content := choice.get("delta", {}).get("content"):
                    if not parts:
                        ttft = trio.current_time() - started
                    parts.append(content)
    return ttft, "".join(parts), engine


@dataclass(frozen=True)
class Timed:
    """One answered request: its TTFT (wall seconds), its place in the order, what it was
    ("group G #N": the Nth request of group G; "chat C turn T"), the engine the router named."""

    ttft: float
    place: int
    what: str
    engine: str = ""


def arrivals(args: argparse.Namespace, count: int) -> list[float]:
    """When each request of the order is sent (wall seconds from the start): Poisson at
    `--load` x `--capacity-rps` (emulated requests a second), or all at once (0, the closed
    loop of `--concurrency`)."""
    if not args.load:
        return [0.0] * count
    rng, rate, now, times = random.Random(args.seed + 1), args.load * args.capacity_rps, 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate * emulated_scale(args))
        times.append(now)
    return times


async def run_skewed(
    args: argparse.Namespace, client: httpx.AsyncClient, urls: Sequence[str]
) -> tuple[list[Timed], int]:
    """The workload in order, each request sent at its arrival (`arrivals`) with at most
    `concurrency` in flight, to `urls` in turn (one URL: the router's); each answer's `Timed`,
    and the errors. A conversation's turn waits for the turn before it; its TTFT counts from
    when it is sent."""
    groups, conversations, order = skewed_workload(args)
    ttfts: list[Timed] = []
    errors, asked = 0, [0] * len(groups)
    limiter = trio.CapacityLimiter(args.concurrency)

    async def one(place: int, kind: str, which: int) -> None:
        nonlocal errors
        url = urls[place % len(urls)]
        async with limiter:
            if kind == "group":
                system, questions = groups[which]
                asked[which] += 1
                what = f"group {which} #{asked[which]}"
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": questions[asked[which] % 8]}]  # fmt: skip
                try:
                    ttft, _, engine = await stream_chat(client, url, messages, args.max_tokens)
                    ttfts.append(Timed(ttft, place, what, engine))
                except (httpx.HTTPError, RuntimeError):
                    errors += 1
                return
            talk = conversations[which]
            async with talk.lock:
                turn = len(talk.messages) // 2
                talk.messages.append({"role": "user", "content": talk.questions[turn]})
                try:
                    ttft, text, engine = await stream_chat(
                        client, url, list(talk.messages), args.max_tokens
                    )
                    ttfts.append(Timed(ttft, place, f"chat {which} turn {turn + 1}", engine))
                except (httpx.HTTPError, RuntimeError):
                    errors, text = errors + 1, ""
                talk.messages.append({"role": "assistant", "content": text})

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for place, ((kind, which), at) in enumerate(
            zip(order, arrivals(args, len(order)), strict=True)
        ):
            await trio.sleep_until(started + at)
            nursery.start_soon(one, place, kind, which)
            await trio.lowlevel.checkpoint()  # in order: the limiter serves first come first
    return ttfts, errors


# -- the routers --------------------------------------------------------------------------------
def router_toml(
    policy: str, port: int, urls: Sequence[str], kv: tuple[int, int], time_scale: float
) -> str:
    """trio_router's config in front of `urls`. The emulated engines send a chat stream's
    first event (the role) when the request arrives, where vLLM sends it with the first
    token, so a wait in an engine's queue would count as a stall of a stream that has begun:
    the stall bound is the default ceiling (30 s), in emulated seconds (/ `time_scale`), from
    the first byte on, as the wait for a first token is bounded with vLLM's engines."""
    listed = ", ".join(f'"{u}"' for u in urls)
    stall = 30.0 / time_scale
    text = (
        f'[server]\nbind = "127.0.0.1:{port}"\ndrain_s = 1.0\naccess_log = false\n'
        f"[proxy]\nstall_floor_s = {stall}\nstall_timeout_s = {stall}\n"
        f'[routing]\npolicy = "{policy}"\nkv_block_size = 16\n'
        f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
        "[stats]\ninterval_s = 1.0\n"
    )
    if policy == "kv_aware":
        text += f'[kv_events]\nmode = "connect"\nport = {kv[0]}\nreplay_port = {kv[1]}\n'
    return text


@asynccontextmanager
async def open_contender(
    contender: Contender,
    urls: Sequence[str],
    kv: tuple[int, int],
    workdir: Path,
    time_scale: float,
) -> AsyncIterator[tuple[str, int]]:
    """The contender's router in front of `urls` (engines at `time_scale`); yields its URL
    and process id once it routes. trio_router subscribes to the engines' KV events (`kv`:
    their ports) for `kv_aware`; a peer is started by bench/peers.py with its policy."""
    if contender.router != "trio":
        async with open_router(
            contender.router, urls, workdir, MODEL, policy=contender.policy
        ) as running:
            yield running.url, running.pids["router"]
        return
    port = free_ports(["127.0.0.1"], 1)[0]
    config = workdir / f"trio-{contender.policy}.toml"
    config.write_text(router_toml(contender.policy, port, urls, kv, time_scale))
    command = [sys.executable, "-m", "trio_router", "--config", str(config)]
    async with (
        open_command(command) as (process, _, stderr),
        httpx.AsyncClient(timeout=10.0) as client,
    ):
        with trio.fail_after(START_S):
            # Its /engines, not `router_url`: that one's pattern, repeated once per engine,
            # backtracks for minutes at 64 engines while not all are routable yet.
            url = (await stderr.wait_for(r"Running on (http://\S+)")).group(1)
            await wait_routing(client, url, MODEL, len(urls))
            await wait_scraped(client, url, len(urls))
        yield url, process.pid


async def wait_scraped(client: httpx.AsyncClient, url: str, engines: int) -> None:
    """Until trio_router's /engines shows figures scraped from all `engines`: the state it
    runs in before traffic comes, as in production (a router taking a burst before its first
    scrape knows no engine's queue: `kv_aware` keeps a prefix on its holder only once the
    holder's figures show it has none). Asked every 0.2 s."""
    while True:
        shown = (await client.get(f"{url}/engines")).json()["engines"]
        if sum(bool(e["stats"]) for e in shown) >= engines:
            return
        await trio.sleep(0.2)


def counted(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much the engines' counter `name` grew between the two scrapes."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def figures(
    args: argparse.Namespace, metrics: tuple[dict[str, float], dict[str, float]],
    ttfts: Sequence[Timed], errors: int,
) -> dict[str, Any]:  # fmt: skip
    """Hit rate (the engines' tokens, the whole run), TTFT p50/p99 (emulated ms) of the
    requests after the first `--warmup` of the order, the warm-up's own p99, the engines' mean
    TTFT, and the slowest measured requests (emulated ms, place in the order, what, engine)."""
    before, after = metrics
    queries = counted(before, after, "vllm:prefix_cache_queries_total")
    hits = counted(before, after, "vllm:prefix_cache_hits_total")
    engine_ttft = counted(before, after, "vllm:time_to_first_token_seconds_sum") / max(
        1.0, counted(before, after, "vllm:time_to_first_token_seconds_count")
    )
    answered = [t for t in ttfts if t.ttft == t.ttft]
    measured = [t for t in answered if t.place >= args.warmup]
    scale = emulated_scale(args)
    emulated = sorted(t.ttft * scale for t in measured)
    warm = sorted(t.ttft * scale for t in answered if t.place < args.warmup)
    slowest = sorted(measured, key=lambda t: t.ttft, reverse=True)[:SLOWEST]
    return {
        "requests": len(ttfts) + errors,
        "errors": errors,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "measured": len(emulated),
        "ttft_p50_ms": round(percentile(emulated, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(emulated, 99) * 1000, 1),
        "warmup_ttft_p99_ms": round(percentile(warm, 99) * 1000, 1) if warm else None,
        "engine_ttft_mean_ms": round(engine_ttft / args.slowdown * 1000, 1),
        "generated_tokens": round(counted(before, after, "vllm:generation_tokens_total")),
        "slowest": [[round(t.ttft * scale * 1000, 1), t.place, t.what, t.engine] for t in slowest],
        "hot_group_engines": spread(measured, "group 0 #"),
    }


def spread(timed: Sequence[Timed], prefix: str) -> list[int]:
    """How many of the requests whose `what` starts with `prefix` each engine got, most
    first (from trio_router's engine header; empty through a peer)."""
    counts: dict[str, int] = {}
    for t in timed:
        if t.engine and t.what.startswith(prefix):
            counts[t.engine] = counts.get(t.engine, 0) + 1
    return sorted(counts.values(), reverse=True)


async def busiest_share(
    client: httpx.AsyncClient, urls: Sequence[str], before: Sequence[float]
) -> tuple[list[float], float]:
    """Each engine's generated tokens so far, and the busiest engine's share of those since
    `before` (the same list, earlier) over the mean engine's: 1.0 when the load was even."""
    now = [(await scrape(client, [url])).get("vllm:generation_tokens_total", 0.0) for url in urls]
    grown = [n - b for n, b in zip(now, before, strict=True)] if before else []
    mean = sum(grown) / len(grown) if grown else 0.0
    return now, round(max(grown) / mean, 2) if mean else 0.0


def emulated_scale(args: argparse.Namespace) -> float:
    """H100 seconds per wall second: the engines' time scale over `--slowdown`."""
    return float(args.time_scale / args.slowdown)


SLOWED: Final = ("overhead_s", "per_sequence_s")  # the h100 step's durations...
QUICKENED: Final = ("memory_bytes_per_s", "compute_flops_per_s")  # ...and rates


def slowed_h100(slowdown: float) -> Path:
    """A profile file: h100 with every step `slowdown` times as long (its durations times
    it, its rates over it), the rest the same."""
    lines = resources.files("trio_router.emulator").joinpath("profiles", "h100.toml")
    out = []
    for line in lines.read_text().splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key in SLOWED:
            line = f"{key} = {float(value.split()[0]) * slowdown!r}"
        elif sep and key in QUICKENED:
            line = f"{key} = {float(value.split()[0]) / slowdown!r}"
        out.append(line)
    path = Path(tempfile.gettempdir()) / f"h100-slowed-{slowdown:g}.toml"
    path.write_text("\n".join(out) + "\n")
    return path


def emulator_extra(args: argparse.Namespace, kv: tuple[int, int]) -> list[str]:
    """`emulate`'s options beyond the fleet's size: KV events on ports `kv`, the engines'
    `--max-num-seqs` when `--engine-max-num-seqs` is set, and h100 `--slowdown` times as slow
    when that is not 1."""
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv[0]}",
              "replay_endpoint": f"tcp://*:{kv[1]}"}  # fmt: skip
    extra = ["--kv-events-config", json.dumps(events)]
    if args.slowdown != 1:
        extra += ["--profile", str(slowed_h100(args.slowdown))]
    if args.engine_max_num_seqs:
        extra += ["--max-num-seqs", str(args.engine_max_num_seqs)]
    return extra


LIMITS: Final = httpx.Limits(max_connections=None, max_keepalive_connections=None)


async def calibrate(args: argparse.Namespace) -> float:
    """The fleet's throughput at the workload's prompt mix, in emulated requests a second:
    the workload sent straight to fresh engines in turn, `--calibrate-streams` per engine
    kept in flight, its answers (generated tokens / `--max-tokens`) counted over
    `--calibrate` wall seconds after a quarter of that as warm-up."""
    kv_port, replay_port = free_ports(["127.0.0.1", FIRST_HOST], 2)
    kv = (kv_port, replay_port)
    streams = args.engines * args.calibrate_streams
    closed = argparse.Namespace(**{**vars(args), "load": 0.0, "concurrency": streams})
    async with (
        open_emulator(args.engines, args.time_scale, *emulator_extra(args, kv)) as (_, urls, _),
        httpx.AsyncClient(timeout=600.0, limits=LIMITS) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(run_skewed, closed, client, urls)
        await trio.sleep(args.calibrate / 4)
        before = await scrape(client, urls)
        await trio.sleep(args.calibrate)
        after = await scrape(client, urls)
        nursery.cancel_scope.cancel()
    tokens = counted(before, after, "vllm:generation_tokens_total")
    return float(tokens / args.max_tokens / (args.calibrate * emulated_scale(args)))


async def bench_contender(
    args: argparse.Namespace, contender: Contender, workdir: Path
) -> dict[str, Any]:
    """One router and policy in front of fresh emulated engines: hit rate, TTFT, and the CPU
    (cores) of the router, the emulator, this client and everything else over the run."""
    kv_port, replay_port = free_ports(["127.0.0.1", FIRST_HOST], 2)
    kv = (kv_port, replay_port)
    async with (
        open_emulator(args.engines, args.time_scale, *emulator_extra(args, kv)) as (
            emulator, urls, _),
        open_contender(contender, urls, kv, workdir, emulated_scale(args)) as (url, pid),
        httpx.AsyncClient(timeout=600.0, limits=LIMITS) as client,
    ):  # fmt: skip
        pids = {"router": pid, "emulator": emulator.pid}
        before, (each, _) = await scrape(client, urls), await busiest_share(client, urls, [])
        cpu0, own0 = tree_cpu(pids), resource.getrusage(resource.RUSAGE_SELF)
        started = trio.current_time()
        ttfts, errors = await run_skewed(args, client, [url])
        seconds = trio.current_time() - started
        cpu1, own1 = tree_cpu(pids), resource.getrusage(resource.RUSAGE_SELF)
        after, (_, busiest) = await scrape(client, urls), await busiest_share(client, urls, each)
    cores = {role: (cpu1[role] - cpu0[role]) / seconds for role in cpu0}
    cores["client"] = (own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime) / seconds
    cores["others"] = cores.pop("all") - cores["router"] - cores["emulator"] - cores["client"]
    return {
        "router": contender.router,
        "policy": contender.policy,
        **figures(args, (before, after), ttfts, errors),
        "busiest_engine_x_mean": busiest,
        "wall_s": round(seconds, 1),
        "cores": {role: round(value, 2) for role, value in cores.items()},
    }


async def bench_routing(args: argparse.Namespace) -> dict[str, Any]:
    chosen, skipped = contenders(args.routers, args.policies)
    if args.load and not args.capacity_rps:
        args.capacity_rps = round(await calibrate(args), 1)
        print(json.dumps({"capacity_rps_emulated": args.capacity_rps}), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for contender in chosen:
            results.append(await bench_contender(args, contender, Path(workdir)))
            print(json.dumps(results[-1]), flush=True)
    return {"engines": args.engines, "time_scale": args.time_scale, "slowdown": args.slowdown,
            "concurrency":
            args.concurrency, "engine_max_num_seqs": args.engine_max_num_seqs,
            "load": args.load, "capacity_rps_emulated": args.capacity_rps,
            "warmup": args.warmup, "results": results, "skipped": skipped}  # fmt: skip
