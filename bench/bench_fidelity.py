"""The cpu-tiny profile against the real vLLM CPU engine: its step timings fitted, and the
emulator's fidelity checked on one shared-prefix workload.

    python bench/bench_fidelity.py fit [--write] [--json-out FILE]
    python bench/bench_fidelity.py compare [--seeds 0 1 ...] [--repeats 1]
                                           [--kv-cache-bytes 4194304] [--block-size 128]
                                           [--placement split] [--warm-up 2047]
                                           [--json-out FILE]

`fit`: one real engine (`trio_router.testing.vllm_engines`: the tiny model, the real tier's
settings, its worker on core 0), then one emulated engine on the cpu-tiny profile at time
scale 1, each measured alone with the same requests (token-id prompts, greedy,
`ignore_eos`): each request's prefill phase and time to first token from the engine's own
histograms (`vllm:request_prefill_time_seconds`, from the step that first scheduled it to the
one that made its first token, and `vllm:time_to_first_token_seconds`: the sums' growth over
one request sent alone, not streamed; median of `--repeats`) for prompts of `--lengths` tokens,
and the mean inter-token latency
(`vllm:inter_token_latency_seconds`, the engine core's timestamps; median of `--repeats`) of
`--batches` requests
decoding together over their second `--decode` tokens (the histogram's growth over a run of
twice `--decode` tokens less its growth over a run of `--decode`, new prompts each, so that the
steps which prefill the prompts, mixed into the first tokens' intervals, cancel out; not
streamed: streamed requests sent at once reach the engine core spread
out on this machine, and decode in smaller batches than sent; what streaming costs is the
front end's, below). The fit, from
the real engine's figures: the decode step as `a + b * batch + e * context` (least squares),
the prefill step (the prefill phase) as `a + b + i + c * n + d * n(n+1)/2` (least squares,
`d` >= 0, the term `i` at least 0); the profile's
`overhead_s` is `a` less the step's memory term, `per_sequence_s` is `b` less a decoded
token's compute, `memory_bytes_per_s` makes a context token's read `e`, `compute_flops_per_s`
makes a token's compute `c`, `attention_flops_per_pair` makes a pair's `d`, and
`prefill_step_s` is `i` with the memory term and the decoded token's compute that a
compute-bound prefill step does not pay. `--write` writes them into the shipped
cpu-tiny.toml (status "fitted", with this command and the date). The emulated engine's figures
are printed beside the real engine's (with `--write`, on the new coefficients).

The front end (the profile's `[front_end]`: vLLM's API server, a process of its own) is fitted
from the API server's own CPU accounting: over streamed loads (32 one-token requests one at
a time, one stream of 256 tokens, `--streams` streams of 128 tokens at once; each
`--repeats` times) its main thread's CPU seconds (the kernel's schedstat) against the loads'
requests, the engine's steps (`vllm:iteration_tokens_total`'s count) and output tokens, by
least squares: `cpu = request * requests + per_output * steps + per_output_token * tokens`.
Each coefficient is divided by the share of a CPU the thread got while it had work
(ran / (ran + waited runnable), over all the loads), so that the terms are its wall time on
this machine beside the engine core. A request's work is split at the engine core: the part
before the core has it (`arrival_s`) is what a lone request's TTFT has beyond its queue and
prefill phases (vLLM's `request_queue_time` and `request_prefill_time` histograms, which the
engine core times), less its first output's work; the rest (`finish_s`) comes after its
last token.

`compare`: the same workload against one real engine and one emulated engine (cpu-tiny, the
same block size and number of KV blocks: the real engine's, from its log, else from its KV
bytes at 512 B per token), one after the other: `--groups` groups of requests sharing a
prefix of `--prefix-tokens` token ids, each request its own suffix and `--max-tokens`
greedy tokens, `--concurrency` streams in flight; the workload of each of `--seeds` (its
prompts) `--repeats` times on each engine, each engine started and warmed once.
Reports each engine's prefix-cache hit rate (its counters, in tokens), its preemptions
(`vllm:num_preemptions_total`) and the client's TTFT p50 (streamed, wall seconds; the
emulator runs at time scale 1); for the real engine also its steps
(`vllm:iteration_tokens_total`'s count) and, from the kernel's schedstat, the CPU seconds its
API server's loop and all its threads (API server, engine core, worker) ran and waited,
runnable, for a CPU during the workload. Its `summary` (`fidelity_workload.summary`) judges
the goals over every run: the hit rates' largest gap, the preemptions summed over all runs on
each side (and per seed), and the client's TTFT p50, emulated over real, per run.

Both commands first raise this process's and the engines' CPU priority, place the real
engine's processes (`--placement split`: engine core and worker on core 0, API server and
this client on core 1) and run every prompt length up to `--warm-up` tokens once on each
engine: `fidelity_host` says why. `compare` also reports each engine's steps and its own
means of vLLM's request phases (queue, prefill, decode) and inter-token latency.

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

import fidelity_host
from emulator_fleet import open_emulator, scrape
from fidelity_workload import MODEL, api_server_cpu, shared_prefix, summary, token_ids
from trio_router.emulator.profiles import FrontEndCost, StepCost, StepShape, load_profile
from trio_router.testing import vllm_engines

REAL_HOST: Final = "127.0.1.61"
PROFILE_FILE: Final = (
    Path(__file__).resolve().parent.parent / "src/trio_router/emulator/profiles/cpu-tiny.toml"
)
_BLOCKS: Final = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    answer = await client.post(f"{url}/v1/completions", json=body)
    answer.raise_for_status()


# -- fit ---------------------------------------------------------------------------------------
async def front_end_load(
    client: httpx.AsyncClient, url: str, pid: int, prompts: list[list[int]], max_tokens: int,
    concurrency: int,
) -> list[float]:  # fmt: skip
    """Streamed requests against a real engine: [requests, engine steps, output tokens, API
    server CPU seconds, its seconds waiting for a CPU]."""
    limiter = trio.CapacityLimiter(concurrency)

    async def one(prompt: list[int]) -> None:
        async with limiter:
            await fidelity_host.stream_ttft(url, MODEL, prompt, max_tokens)

    before, (ran, waited) = await scrape(client, [url]), api_server_cpu(pid)
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    after, (ran2, waited2) = await scrape(client, [url]), api_server_cpu(pid)
    steps, tokens = "vllm:iteration_tokens_total_count", "vllm:generation_tokens_total"
    return [len(prompts), after[steps] - before[steps], after[tokens] - before[tokens],
            ran2 - ran, waited2 - waited]  # fmt: skip


async def measure_front_end(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """The API server's CPU time over streamed workloads (requests of one token one at a
    time, one long stream, `--streams` streams at once), each `--repeats` times."""
    rng = random.Random(args.seed + 1)
    loads = []
    async with httpx.AsyncClient(timeout=300.0) as client:
        for _ in range(args.repeats):
            arrivals = [token_ids(rng, 64) for _ in range(32)]
            loads.append(await front_end_load(client, url, pid, arrivals, 1, 1))
            loads.append(await front_end_load(client, url, pid, [token_ids(rng, 32)], 256, 1))
            streams = [token_ids(rng, 32) for _ in range(args.streams)]
            loads.append(await front_end_load(client, url, pid, streams, 128, args.streams))
    return {"loads": loads}


def fit_front_end(measured: dict[str, Any]) -> FrontEndCost:
    """The front end's terms from the API server's CPU time: `cpu = request * requests +
    per_output * steps + per_output_token * tokens` (least squares), each divided by the share
    of a CPU its loop got while it had work (ran / (ran + waited), over all the loads): the
    front end's wall time per piece of work on this machine, under the engine's own load.
    A request's work is split at the engine core: `arrival_s` is the part before the core has
    it (the median lone request's TTFT less its queue and prefill phases, less its first
    output's work), `finish_s` the rest, which comes after its last token."""
    loads = measured["loads"]
    coefficients = least_squares([load[:3] for load in loads], [load[3] for load in loads])
    ran, waited = sum(load[3] for load in loads), sum(load[4] for load in loads)
    share = ran / (ran + waited)
    request, per_output, per_token = (max(0.0, c) / share for c in coefficients)
    before = min(request, max(0.0, measured["front_s"] - per_output - per_token))
    return FrontEndCost(arrival_s=round(before, 6), per_output_s=round(per_output, 6),
                        per_output_token_s=round(per_token, 7),
                        finish_s=round(request - before, 6))  # fmt: skip


async def measure_steps(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT per prompt length (median of `--repeats`, each request alone) and the mean
    inter-token latency per batch (median of `--repeats`), from the engine's own
    histograms; and each lone request's TTFT less its queue and prefill phases (the front
    end's part of it: its arrival's work and its first output's), the median."""
    rng = random.Random(args.seed)
    ttft: dict[int, float] = {}
    prefill: dict[int, float] = {}
    fronts: list[float] = []
    itl: dict[str, float] = {}  # "BATCHxPROMPT": seconds
    async with httpx.AsyncClient(timeout=300.0) as client:
        await complete(client, url, token_ids(rng, 16), 4)  # warm-up
        for length in args.lengths:
            seen, prefills = [], []
            for _ in range(args.repeats):
                before = await scrape(client, [url])
                await complete(client, url, token_ids(rng, length), 1)
                after = await scrape(client, [url])
                key = "vllm:time_to_first_token_seconds_sum"
                seen.append(after[key] - before[key])
                phases = ("vllm:request_queue_time_seconds_sum",
                          "vllm:request_prefill_time_seconds_sum")  # fmt: skip
                fronts.append(seen[-1] - sum(after[p] - before[p] for p in phases))
                prefills.append(after[phases[1]] - before[phases[1]])
            ttft[length] = sorted(seen)[len(seen) // 2]
            prefill[length] = sorted(prefills)[len(prefills) // 2]
        for batch, prompt in args.batches:
            means = []
            for _ in range(args.repeats):
                # The same batch with twice the tokens, less it: its prefill steps cancel out.
                short, long = [
                    await decode_itl(
                        client, url, [token_ids(rng, prompt) for _ in range(batch)], tokens
                    )
                    for tokens in (args.decode, 2 * args.decode)
                ]
                means.append((long[0] - short[0]) / max(1.0, long[1] - short[1]))
            itl[f"{batch}x{prompt}"] = sorted(means)[len(means) // 2]
    front = sorted(fronts)[len(fronts) // 2]
    return {"ttft_s": ttft, "prefill_s": prefill, "itl_s": itl, "front_s": front}


async def decode_itl(
    client: httpx.AsyncClient, url: str, prompts: list[list[int]], tokens: int
) -> tuple[float, float]:
    """`prompts` sent at once, `tokens` each: what the engine's inter-token histogram's sum
    and count grew by."""
    before = await scrape(client, [url])
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(complete, client, url, prompt, tokens)
    after = await scrape(client, [url])
    total, count = "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"
    return after[total] - before[total], after[count] - before[count]


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
    and, on average, their first `decode` tokens and half the next `decode`)."""
    batch, prompt = map(int, key.split("x"))
    return batch, batch * (prompt + decode + decode // 2)


def fit_step(measured: dict[str, Any], base: StepCost, args_decode: int) -> StepCost:
    """cpu-tiny's coefficients from a real engine's figures (the module says how); the
    model's shape (`weight_bytes`, `kv_bytes_per_token`, `flops_per_token`) is kept from
    `base`."""
    decodes = [decode_shape(key, args_decode) for key in measured["itl_s"]]
    a, b, e = least_squares(
        [[1.0, batch, context] for batch, context in decodes], list(measured["itl_s"].values())
    )
    memory_bytes_per_s = base.kv_bytes_per_token / e if e > 0 else base.memory_bytes_per_s
    lengths = sorted(measured["prefill_s"])
    rest = [measured["prefill_s"][n] - a - b for n in lengths]
    # The intercept is what a step with prefill work costs beyond a decode step's fixed
    # costs (the memory term a compute-bound step does not pay, and a decoded token's
    # compute, are in a + b).
    i, c, d = least_squares([[1.0, n, n * (n + 1) / 2] for n in lengths], rest)
    if d < 0:  # no measurable quadratic term: the linear one alone
        (i, c), d = least_squares([[1.0, n] for n in lengths], rest), 0.0
    c = max(c, 1e-9)
    flops = base.flops_per_token / c
    memory = base.weight_bytes / memory_bytes_per_s
    return StepCost(
        prefill_step_s=round(max(0.0, i + memory + c), 6),
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
    prefill = {}
    for n in measured["prefill_s"]:
        pairs = n * (n + 1) // 2
        shape = StepShape(
            sequences=1, tokens=n, context_tokens=n, attention_pairs=pairs, prefills=1
        )
        prefill[n] = step.seconds(shape)
    itl = {}
    for key in measured["itl_s"]:
        batch, context = decode_shape(key, decode)
        shape = StepShape(sequences=batch, tokens=batch, context_tokens=context,
                          attention_pairs=context)  # fmt: skip
        itl[key] = step.seconds(shape)
    return {"prefill_s": prefill, "itl_s": itl}


def write_profile(step: StepCost, front_end: FrontEndCost, command: str) -> None:
    """The fitted coefficients into the shipped cpu-tiny.toml, with what produced them."""
    text = PROFILE_FILE.read_text()
    head = text[: text.index("\n[step]\n") + 1]
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    head = re.sub(r'(?m)^status = ".*"$', 'status = "fitted"', head)
    lines = [f"[step]\n# Fitted on {today} by `{command}`\n"]
    for name in StepCost.__dataclass_fields__:
        lines.append(f"{name} = {getattr(step, name)!r}\n")
    lines.append("\n[front_end]\n")
    for name in FrontEndCost.__dataclass_fields__:
        lines.append(f"{name} = {getattr(front_end, name)!r}\n")
    PROFILE_FILE.write_text(head + "".join(lines))


def run_real(
    args: argparse.Namespace, kv_cache_bytes: int, body: Callable[[str, int], Any]
) -> tuple[Any, int]:
    """`body(url, pid)` (an async function; pid: the API server's) against one real engine;
    its result and the engine's number of KV blocks (from its log)."""
    env = vllm_engines.ensure_environment(log=print)
    port = vllm_engines.free_port([REAL_HOST])
    spec = vllm_engines.EngineSpec(
        host=REAL_HOST, port=port, kv_cache_bytes=kv_cache_bytes, block_size=args.block_size
    )

    async def prepared(url: str, pid: int) -> Any:
        print(f"the engine's CPU group: {fidelity_host.raise_priority(pid)}", flush=True)
        if args.placement == "split" and not fidelity_host.place(pid):
            print("one CPU: the engine's processes left where they are", flush=True)
        await warmed(args, url)
        return await body(url, pid)

    with tempfile.TemporaryDirectory() as logs:
        with vllm_engines.running_engines(env, [spec], log_dir=Path(logs)) as engines:
            result = trio.run(prepared, spec.url, engines[0].process.pid)
        log = next(Path(logs).glob("*.log")).read_text()
    found = _BLOCKS.search(log)
    tokens = int(found.group(1).replace(",", "")) if found else kv_cache_bytes // 512
    return result, tokens // args.block_size


async def warmed(args: argparse.Namespace, url: str) -> None:
    """One request of each prompt length up to `--warm-up` tokens, one at a time, each a step
    of that many tokens (its own prompt: nothing cached), on the engine at `url`: vLLM's CPU
    build pays once for each step size it has not run (`fidelity_host`). Both engines get
    the same requests."""
    rng = random.Random(-1)
    async with httpx.AsyncClient(timeout=60.0) as client:
        for length in range(1, args.warm_up + 1):
            await complete(client, url, token_ids(rng, length), 1)


def run_emulated(args: argparse.Namespace, blocks: int, body: Callable[[str], Any]) -> Any:
    """`body(url)` against one emulated engine on cpu-tiny at time scale 1, with the real
    engine's block size and number of blocks."""

    async def main() -> Any:
        extra = ["--profile", "cpu-tiny", "--block-size", str(args.block_size),
                 "--num-gpu-blocks-override", str(blocks)]  # fmt: skip
        async with open_emulator(1, 1.0, *extra) as (process, urls, _):
            print(f"the emulator's CPU group: {fidelity_host.raise_priority(process.pid)}")
            await warmed(args, urls[0])
            return await body(urls[0])

    return trio.run(main)


def fit(args: argparse.Namespace) -> dict[str, Any]:
    async def measure_real(url: str, pid: int) -> Any:
        return await measure_steps(url, args) | await measure_front_end(url, pid, args)

    def measure(url: str) -> Any:
        return measure_steps(url, args)

    real, blocks = run_real(args, 16 << 20, measure_real)
    print(json.dumps({"real": real, "blocks": blocks}), flush=True)
    base = load_profile("cpu-tiny").step
    step, front_end = fit_step(real, base, args.decode), fit_front_end(real)
    if args.write:
        command = "python bench/bench_fidelity.py " + " ".join(sys.argv[1:])
        write_profile(step, front_end, command)
    emulated = run_emulated(args, blocks, measure)
    return {
        "real": real,
        "emulated": emulated,
        "fitted": {name: getattr(step, name) for name in StepCost.__dataclass_fields__},
        "fitted_front_end": {n: getattr(front_end, n) for n in FrontEndCost.__dataclass_fields__},
        "fitted_predicts": predicted(step, real, args.decode),
    }


# -- compare -----------------------------------------------------------------------------------
def compare(args: argparse.Namespace) -> dict[str, Any]:
    """The workload of each `--seeds` seed `--repeats` times on the real engine, then on the
    emulated one (each started once, warmed once)."""

    async def workload(url: str, pid: int | None = None) -> list[dict[str, Any]]:
        runs = []
        for _ in range(args.repeats):
            for seed in args.seeds:
                runs.append(await shared_prefix(url, args, seed, pid))
                print(json.dumps(runs[-1]), flush=True)
        return runs

    real, blocks = run_real(args, args.kv_cache_bytes, workload)
    emulated = run_emulated(args, blocks, workload)
    return {"block_size": args.block_size, "num_gpu_blocks": blocks, "real": real,
            "emulated": emulated, "summary": summary(real, emulated)}  # fmt: skip


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
    fitting.add_argument("--decode", type=int, default=64, help="tokens per decode request")
    fitting.add_argument("--streams", type=int, default=16, help="streams at once (front end)")
    fitting.add_argument("--write", action="store_true", help="write cpu-tiny.toml")
    fitting.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    comparing = commands.add_parser("compare", help="one shared-prefix workload on both")
    comparing.add_argument("--kv-cache-bytes", type=int, default=4 << 20)
    comparing.add_argument("--groups", type=int, default=6)
    comparing.add_argument("--prefix-tokens", type=int, default=640)
    comparing.add_argument("--suffix-tokens", type=int, default=256)
    comparing.add_argument("--requests", type=int, default=96)
    comparing.add_argument("--concurrency", type=int, default=16)
    comparing.add_argument("--max-tokens", type=int, default=96)
    comparing.add_argument("--seeds", type=int, nargs="+", default=[0], help="workload seeds")
    for command, repeats in ((fitting, 5), (comparing, 1)):
        command.add_argument("--repeats", type=int, default=repeats)
        command.add_argument("--block-size", type=int, default=128)
        command.add_argument(
            "--placement", choices=["split", "as-started"], default="split",
            help="split: the real engine's core and worker on core 0, its API server and "
            "this client on core 1 (fidelity_host.place)",
        )  # fmt: skip
        command.add_argument(
            "--warm-up", type=int, default=2047, metavar="TOKENS",
            help="run every prompt length up to TOKENS once first (0: none)",
        )  # fmt: skip
        command.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"this session's CPU group: {fidelity_host.raise_priority()}", flush=True)
    result = fit(args) if args.command == "fit" else compare(args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
