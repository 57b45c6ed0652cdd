"""Routing quality measured at real vLLM engines: their own prefix-cache hit rate and the time to
first token, per routing policy and router, next to the best any routing could reach.

    python bench/bench_engines.py hits [--routers trio:round_robin,trio:prefix_aware,...]
                                      [--replicas 2] [--json-out FILE]
    python bench/bench_engines.py ttft [--rounds 3] [--prompts 60] [--rate 8]

Engines: four real vLLM engines (vLLM's CPU build, the tiny model of
`trio_router.testing.vllm_engines`) on 127.0.1.31-34, their KV caches small enough
(`--kv-cache-mib`, 4 MiB: 8,192 tokens each) that where a request goes decides whether its
prefix is still cached. Built and started by the script (the first run installs the engine
environment, about 3 minutes); stopped at the end.

`hits`: the workload mixes `--groups` groups of `--per-group` requests, each group sharing a long
system prompt (`--system-words`, 600) with a different short question per request, and
`--conversations` multi-turn conversations of `--turns` turns whose history grows (each turn
sends the whole chat so far; the answers are the engines', greedy). `--concurrency` requests are
in flight at once, in a seeded order. With `--skew S` the groups are not alike: as many group
requests, each drawn from group k (0, 1, ...) with weight 1/(k+1)^S (S = 1.2 over 8 groups: the
first takes about a third); with `--concurrency` 16 or more the four engines are saturated.
Before each router's run the engines' prefix caches are reset (vLLM's `/reset_prefix_cache`,
dev mode); the hit rate is the change of `vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total` (tokens), summed over the engines. "best" is the hit rate
of one engine with an unbounded cache serving the same requests in the same order: each
prompt's longest common prefix with an earlier one, in whole blocks, at most all but its last
token (vLLM always computes the last) — what any routing could reach.
TTFT is the client's time to the first streamed token (p50, p99). With `--replicas 2` every
router runs as two processes (replicas) and consecutive requests alternate between them.

Routers (`--routers`): `trio:POLICY[+KEY=VALUE...]` (trio_router, `routing.policy = POLICY`
and any other `[routing]` keys given, static
discovery), and when their environment names them (as `../shared/bench`'s README sets them
up, never committed): `production-stack:LOGIC` (`PEER_PS_PYTHON`, `PEER_PS_SRC`; e.g.
`roundrobin`, `prefixaware`), `vllm-router-rs:POLICY` (`PEER_VR_BIN`; e.g. `round_robin`,
`cache_aware`).

`ttft`: the latency a router adds for a real client: `vllm bench serve` (from the engine
environment; random prompts of `--input-len` tokens, `--output-len` tokens out, `--prompts`
requests at `--rate` per second) straight to one engine and through each router in front of
that engine alone, in interleaved rounds (`--rounds`, a new seed per round, the prefix cache
reset before each), reporting the median over rounds of each target's TTFT p50 and p99, and the
difference to direct.

Loopback only; every load is bounded by its request count and `--limit` seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from trio_router.testing import vllm_engines
from trio_router.testing._vllm_model import WORDS
from trio_router.testing.processes import open_command
from trio_router.testing.vllm_engines import MODEL_NAME, EngineProcess

ENGINES: Final = 4
FIRST_HOST: Final = 31  # engines on 127.0.1.31, .32, ...
CHAT: Final = "/v1/chat/completions"
START_S: Final = 60.0  # a router process must route within this


# -- the workload ------------------------------------------------------------------------------
def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    questions: list[str]
    lock: trio.Lock = field(default_factory=trio.Lock)  # one turn at a time


@dataclass
class Workload:
    """Every request's source: a group's question or a conversation's next turn, in order."""

    groups: list[tuple[str, list[str]]]  # (system prompt, questions)
    conversations: list[Conversation]
    order: list[tuple[str, int]]  # ("group", g) or ("chat", c), shuffled


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    groups = [
        (
            words(rng, args.system_words),
            [words(rng, rng.randrange(12, 30)) + "?" for _ in range(args.per_group)],
        )
        for _ in range(args.groups)
    ]
    conversations = [
        Conversation(
            [{"role": "system", "content": words(rng, 40)}],
            [words(rng, rng.randrange(30, 60)) for _ in range(args.turns)],
        )
        for _ in range(args.conversations)
    ]
    if args.skew > 0:  # popularity 1/rank^s: as many group requests, drawn by weight
        weights = [1 / (rank + 1) ** args.skew for rank in range(args.groups)]
        drawn = rng.choices(range(args.groups), weights, k=args.groups * args.per_group)
        order = [("group", g) for g in drawn]
    else:
        order = [("group", g) for g in range(args.groups) for _ in range(args.per_group)]
    order += [("chat", c) for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)
    return Workload(groups, conversations, order)


# -- routers -----------------------------------------------------------------------------------
@dataclass
class RouterSpec:
    kind: str  # trio | production-stack | vllm-router-rs
    policy: str
    knobs: tuple[str, ...] = ()  # trio: extra [routing] lines, KEY=VALUE

    @property
    def label(self) -> str:
        return " ".join([self.kind, self.policy, *self.knobs])

    def available(self) -> str | None:
        """Why this router cannot run here, or None."""
        if self.kind == "trio":
            return None
        if self.kind == "production-stack":
            if not (os.environ.get("PEER_PS_PYTHON") and os.environ.get("PEER_PS_SRC")):
                return "PEER_PS_PYTHON and PEER_PS_SRC not set"
            return None
        if self.kind == "vllm-router-rs":
            return None if os.environ.get("PEER_VR_BIN") else "PEER_VR_BIN not set"
        return f"unknown router kind {self.kind!r}"


def parse_routers(text: str) -> list[RouterSpec]:
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, policy = item.partition(":")
        policy, *knobs = policy.split("+")
        if not policy or not all("=" in k for k in knobs) or (knobs and kind != "trio"):
            raise SystemExit(f"--routers: {item!r} is not KIND:POLICY[+KEY=VALUE...]")
        specs.append(RouterSpec(kind, policy, tuple(knobs)))
    return specs


def free_port() -> int:
    return vllm_engines.free_port(["127.0.0.1"])


@dataclass(frozen=True)
class Fleet:
    """The engines routers are put in front of, and where they publish their KV events."""

    urls: Sequence[str]
    kv_port: int
    replay_port: int
    block_size: int


def router_command(
    spec: RouterSpec, port: int, fleet: Fleet, workdir: Path, index: int
) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) of one replica of `spec` on `port`."""
    urls = fleet.urls
    if spec.kind == "trio":
        config = workdir / f"trio-{spec.policy}-{index}.toml"
        listed = ", ".join(f'"{u}"' for u in urls)
        text = (
            f'[server]\nbind = "127.0.0.1:{port}"\ndrain_s = 1.0\naccess_log = false\n'
            f'[routing]\npolicy = "{spec.policy}"\nkv_block_size = {fleet.block_size}\n'
            + "".join(f"{knob}\n" for knob in spec.knobs)
            + f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
            "[stats]\ninterval_s = 1.0\n"
        )
        if spec.policy == "kv_aware":  # every replica subscribes to every engine's events
            text += (
                f'[kv_events]\nmode = "connect"\nport = {fleet.kv_port}\n'
                f"replay_port = {fleet.replay_port}\n"
            )
        config.write_text(text)
        return [sys.executable, "-m", "trio_router", "--config", str(config)], {}
    if spec.kind == "production-stack":
        src = os.environ["PEER_PS_SRC"]
        command = [
            os.environ["PEER_PS_PYTHON"],
            "-m",
            "vllm_router.app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--service-discovery",
            "static",
            "--static-backends",
            ",".join(urls),
            "--static-models",
            ",".join([MODEL_NAME] * len(urls)),
            "--routing-logic",
            spec.policy,
            "--engine-stats-interval",
            "1",
            "--log-level",
            "warning",
        ]
        return command, {"PYTHONPATH": src}
    command = [
        os.environ["PEER_VR_BIN"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        spec.policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warning",
    ]
    return command, {}


async def wait_routing(client: httpx.AsyncClient, url: str, engines: int | None) -> None:
    """Until the router at `url` lists the model (and, given `engines`, shows that many
    routable in trio_router's /engines). A router process gives no other sign that it
    routes: asked every 0.2 s."""
    while True:
        try:
            models = await client.get(f"{url}/v1/models")
            if models.status_code == 200 and MODEL_NAME in models.text:
                if engines is None:
                    return
                shown = (await client.get(f"{url}/engines")).json()["engines"]
                if sum(e["healthy"] for e in shown) >= engines:
                    return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await trio.sleep(0.2)


@asynccontextmanager
async def open_routers(
    spec: RouterSpec, fleet: Fleet, replicas: int, workdir: Path
) -> AsyncIterator[list[str]]:
    """`replicas` processes of `spec` in front of `fleet`; yields their URLs once each routes."""
    async with AsyncExitStack() as stack, httpx.AsyncClient(timeout=10.0) as client:
        bound = []
        for index in range(replicas):
            port = free_port()
            command, env = router_command(spec, port, fleet, workdir, index)
            process, _, stderr = await stack.enter_async_context(open_command(command, env=env))
            url = f"http://127.0.0.1:{port}"
            with trio.move_on_after(START_S) as waited:
                await wait_routing(client, url, len(fleet.urls) if spec.kind == "trio" else None)
            if waited.cancelled_caught or process.returncode is not None:
                raise RuntimeError(f"{spec.label} did not route within {START_S} s:\n{stderr.text}")
            bound.append(url)
        yield bound


# -- the engines' figures ----------------------------------------------------------------------
_SAMPLE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\} (\S+)$", re.M)


async def cache_counters(
    client: httpx.AsyncClient, engines: Sequence[EngineProcess]
) -> list[float]:
    """(hits, queries) in tokens, per engine, flattened: [h0, q0, h1, q1, ...]."""
    out: list[float] = []
    for engine in engines:
        text = (await client.get(f"{engine.url}/metrics")).text
        found = dict(_SAMPLE.findall(text))
        out += [
            float(found.get("vllm:prefix_cache_hits_total", 0)),
            float(found.get("vllm:prefix_cache_queries_total", 0)),
        ]
    return out


async def block_size(client: httpx.AsyncClient, engine: EngineProcess) -> int:
    text = (await client.get(f"{engine.url}/metrics")).text
    match = re.search(r'vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text)
    if match is None:
        raise RuntimeError(f"{engine.url}/metrics names no block_size")
    return int(match.group(1))


async def reset_caches(client: httpx.AsyncClient, engines: Sequence[EngineProcess]) -> None:
    """Empty every engine's prefix cache (refused while requests run: asked again)."""
    for engine in engines:
        for _ in range(100):
            answer = await client.post(f"{engine.url}/reset_prefix_cache")
            if answer.status_code == 200 and answer.json().get("success"):
                break
            await trio.sleep(0.1)
        else:
            raise RuntimeError(f"{engine.url} would not reset its prefix cache: {answer.text}")


def best_hits(sequences: Sequence[list[int]], generated: int, block: int) -> float:
    """The hit rate (tokens) of one engine with an unbounded prefix cache serving the same
    requests in order. Each of `sequences` is a request's prompt then the `generated` tokens
    of its answer (an engine caches the blocks its answers fill too; the last generated token
    is never computed). A prompt's hit is its longest common prefix with anything cached
    before it, in whole blocks, at most all its tokens but the last (vLLM always computes
    that one)."""
    hits = queries = 0
    for i, sequence in enumerate(sequences):
        prompt = sequence[: len(sequence) - generated]
        longest = 0
        for earlier in sequences[:i]:
            cached = earlier[:-1]
            n = min(len(prompt) - 1, len(cached))
            k = 0
            while k < n and prompt[k] == cached[k]:
                k += 1
            longest = max(longest, k)
        hits += longest // block * block
        queries += len(prompt)
    return hits / queries if queries else 0.0


# -- one run -----------------------------------------------------------------------------------
@dataclass
class Result:
    router: str
    replicas: int
    requests: int
    errors: int
    hit_rate: float
    best: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    seconds: float
    per_engine_queries: list[float]
    router_figures: dict[str, float]  # trio_router's: see router_figures


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


@dataclass
class Answer:
    ttft: float  # seconds to the first token
    text: str
    tokens: list[int]  # the prompt's token ids, then the generated ones, as the engine had them


async def stream_chat(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> Answer:
    """One streamed chat request, greedy, with vLLM's `return_token_ids` (the engine's own
    token ids of the prompt, chat template applied, and of the answer)."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # exactly max_tokens: what `best_hits` counts as generated
        "stream": True,
        "return_token_ids": True,
    }
    started = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    tokens: list[int] = []
    async with client.stream("POST", f"{url}{CHAT}", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {answer.status_code}: {(await answer.aread())!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            tokens += event.get("prompt_token_ids") or []
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
                if content := choice.get("delta", {}).get("content"):
                    if not parts:
                        ttft = time.perf_counter() - started
                    parts.append(content)
    return Answer(ttft, "".join(parts), tokens)


async def run_workload(
    args: argparse.Namespace, client: httpx.AsyncClient, urls: Sequence[str]
) -> tuple[list[Answer], int]:
    """Send the whole workload through `urls` (alternating), `args.concurrency` at a time.
    Returns every answer in the order the requests were sent, and the errors."""
    workload = make_workload(args)
    sent: list[Answer] = []
    errors = 0
    limiter = trio.CapacityLimiter(args.concurrency)
    asked = [0] * len(workload.groups)

    async def one(index: int, kind: str, which: int) -> None:
        nonlocal errors
        url = urls[index % len(urls)]
        async with limiter:
            if kind == "group":
                system, questions = workload.groups[which]
                question = questions[asked[which] % len(questions)]
                asked[which] += 1
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ]
                slot = len(sent)
                sent.append(Answer(float("nan"), "", []))
                try:
                    sent[slot] = await stream_chat(client, url, messages, args.max_tokens)
                except (httpx.HTTPError, RuntimeError):
                    errors += 1
                return
            conversation = workload.conversations[which]
            async with conversation.lock:
                turn = len(conversation.messages) // 2
                conversation.messages.append(
                    {"role": "user", "content": conversation.questions[turn]}
                )
                slot = len(sent)
                sent.append(Answer(float("nan"), "", []))
                try:
                    sent[slot] = await stream_chat(
                        client, url, list(conversation.messages), args.max_tokens
                    )
                except (httpx.HTTPError, RuntimeError):
                    errors += 1
                conversation.messages.append({"role": "assistant", "content": sent[slot].text})

    async with trio.open_nursery() as nursery:
        for index, (kind, which) in enumerate(workload.order):
            nursery.start_soon(one, index, kind, which)
            await trio.lowlevel.checkpoint()  # in order: the limiter serves first come first
    return sent, errors


async def router_figures(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float]:
    """kv_aware's own figures, summed over trio_router replicas: the hit rate it predicted,
    its mean tokenization time and its fallbacks."""
    sums: dict[str, float] = {}
    for url in urls:
        text = (await client.get(f"{url}/metrics")).text
        for name, value in _ROUTER_SAMPLE.findall(text):
            sums[name] = sums.get(name, 0.0) + float(value)
        for bound, value in _ERROR_BUCKET.findall(text):  # summed over engines
            key = f"error_le_{bound}"
            sums[key] = sums.get(key, 0.0) + float(value)
    count = sums.get("trio_router_tokenize_seconds_count", 0.0)
    prompt = sums.get("trio_router_kv_prompt_tokens_total", 0.0)
    return {
        "predicted_hit_rate": (
            sums.get("trio_router_kv_predicted_cached_tokens_total", 0.0) / prompt
            if prompt
            else float("nan")
        ),
        "tokenize_mean_ms": (
            sums.get("trio_router_tokenize_seconds_sum", 0.0) / count * 1000
            if count
            else float("nan")
        ),
        "tokenize_fallbacks": sums.get("trio_router_tokenize_fallbacks_total", 0.0),
        # kv_aware's time cost: the share of first tokens within 250 ms and 1 s of their
        # predictions (the histogram is signed, so it has no _sum: its buckets tell)
        **{
            f"ttft_within_{name}": (
                (sums.get(f"error_le_{bound}", 0.0) - sums.get(f"error_le_-{bound}", 0.0))
                / predictions
                if (predictions := sums.get("trio_router_kv_ttft_prediction_error_seconds_count"))
                else float("nan")
            )
            for name, bound in (("250ms", "0.25"), ("1s", "1.0"))
        },
    }


_ROUTER_SAMPLE = re.compile(
    r"^(trio_router_(?:kv_predicted_cached_tokens_total|kv_prompt_tokens_total|"
    r"tokenize_seconds_sum|tokenize_seconds_count|tokenize_fallbacks_total|"
    r"kv_ttft_prediction_error_seconds_count))"
    r"(?:\{[^}]*\})? (\S+)$",
    re.M,
)
_ERROR_BUCKET = re.compile(
    r'^trio_router_kv_ttft_prediction_error_seconds_bucket\{[^}]*le="([^"]+)"\} (\S+)$', re.M
)


async def measure_hits(
    args: argparse.Namespace,
    spec: RouterSpec,
    engines: Sequence[EngineProcess],
    fleet: Fleet,
    workdir: Path,
) -> Result:
    async with (
        httpx.AsyncClient(timeout=args.limit) as client,
        open_routers(spec, fleet, args.replicas, workdir) as routers,
    ):
        await reset_caches(client, engines)
        before = await cache_counters(client, engines)
        began = time.perf_counter()
        with trio.fail_after(args.limit):
            sent, errors = await run_workload(args, client, routers)
        seconds = time.perf_counter() - began
        after = await cache_counters(client, engines)
        block = await block_size(client, engines[0])
        figures = await router_figures(client, routers) if spec.kind == "trio" else {}
    delta = [a - b for a, b in zip(after, before, strict=True)]
    ttfts = [a.ttft for a in sent if a.tokens]
    hits, queries = sum(delta[0::2]), sum(delta[1::2])
    return Result(
        router=spec.label,
        replicas=args.replicas,
        requests=len(sent),
        errors=errors,
        hit_rate=hits / queries if queries else 0.0,
        best=best_hits([a.tokens for a in sent if a.tokens], args.max_tokens, block),
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p99_ms=percentile(ttfts, 99) * 1000,
        seconds=seconds,
        per_engine_queries=delta[1::2],
        router_figures=figures,
    )


# -- vllm bench serve --------------------------------------------------------------------------
async def bench_serve(
    env: vllm_engines.EngineEnvironment, url: str, args: argparse.Namespace, seed: int, out: Path
) -> dict[str, Any]:
    command = env.command(
        "cli",
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        CHAT,
        "--base-url",
        url,
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(env.model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.prompts),
        "--request-rate",
        str(args.rate),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    )
    environ = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    async with open_command(command, env=environ) as (process, _, stderr):
        with trio.fail_after(args.limit):
            code = await process.wait()
    if code != 0:
        raise RuntimeError(f"vllm bench serve against {url} exited {code}:\n{stderr.text[-3000:]}")
    result: dict[str, Any] = json.loads(await trio.Path(out).read_text())
    return result


async def measure_ttft(
    args: argparse.Namespace,
    env: vllm_engines.EngineEnvironment,
    specs: Sequence[RouterSpec],
    engine: EngineProcess,
    fleet: Fleet,
    workdir: Path,
) -> dict[str, dict[str, float]]:
    rounds: dict[str, list[tuple[float, float]]] = {"direct": []}
    async with AsyncExitStack() as stack, httpx.AsyncClient(timeout=60) as client:
        targets = {"direct": engine.url}
        for spec in specs:
            (targets[spec.label],) = await stack.enter_async_context(
                open_routers(spec, replace(fleet, urls=[engine.url]), 1, workdir)
            )
            rounds[spec.label] = []
        for r in range(args.rounds):
            order = list(targets.items())
            if r % 2:
                order.reverse()
            for label, url in order:
                await reset_caches(client, [engine])
                got = await bench_serve(env, url, args, seed=args.seed + r, out=workdir / "r.json")
                rounds[label].append((got["median_ttft_ms"], got["p99_ttft_ms"]))
                print(
                    f"round {r + 1}: {label}: TTFT p50 {got['median_ttft_ms']:.1f} ms, "
                    f"p99 {got['p99_ttft_ms']:.1f} ms",
                    file=sys.stderr,
                )
        own = {
            spec.label: await router_figures(client, [targets[spec.label]])
            for spec in specs
            if spec.kind == "trio"
        }
    return {
        label: {
            "ttft_p50_ms": statistics.median(p50 for p50, _ in values),
            "ttft_p99_ms": statistics.median(p99 for _, p99 in values),
            **own.get(label, {}),
        }
        for label, values in rounds.items()
    }


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["hits", "ttft"])
    parser.add_argument(
        "--routers",
        default="trio:round_robin,trio:least_loaded,trio:prefix_aware,trio:kv_aware,"
        "production-stack:roundrobin,production-stack:prefixaware,"
        "vllm-router-rs:round_robin,vllm-router-rs:cache_aware",
    )
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--kv-cache-mib", type=float, default=4.0)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=12)
    parser.add_argument("--system-words", type=int, default=600)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="group popularity falls as 1/rank^SKEW (0: every group alike)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--limit", type=float, default=600.0, help="seconds per load, at most")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--log-dir", type=Path, help="keep the engines' logs here")
    return parser.parse_args(argv)


def table(results: Sequence[Result]) -> str:
    lines = [
        "| router | replicas | requests | errors | hit rate | of best | TTFT p50 ms | "
        "TTFT p99 ms | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.router} | {r.replicas} | {r.requests} | {r.errors} | {r.hit_rate:.1%} | "
            f"{r.hit_rate / r.best:.0%} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | "
            f"{r.seconds:.0f} |"
        )
    best = statistics.median(r.best for r in results) if results else 0.0
    lines.append(f"\nbest any routing could reach on this workload: {best:.1%}")
    for r in results:
        if (predicted := r.router_figures.get("predicted_hit_rate", math.nan)) == predicted:
            lines.append(
                f"{r.router}: predicted hit rate {predicted:.1%}, tokenize mean "
                f"{r.router_figures['tokenize_mean_ms']:.2f} ms, "
                f"{r.router_figures['tokenize_fallbacks']:.0f} fallbacks, first tokens within "
                f"250 ms / 1 s of kv_aware's prediction: "
                f"{r.router_figures['ttft_within_250ms']:.0%} / "
                f"{r.router_figures['ttft_within_1s']:.0%}"
            )
    for r in results:
        shares = " / ".join(f"{q / 1000:.0f}k" for q in r.per_engine_queries)
        lines.append(f"{r.router}: prompt tokens per engine {shares}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    specs = parse_routers(args.routers)
    runnable = []
    for spec in specs:
        if why := spec.available():
            print(f"skipping {spec.label}: {why}", file=sys.stderr)
        else:
            runnable.append(spec)
    env = vllm_engines.ensure_environment(log=lambda line: print(line, file=sys.stderr))
    hosts = [f"127.0.1.{FIRST_HOST + i}" for i in range(ENGINES)]
    port, kv_port, replay_port = vllm_engines.free_ports(hosts, 3)
    plain = vllm_engines.specs_for(
        ENGINES,
        port=port,
        first_host=FIRST_HOST,
        kv_cache_bytes=int(args.kv_cache_mib * (1 << 20)),
        block_size=args.block_size,
        max_num_seqs=8,
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),  # /reset_prefix_cache
    )
    # Every engine publishes its KV-cache events as a pod does (kv_aware subscribes).
    engine_specs = vllm_engines.publishing_kv_events(plain, port=kv_port, replay_port=replay_port)
    fleet = Fleet([s.url for s in engine_specs], kv_port, replay_port, args.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        log_dir = args.log_dir or workdir / "logs"
        print(f"starting {ENGINES} vLLM engines (logs in {log_dir})", file=sys.stderr)
        with vllm_engines.running_engines(env, engine_specs, log_dir=log_dir) as engines:
            if args.mode == "ttft":
                figures = await measure_ttft(args, env, runnable, engines[0], fleet, workdir)
                direct = figures["direct"]
                print("| target | TTFT p50 ms | TTFT p99 ms | added p50 ms | tokenize mean ms |")
                print("|---|---:|---:|---:|---:|")
                for label, row in figures.items():
                    added = row["ttft_p50_ms"] - direct["ttft_p50_ms"]
                    tokenize = row.get("tokenize_mean_ms", float("nan"))
                    print(
                        f"| {label} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} | "
                        f"{added:+.1f} | {tokenize:.2f} |"
                    )
                return {"mode": "ttft", "args": vars(args) | {"json_out": None}, "ttft": figures}
            results = []
            for spec in runnable:
                print(f"running {spec.label} x{args.replicas}", file=sys.stderr)
                result = await measure_hits(args, spec, engines, fleet, workdir)
                print(
                    f"  hit rate {result.hit_rate:.1%} (best {result.best:.1%}), "
                    f"TTFT p50 {result.ttft_p50_ms:.0f} ms, errors {result.errors}",
                    file=sys.stderr,
                )
                results.append(result)
            print(table(results))
            return {
                "mode": "hits",
                "args": {k: str(v) for k, v in vars(args).items()},
                "results": [asdict(r) for r in results],
            }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(main_async, args)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
