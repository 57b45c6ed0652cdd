"""The shared-prefix workload of `bench_fidelity.py compare` and what it reads from an engine:
prefix-cache hit rate, preemptions, the client's and the engine's TTFT, vLLM's request phases
and, for a real engine, the CPU its processes ran and waited for; `summary` judges the goals
over every run."""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
from pathlib import Path
from typing import Any, Final

import httpx
import trio

import fidelity_host
from emulator_fleet import percentile, scrape
from trio_router.testing import vllm_engines

MODEL: Final = vllm_engines.MODEL_NAME
PHASES: Final = {
    "queue": "request_queue_time_seconds", "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds", "inter_token": "inter_token_latency_seconds",
}  # fmt: skip
FIRST_ID, LAST_ID = 16, 4000  # token ids that are ordinary words in both vocabularies


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(count)]


def api_server_cpu(pid: int) -> tuple[float, float]:
    """The API server's main thread (vLLM's asyncio loop): seconds it ran and seconds it
    waited, runnable, for a CPU (the kernel's schedstat)."""
    ran, waited, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(ran) / 1e9, int(waited) / 1e9


# -- measure -----------------------------------------------------------------------------------
def engine_cpu(pid: int) -> tuple[float, float]:
    """Every thread of an engine's processes (API server, engine core, worker: its process
    group): CPU seconds they ran, and seconds they waited, runnable, for a CPU."""
    ran = waited = 0
    for process, thread in fidelity_host.threads(pid):
        try:
            run, wait, _ = Path(f"/proc/{process}/task/{thread}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # gone meanwhile
        ran, waited = ran + int(run), waited + int(wait)
    return ran / 1e9, waited / 1e9


_TTFT_BUCKET: Final = re.compile(
    rb'^vllm:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', re.M
)


async def ttft_buckets(client: httpx.AsyncClient, url: str) -> dict[float, float]:
    """The engine's TTFT histogram: cumulative count per upper bound."""
    body = (await client.get(f"{url}/metrics")).content
    return {float(le): float(count) for le, count in _TTFT_BUCKET.findall(body)}


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """The `q` quantile of what a histogram gained between two scrapes, as Prometheus's
    `histogram_quantile` computes it: linear within the bucket that holds it."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower  # Prometheus answers the highest finite bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return float("nan")


async def shared_prefix(
    url: str, args: argparse.Namespace, seed: int, pid: int | None = None
) -> dict[str, Any]:
    """The shared-prefix workload of `seed` against one engine: hit rate, preemptions, TTFT
    p50; for a real engine (`pid`: its API server's), the engine's steps, and the CPU its API
    server's loop and all its threads ran and waited for."""
    rng = random.Random(seed)
    prefixes = [token_ids(rng, args.prefix_tokens) for _ in range(args.groups)]
    prompts = [
        prefixes[rng.randrange(args.groups)] + token_ids(rng, rng.randrange(32, args.suffix_tokens))
        for _ in range(args.requests)
    ]
    ttfts: list[float] = []
    limiter = trio.CapacityLimiter(args.concurrency)
    async with httpx.AsyncClient(timeout=600.0) as client:
        before = await scrape(client, [url])
        buckets = await ttft_buckets(client, url)
        cpu = (api_server_cpu(pid), engine_cpu(pid)) if pid is not None else None
        cpu_s: dict[str, float] = {}

        async def one(prompt: list[int]) -> None:
            async with limiter:
                ttfts.append(await fidelity_host.stream_ttft(url, MODEL, prompt, args.max_tokens))

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
                await trio.lowlevel.checkpoint()
        seconds = trio.current_time() - started
        if cpu is not None and pid is not None:
            (ran, waited), (all_ran, all_waited) = cpu
            (ran2, waited2), (all_ran2, all_waited2) = api_server_cpu(pid), engine_cpu(pid)
            cpu_s = {
                "api_server_ran_s": round(ran2 - ran, 2),
                "api_server_waited_s": round(waited2 - waited, 2),
                "engine_ran_s": round(all_ran2 - all_ran, 2),
                "engine_waited_s": round(all_waited2 - all_waited, 2),
            }
        after = await scrape(client, [url])
        ttft_reported = histogram_quantile(0.5, buckets, await ttft_buckets(client, url))

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("vllm:prefix_cache_queries_total")
    return {
        "seed": seed,
        "requests": len(ttfts),
        "hit_rate": round(delta("vllm:prefix_cache_hits_total") / queries, 4) if queries else None,
        "preemptions": delta("vllm:num_preemptions_total"),
        "ttft_p50_ms": round(percentile(sorted(ttfts), 50) * 1000, 1),
        "ttft_p90_ms": round(percentile(sorted(ttfts), 90) * 1000, 1),
        "engine_ttft_p50_ms": round(ttft_reported * 1000, 1),
        "engine_ttft_mean_ms": round(
            delta("vllm:time_to_first_token_seconds_sum")
            / max(1.0, delta("vllm:time_to_first_token_seconds_count"))
            * 1000,
            1,
        ),
        "wall_s": round(seconds, 1),
        "phases_ms": {  # the engine's own means: vLLM's request phases, its inter-token
            phase: round(
                delta(f"vllm:{name}_sum") / max(1.0, delta(f"vllm:{name}_count")) * 1000, 2
            )
            for phase, name in PHASES.items()
        },
        "steps": delta("vllm:iteration_tokens_total_count"),
    } | cpu_s


def summary(real: list[dict[str, Any]], emulated: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals over runs paired in order (the same seed on each side): the hit rates' largest
    gap in points; preemptions summed over all runs on each side, and per seed (one run's
    count moves with arrival timing alone, so the sums are what the goal is judged on); the
    client's TTFT p50, emulated over real, per run."""
    pairs = list(zip(real, emulated, strict=True))
    by_seed: dict[int, list[float]] = {}
    for one, other in pairs:
        counts = by_seed.setdefault(one["seed"], [0.0, 0.0])
        counts[0] += one["preemptions"]
        counts[1] += other["preemptions"]
    real_sum, emulated_sum = (sum(counts[side] for counts in by_seed.values()) for side in (0, 1))
    ttft = [other["ttft_p50_ms"] / one["ttft_p50_ms"] for one, other in pairs]
    gaps = [
        abs(one["hit_rate"] - other["hit_rate"]) * 100
        for one, other in pairs
        if one["hit_rate"] is not None and other["hit_rate"] is not None  # None: no queries
    ]
    return {
        "runs": len(pairs),
        "hit_rate_gap_points_max": round(max(gaps), 2) if gaps else None,
        "preemptions_real": real_sum,
        "preemptions_emulated": emulated_sum,
        "preemptions_ratio": round(emulated_sum / real_sum, 3) if real_sum else None,
        "preemptions_by_seed": {seed: counts for seed, counts in sorted(by_seed.items())},
        "ttft_p50_ratio_median": round(statistics.median(ttft), 3),
        "ttft_p50_ratio_range": [round(min(ttft), 3), round(max(ttft), 3)],
    }
