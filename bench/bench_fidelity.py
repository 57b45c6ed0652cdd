"""The cpu-tiny profile against the real vLLM CPU engine: its step timings fitted, and the
emulator's fidelity checked on one shared-prefix workload.

    python bench/bench_fidelity.py fit [--write] [--json-out FILE]
    python bench/bench_fidelity.py compare [--kv-cache-bytes 4194304] [--block-size 128]
                                           [--json-out FILE]

`fit`: one real engine (`trio_router.testing.vllm_engines`: the tiny model, the real tier's
settings, its worker on core 0), then one emulated engine on the cpu-tiny profile at time
scale 1, each measured alone with the same requests (token-id prompts, greedy,
`ignore_eos`): each request's time to first token from the engine's own histogram
(`vllm:time_to_first_token_seconds`, the sum's growth over one request sent alone, not
streamed) for prompts of `--lengths` tokens, and the mean inter-token latency
(`vllm:inter_token_latency_seconds`) of `--batches` streamed requests decoding together (so
that the step includes what streaming costs on a machine whose cores the engine shares with
its API server and the client). The fit, from
the real engine's figures: the decode step as `a + b * batch` (least squares), the prefill
step as `a + b + c * n + d * n(n+1)/2` (least squares over `c`, `d` >= 0); the profile's
`overhead_s` is `a` less the step's memory term, `per_sequence_s` is `b` less a decoded
token's compute, `compute_flops_per_s` makes a token's compute `c`, and
`attention_flops_per_pair` makes a pair's `d`. `--write` writes them into the shipped
cpu-tiny.toml (status "fitted", with this command and the date). The emulated engine's figures
are printed beside the real engine's (with `--write`, on the new coefficients).

`compare`: the same workload against one real engine and one emulated engine (cpu-tiny, the
same block size and number of KV blocks: the real engine's, from its log, else from its KV
bytes at 512 B per token), one after the other: `--groups` groups of requests sharing a
prefix of `--prefix-tokens` token ids, each request its own suffix and `--max-tokens`
greedy tokens, `--concurrency` streams in flight.
Reports each engine's prefix-cache hit rate (its counters, in tokens), its preemptions
(`vllm:num_preemptions_total`) and the client's TTFT p50 (streamed, wall seconds; the
emulator runs at time scale 1).

At most one real engine runs at a time; every engine is stopped at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from emulator_fleet import open_emulator, percentile, scrape
from trio_router.emulator.profiles import StepCost, StepShape, load_profile
from trio_router.testing import vllm_engines

MODEL: Final = vllm_engines.MODEL_NAME
REAL_HOST: Final = "127.0.1.61"
PROFILE_FILE: Final = (
    Path(__file__).resolve().parent.parent / "src/trio_router/emulator/profiles/cpu-tiny.toml"
)
_BLOCKS: Final = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")
FIRST_ID, LAST_ID = 16, 4000  # token ids that are ordinary words in both vocabularies


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(count)]


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    answer = await client.post(f"{url}/v1/completions", json=body)
    answer.raise_for_status()


async def stream_ttft(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> float:
    """One streamed completion read to its end: wall seconds to its first token event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started, ttft = trio.current_time(), float("nan")
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if ttft != ttft and line.startswith("data: {") and '"text"' in line:
                ttft = trio.current_time() - started
    return ttft


# -- fit ---------------------------------------------------------------------------------------
async def measure_steps(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT per prompt length (median of `--repeats`, each request alone) and the mean
    inter-token latency per batch, from the engine's own histograms."""
    rng = random.Random(args.seed)
    ttft: dict[int, float] = {}
    itl: dict[str, float] = {}  # "BATCHxPROMPT": seconds
    async with httpx.AsyncClient(timeout=300.0) as client:
        await complete(client, url, token_ids(rng, 16), 4)  # warm-up
        for length in args.lengths:
            seen = []
            for _ in range(args.repeats):
                before = await scrape(client, [url])
                await complete(client, url, token_ids(rng, length), 1)
                after = await scrape(client, [url])
                key = "vllm:time_to_first_token_seconds_sum"
                seen.append(after[key] - before[key])
            ttft[length] = sorted(seen)[len(seen) // 2]
        for batch, prompt in args.batches:
            before = await scrape(client, [url])
            async with trio.open_nursery() as nursery:
                for _ in range(batch):
                    ids = token_ids(rng, prompt)
                    nursery.start_soon(stream_ttft, client, url, ids, args.decode)
            after = await scrape(client, [url])
            total = "vllm:inter_token_latency_seconds_sum"
            count = "vllm:inter_token_latency_seconds_count"
            mean = (after[total] - before[total]) / max(1.0, after[count] - before[count])
            itl[f"{batch}x{prompt}"] = mean
    return {"ttft_s": ttft, "itl_s": itl}


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """The coefficients x minimising |rows x - ys| (normal equations, Gauss-Jordan)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col and a[col][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] if a[i][i] else 0.0 for i in range(n)]


def decode_shape(key: str, decode: int) -> tuple[int, int]:
    """A decode measurement's batch and the context its steps read (all its requests' prompts
    and, on average, half their answers)."""
    batch, prompt = map(int, key.split("x"))
    return batch, batch * (prompt + decode // 2)


def fit_step(measured: dict[str, Any], base: StepCost, args_decode: int) -> StepCost:
    """cpu-tiny's coefficients from a real engine's figures (the module says how); the
    model's shape (`weight_bytes`, `kv_bytes_per_token`, `flops_per_token`) is kept from
    `base`."""
    decodes = [decode_shape(key, args_decode) for key in measured["itl_s"]]
    a, b, e = least_squares(
        [[1.0, batch, context] for batch, context in decodes], list(measured["itl_s"].values())
    )
    memory_bytes_per_s = base.kv_bytes_per_token / e if e > 0 else base.memory_bytes_per_s
    lengths = sorted(measured["ttft_s"])
    rest = [measured["ttft_s"][n] - a - b for n in lengths]
    c, d = least_squares([[n, n * (n + 1) / 2] for n in lengths], rest)
    if d < 0:  # no measurable quadratic term: the linear one alone
        c, d = least_squares([[n] for n in lengths], rest)[0], 0.0
    c = max(c, 1e-9)
    flops = base.flops_per_token / c
    memory = base.weight_bytes / memory_bytes_per_s
    return StepCost(
        overhead_s=round(max(0.0, a - memory), 6),
        per_sequence_s=round(max(0.0, b - c), 6),
        weight_bytes=base.weight_bytes,
        kv_bytes_per_token=base.kv_bytes_per_token,
        memory_bytes_per_s=float(f"{memory_bytes_per_s:.4g}"),
        flops_per_token=base.flops_per_token,
        attention_flops_per_pair=round(d * flops, 3),
        compute_flops_per_s=float(f"{flops:.4g}"),
    )


def predicted(step: StepCost, measured: dict[str, Any], decode: int) -> dict[str, Any]:
    """The profile's step durations for the measured shapes."""
    ttft = {}
    for n in measured["ttft_s"]:
        shape = StepShape(sequences=1, tokens=n, context_tokens=n, attention_pairs=n * (n + 1) // 2)
        ttft[n] = step.seconds(shape)
    itl = {}
    for key in measured["itl_s"]:
        batch, context = decode_shape(key, decode)
        shape = StepShape(sequences=batch, tokens=batch, context_tokens=context,
                          attention_pairs=context)  # fmt: skip
        itl[key] = step.seconds(shape)
    return {"ttft_s": ttft, "itl_s": itl}


def write_profile(step: StepCost, command: str) -> None:
    """The fitted coefficients into the shipped cpu-tiny.toml, with what produced them."""
    text = PROFILE_FILE.read_text()
    head = text[: text.index("\n[step]\n") + 1]
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    head = re.sub(r'(?m)^status = ".*"$', 'status = "fitted"', head)
    lines = [f"[step]\n# Fitted on {today} by `{command}`\n"]
    for name in StepCost.__dataclass_fields__:
        lines.append(f"{name} = {getattr(step, name)!r}\n")
    PROFILE_FILE.write_text(head + "".join(lines))


def run_real(
    args: argparse.Namespace, kv_cache_bytes: int, body: Callable[[str], Any]
) -> tuple[Any, int]:
    """`body(url)` (an async function) against one real engine; its result and the engine's
    number of KV blocks (from its log)."""
    env = vllm_engines.ensure_environment(log=print)
    port = vllm_engines.free_port([REAL_HOST])
    spec = vllm_engines.EngineSpec(
        host=REAL_HOST, port=port, kv_cache_bytes=kv_cache_bytes, block_size=args.block_size
    )
    with tempfile.TemporaryDirectory() as logs:
        with vllm_engines.running_engines(env, [spec], log_dir=Path(logs)):
            result = trio.run(body, spec.url)
        log = next(Path(logs).glob("*.log")).read_text()
    found = _BLOCKS.search(log)
    tokens = int(found.group(1).replace(",", "")) if found else kv_cache_bytes // 512
    return result, tokens // args.block_size


def run_emulated(args: argparse.Namespace, blocks: int, body: Callable[[str], Any]) -> Any:
    """`body(url)` against one emulated engine on cpu-tiny at time scale 1, with the real
    engine's block size and number of blocks."""

    async def main() -> Any:
        extra = ["--profile", "cpu-tiny", "--block-size", str(args.block_size),
                 "--num-gpu-blocks-override", str(blocks)]  # fmt: skip
        async with open_emulator(1, 1.0, *extra) as (_, urls, _):
            return await body(urls[0])

    return trio.run(main)


def fit(args: argparse.Namespace) -> dict[str, Any]:
    def measure(url: str) -> Any:
        return measure_steps(url, args)

    real, blocks = run_real(args, 16 << 20, measure)
    print(json.dumps({"real": real, "blocks": blocks}), flush=True)
    base = load_profile("cpu-tiny").step
    step = fit_step(real, base, args.decode)
    if args.write:
        write_profile(step, "python bench/bench_fidelity.py " + " ".join(sys.argv[1:]))
    emulated = run_emulated(args, blocks, measure)
    return {
        "real": real,
        "emulated": emulated,
        "fitted": {name: getattr(step, name) for name in StepCost.__dataclass_fields__},
        "fitted_predicts": predicted(step, real, args.decode),
    }


# -- compare -----------------------------------------------------------------------------------
async def shared_prefix(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The shared-prefix workload against one engine: hit rate, preemptions, TTFT p50."""
    rng = random.Random(args.seed)
    prefixes = [token_ids(rng, args.prefix_tokens) for _ in range(args.groups)]
    prompts = [
        prefixes[rng.randrange(args.groups)] + token_ids(rng, rng.randrange(32, args.suffix_tokens))
        for _ in range(args.requests)
    ]
    ttfts: list[float] = []
    limiter = trio.CapacityLimiter(args.concurrency)
    async with httpx.AsyncClient(timeout=600.0) as client:
        before = await scrape(client, [url])

        async def one(prompt: list[int]) -> None:
            async with limiter:
                ttfts.append(await stream_ttft(client, url, prompt, args.max_tokens))

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
                await trio.lowlevel.checkpoint()
        seconds = trio.current_time() - started
        after = await scrape(client, [url])

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("vllm:prefix_cache_queries_total")
    return {
        "requests": len(ttfts),
        "hit_rate": round(delta("vllm:prefix_cache_hits_total") / queries, 4) if queries else None,
        "preemptions": delta("vllm:num_preemptions_total"),
        "ttft_p50_ms": round(percentile(sorted(ttfts), 50) * 1000, 1),
        "ttft_p90_ms": round(percentile(sorted(ttfts), 90) * 1000, 1),
        "engine_ttft_mean_ms": round(
            delta("vllm:time_to_first_token_seconds_sum")
            / max(1.0, delta("vllm:time_to_first_token_seconds_count"))
            * 1000,
            1,
        ),
        "wall_s": round(seconds, 1),
    }


def compare(args: argparse.Namespace) -> dict[str, Any]:
    def workload(url: str) -> Any:
        return shared_prefix(url, args)

    real, blocks = run_real(args, args.kv_cache_bytes, workload)
    print(json.dumps({"real": real, "blocks": blocks}), flush=True)
    emulated = run_emulated(args, blocks, workload)
    return {"block_size": args.block_size, "num_gpu_blocks": blocks, "real": real,
            "emulated": emulated}  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fitting = commands.add_parser("fit", help="fit cpu-tiny's step to the real engine")
    fitting.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512, 1024, 1536, 2000])
    fitting.add_argument(
        "--batches",
        type=lambda text: tuple(map(int, text.split("x"))),
        nargs="+",
        default=[(1, 32), (4, 32), (16, 32), (1, 1024), (4, 1024), (8, 900), (16, 800)],
        metavar="BATCHxPROMPT",
        help="decode measurements: requests decoding together and their prompt tokens",
    )
    fitting.add_argument("--repeats", type=int, default=5)
    fitting.add_argument("--decode", type=int, default=64, help="tokens per decode request")
    fitting.add_argument("--write", action="store_true", help="write cpu-tiny.toml")
    comparing = commands.add_parser("compare", help="one shared-prefix workload on both")
    comparing.add_argument("--kv-cache-bytes", type=int, default=4 << 20)
    comparing.add_argument("--groups", type=int, default=6)
    comparing.add_argument("--prefix-tokens", type=int, default=640)
    comparing.add_argument("--suffix-tokens", type=int, default=256)
    comparing.add_argument("--requests", type=int, default=96)
    comparing.add_argument("--concurrency", type=int, default=16)
    comparing.add_argument("--max-tokens", type=int, default=96)
    for command in (fitting, comparing):
        command.add_argument("--block-size", type=int, default=128)
        command.add_argument("--seed", type=int, default=0)
        command.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = fit(args) if args.command == "fit" else compare(args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
