"""Decision cost of each routing policy with 4 to 5,000 engines (µs per decision).

Run: python bench/bench_policy.py [--decisions N] [--seed S]

Each decision is timed on its own (the timer's own cost is subtracted; best of three rounds)
over a live-looking table: every engine has fresh scraped stats and in-flight requests that
rise with each decision and drain at random. Requests: session keys from a pool of 10,000
users; chat prompts of growing multi-turn conversations (about 2 KiB, and 8/32 KiB for
prefix_aware's prompt-length rows, which also time `request_info`, where the prompt's length
costs); for kv_aware, the token ids of such conversations (a 400-token system prompt, turns
of 50-150 tokens), each conversation's system prompt held by one engine in the KV index and
every decision's blocks counted as held by its engine from then on. Also prints one-off
costs (ring build, engine removal, re-indexing after a table change), request_info and stats
parsing costs. Bounded: about a minute on one core.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trio_router.config import POLICIES, PolicyName, RoutingConfig
from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.kv.index import BlockIndex, block_keys
from trio_router.routing.policy import Policy, RequestInfo, make_policy, request_info
from trio_router.table import Engine, EngineState, EngineStats, Model, RoutingTable

MODEL = "llama"
SIZES = (4, 10, 100, 1000, 5000)  # engines
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_metrics.txt"
NOW = 100.0
WORDS = (
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "an",
    "engine",
    "that",
    "already",
    "holds",
    "prefix",
    "of",
    "its",
    "conversation",
    "in",
    "kv",
    "cache",
    "so",
    "time",
    "first",
    "token",
    "drops",
)


def make_table(n: int, rng: random.Random, *, adapter_every: int = 0) -> RoutingTable:
    table = RoutingTable()
    for i in range(n):
        models = [MODEL] + (["adapter"] if adapter_every and i % adapter_every == 0 else [])
        engine = Engine(
            uid=f"{rng.getrandbits(64):016x}-pod-{i}",
            name=f"vllm-{i}",
            url=f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
            state=EngineState.ROUTABLE,
            models=tuple(Model(m) for m in models),
            model_ids=frozenset(models),
        )
        engine.in_flight = rng.randrange(4)
        engine.stats = EngineStats.scraped(
            {
                "running": float(rng.randrange(16)),
                "waiting": float(rng.randrange(3)),
                "kv_cache_usage": rng.random(),
            },
            now=NOW - 1,
            stale_after=15.0,
        )
        table.put(engine)
    return table


def sentence(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


PREFIX = RoutingConfig(policy="prefix_aware")


def conversation_bodies(rng: random.Random, count: int, chars: int) -> list[dict[str, Any]]:
    """`count` request bodies, each a turn of one of count/8 conversations of about `chars`."""
    bodies = []
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": sentence(rng, 400)}] for _ in range(max(1, count // 8))
    ]
    for _ in range(count):
        messages = rng.choice(conversations)
        while sum(len(m["content"]) for m in messages) < chars:
            role = "user" if messages[-1]["role"] != "user" else "assistant"
            messages.append({"role": role, "content": sentence(rng, rng.randrange(100, 600))})
        bodies.append({"model": MODEL, "messages": list(messages)})
        messages.append({"role": "assistant", "content": sentence(rng, 200)})
        if sum(len(m["content"]) for m in messages) > 1.5 * chars:
            del messages[1:]  # start the conversation over
    return bodies


def conversation_prompts(rng: random.Random, count: int, chars: int) -> list[RequestInfo]:
    return [request_info(body, {}, PREFIX) for body in conversation_bodies(rng, count, chars)]


def run_with_request_info(
    policy: Policy,
    table: RoutingTable,
    bodies: Sequence[dict[str, Any]],
    decisions: int,
    overhead: float,
) -> tuple[float, float]:
    """Mean and p99 µs of `request_info` + `choose` (best of three rounds)."""
    rounds = []
    for _ in range(3):
        costs = []
        gc.disable()
        try:
            for i in range(decisions):
                body = bodies[i % len(bodies)]
                candidates = table.routable(MODEL)
                t0 = time.perf_counter_ns()
                policy.choose(candidates, request_info(body, (), PREFIX))
                costs.append(time.perf_counter_ns() - t0 - overhead)
        finally:
            gc.enable()
        costs.sort()
        rounds.append((statistics.fmean(costs) / 1000, costs[int(len(costs) * 0.99)] / 1000))
    return min(rounds)


def timer_overhead() -> float:
    samples = []
    for _ in range(20000):
        t0 = time.perf_counter_ns()
        samples.append(time.perf_counter_ns() - t0)
    return float(statistics.median(samples))


def run(
    policy: Policy,
    table: RoutingTable,
    model: str,
    infos: Sequence[RequestInfo],
    decisions: int,
    rng: random.Random,
    overhead: float,
) -> tuple[float, float]:
    """Mean and p99 µs per decision, with in-flight counts moving as decisions are made; the
    best of three rounds, as other processes on the machine add noise."""
    engines = list(table)
    rounds = []
    for _ in range(3):
        costs = []
        gc.disable()
        try:
            for i in range(decisions):
                info = infos[i % len(infos)]
                candidates = table.routable(model)
                t0 = time.perf_counter_ns()
                engine = policy.choose(candidates, info).engine
                costs.append(time.perf_counter_ns() - t0 - overhead)
                engine.in_flight += 1
                drained = engines[rng.randrange(len(engines))]
                if drained.in_flight > 0:
                    drained.in_flight -= 1
        finally:
            gc.enable()
        costs.sort()
        rounds.append((statistics.fmean(costs) / 1000, costs[int(len(costs) * 0.99)] / 1000))
    return min(rounds)


def token_prompts(rng: random.Random, count: int) -> list[RequestInfo]:
    """`count` kv_aware requests: turns of count/8 conversations, as token ids."""
    conversations = [[rng.randrange(32000) for _ in range(400)] for _ in range(max(1, count // 8))]
    infos = []
    for _ in range(count):
        k = rng.randrange(len(conversations))
        tokens = conversations[k]
        tokens += [rng.randrange(32000) for _ in range(rng.randrange(50, 150))]
        if len(tokens) > 2000:
            del tokens[400:]  # start the conversation over
        infos.append(RequestInfo(MODEL, opening=f"conversation-{k}", tokens=tuple(tokens)))
    return infos


def hold_prefixes(index: BlockIndex, table: RoutingTable, infos: Sequence[RequestInfo]) -> None:
    """Each conversation's system prompt held by one engine, for as long as the run lasts."""
    engines = list(table)
    for info in infos:
        assert info.tokens is not None and info.opening is not None
        holder = engines[int(info.opening.rpartition("-")[2]) % len(engines)]
        keys = block_keys(info.tokens[:400], 16)
        index.speculate(holder.uid, keys, now=NOW, until=NOW + 1e9)


def build(
    name: PolicyName, table: RoutingTable, seed: int, kv_index: BlockIndex | None = None
) -> Policy:
    policy = make_policy(
        RoutingConfig(policy=name), clock=lambda: NOW, rng=random.Random(seed), kv_index=kv_index
    )
    table.add_remove_listener(lambda engine: policy.forget(engine.uid))
    return policy


def once_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    overhead = timer_overhead()
    users = [RequestInfo(MODEL, session_key=f"user-{rng.randrange(10**9)}") for _ in range(10000)]
    chats = conversation_prompts(rng, 4000, 2048)
    plain = [RequestInfo(MODEL)]
    tokens = token_prompts(rng, 4000)
    inputs = {
        "round_robin": plain,
        "least_loaded": plain,
        "session": users,
        "prefix_aware": chats,
        "kv_aware": tokens,
    }
    print(
        f"decision cost, µs (mean / p99), {args.decisions} decisions each; "
        f"timer overhead {overhead:.0f} ns subtracted"
    )
    print(f"{'policy':<28}" + "".join(f"{n:>20}" for n in SIZES))
    for name in POLICIES:
        row = []
        for n in SIZES:
            table = make_table(n, random.Random(args.seed + n))
            index = BlockIndex()
            if name == "kv_aware":
                hold_prefixes(index, table, tokens)
            policy = build(name, table, args.seed, index)
            policy.choose(table.routable(MODEL), inputs[name][0])  # builds caches (see below)
            mean, p99 = run(policy, table, MODEL, inputs[name], args.decisions, rng, overhead)
            row.append(f"{mean:8.2f} / {p99:7.2f}")
        print(f"{name:<28}" + "".join(f"{cell:>20}" for cell in row))

    row = []
    for n in SIZES:  # a LoRA adapter served by one engine in ten
        table = make_table(n, random.Random(args.seed + n), adapter_every=10)
        policy = build("session", table, args.seed)
        policy.choose(table.routable(MODEL), users[0])
        policy.choose(table.routable("adapter"), users[0])
        adapter_users = [RequestInfo("adapter", session_key=u.session_key) for u in users]
        mean, p99 = run(policy, table, "adapter", adapter_users, args.decisions, rng, overhead)
        row.append(f"{mean:8.2f} / {p99:7.2f}")
    print(f"{'session, model on 1/10':<28}" + "".join(f"{cell:>20}" for cell in row))

    print("\nprefix_aware with request_info (rendering the opening), µs (mean / p99)")
    for chars in (2048, 8192, 32768):
        bodies = conversation_bodies(rng, 1000, chars)
        row = []
        for n in SIZES:
            table = make_table(n, random.Random(args.seed + n))
            policy = build("prefix_aware", table, args.seed)
            mean, p99 = run_with_request_info(policy, table, bodies, args.decisions // 4, overhead)
            row.append(f"{mean:8.2f} / {p99:7.2f}")
        print(f"{f'{chars // 1024} KiB prompts':<28}" + "".join(f"{cell:>20}" for cell in row))
    for chars in (2048, 32768):  # the worst case: the whole prompt is the opening
        bodies = [
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": sentence(rng, 400)},
                    {"role": "user", "content": sentence(rng, chars - 400)},
                ],
            }
            for _ in range(200)
        ]
        row = []
        for n in SIZES:
            table = make_table(n, random.Random(args.seed + n))
            policy = build("prefix_aware", table, args.seed)
            mean, p99 = run_with_request_info(policy, table, bodies, args.decisions // 4, overhead)
            row.append(f"{mean:8.2f} / {p99:7.2f}")
        print(
            f"{f'{chars // 1024} KiB, one user message':<28}"
            + "".join(f"{cell:>20}" for cell in row)
        )

    print("\none-off costs at 1,000 engines, ms")
    table = make_table(1000, random.Random(args.seed))
    session = build("session", table, args.seed)
    print(
        f"  session: first decision (builds the ring, 100 points/engine) "
        f"{once_ms(lambda: session.choose(table.routable(MODEL), users[0])):.1f}"
    )
    uids = [e.uid for e in table]
    print(
        f"  session: remove one engine (listener) "
        f"{once_ms(lambda: table.remove(uids[0])):.3f}; next decision "
        f"{once_ms(lambda: session.choose(table.routable(MODEL), users[1])):.3f}"
    )
    removal = [once_ms(lambda u=u: table.remove(u)) for u in uids[1:200]]  # type: ignore[misc]
    print(
        f"  session: 199 more removals: max {max(removal):.2f} (ring compaction), "
        f"median {statistics.median(removal):.3f}"
    )
    table = make_table(1000, random.Random(args.seed))
    extra = make_table(1, random.Random(args.seed + 99))
    session = build("session", table, args.seed)
    session.choose(table.routable(MODEL), users[0])
    for engine in extra:
        table.put(engine)
    print(
        f"  session: decision after one engine joined (ring patch) "
        f"{once_ms(lambda: session.choose(table.routable(MODEL), users[1])):.2f}"
    )
    table.put(next(iter(table)))  # any table change: the next decision re-indexes
    print(
        f"  session: decision after any table change (re-index {len(table)} candidates) "
        f"{once_ms(lambda: session.choose(table.routable(MODEL), users[2])):.3f}"
    )
    prefix = build("prefix_aware", table, args.seed)
    prefix.choose(table.routable(MODEL), chats[0])
    table.put(next(iter(table)))
    print(
        f"  prefix_aware: decision after any table change (re-index) "
        f"{once_ms(lambda: prefix.choose(table.routable(MODEL), chats[1])):.3f}"
    )

    print("\nper-request costs outside the policy, µs")
    for chars in (2048, 32768):
        body = {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": sentence(rng, 500)} for _ in range(chars // 500)
            ],
        }
        reps = 2000
        for config in (RoutingConfig(policy="session"), PREFIX):
            t0 = time.perf_counter()
            for _ in range(reps):
                request_info(body, [(b"x-session-id", b"abc")], config)
            print(
                f"  request_info for {config.policy}, {chars // 1024} KiB chat: "
                f"{(time.perf_counter() - t0) / reps * 1e6:.1f}"
            )
    text = FIXTURE.read_text()
    big = text + "".join(f'# TYPE other_{i} gauge\nother_{i}{{a="b"}} {i}\n' for i in range(2000))
    for label, body_text in (("fixture", text), ("fixture + 2,000 other metrics", big)):
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            parse_vllm_metrics(body_text)
        print(
            f"  parse_vllm_metrics, {label} ({len(body_text) // 1024} KiB): "
            f"{(time.perf_counter() - t0) / reps * 1e6:.0f}"
        )


if __name__ == "__main__":
    main()
