"""`trio-router demo --profile NAME`: the demo on emulated engines, and what it shows first:
the routing policies side by side on a workload of shared prompts.

`open_demo_fleet` serves the engines (one loopback address each, publishing their KV-cache
events). `compare_policies` runs, for each policy, a router in this process in front of fresh
engines (each killed and served again: empty caches, counters at 0) and sends it a
`SharedPrefixWorkload`: chat requests whose long system prompts are shared, the popular ones
far more often than the rest (popularity 1/rank^skew), a few in flight at once, each streamed.
It reports each policy's prefix-cache hit rate, from the engines' own counters (the tokens
`vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total` count), and the time to
the first token its requests saw, in emulated seconds. The client speaks HTTP with h11 (one
connection per request), so the demo needs nothing beyond the router's own dependencies.
"""

from __future__ import annotations

import json
import math
import random
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Final
from urllib.parse import urlsplit

import h11
import trio

from .. import server
from ..config import (
    Config,
    DiscoveryConfig,
    KvEventsConfig,
    RoutingConfig,
    ServerConfig,
    StaticConfig,
)
from ..table import RoutingTable
from .engine import EngineConfig
from .fleet import Fleet, fleet_addresses, open_fleet
from .kv_events import KvEventsConfig as EngineKvEvents
from .profiles import load_profile

__all__ = [
    "TABLE_HEADER",
    "DemoFleet",
    "PolicyResult",
    "SharedPrefixWorkload",
    "compare_policies",
    "open_demo_fleet",
    "result_row",
]

POLICIES: Final = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
FIRST_HOST: Final = "127.0.1.1"
_WORDS: Final = ("the", "model", "cache", "token", "engine", "router", "prefix", "block",
                 "answer", "question", "policy", "request", "stream", "batch")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedPrefixWorkload:
    """Chat requests sharing system prompts, popular ones far more often (see the module)."""

    groups: int = 24  # distinct system prompts
    requests: int = 96
    system_words: int = 2000
    skew: float = 1.2  # group k is drawn with weight 1/(k+1)^skew
    concurrency: int = 16  # requests in flight at once
    max_tokens: int = 16
    seed: int = 0

    def conversations(self) -> list[tuple[str, str]]:
        """Each request's (system prompt, question), in the order they are sent."""
        rng = random.Random(self.seed)
        systems = [
            f"document {g}: " + " ".join(rng.choice(_WORDS) for _ in range(self.system_words))
            for g in range(self.groups)
        ]
        weights = [1 / (rank + 1) ** self.skew for rank in range(self.groups)]
        drawn = rng.choices(range(self.groups), weights, k=self.requests)
        return [(systems[g], f"question {i} about document {g}?") for i, g in enumerate(drawn)]

    def describe(self) -> str:
        return (
            f"{self.requests} chat requests over {self.groups} shared system prompts of "
            f"{self.system_words} words (popularity 1/rank^{self.skew:g}), "
            f"{self.concurrency} in flight, {self.max_tokens} tokens out each"
        )


@dataclass(frozen=True, slots=True)
class DemoFleet:
    """The emulated engines and where their KV-cache events are published."""

    fleet: Fleet
    config: EngineConfig
    kv_port: int
    replay_port: int

    def router_config(self, policy: str, *, port: int = 0) -> Config:
        """A router on 127.0.0.1:`port` in front of the engines, with `policy` (kv_aware
        subscribes to their events)."""
        kv = KvEventsConfig()
        if policy == "kv_aware":
            kv = KvEventsConfig(mode="connect", port=self.kv_port, replay_port=self.replay_port)
        return Config(
            server=ServerConfig(bind=f"127.0.0.1:{port}", drain_s=2.0, access_log=False),
            discovery=DiscoveryConfig(
                mode="static", static=StaticConfig.from_urls(self.fleet.urls)
            ),
            routing=RoutingConfig(
                policy=policy,  # type: ignore[arg-type]
                kv_block_size=self.config.block_size,
                tokenize_timeout_s=1.0,
            ),
            kv_events=kv,
        )


def _free_ports(host: str, count: int) -> list[int]:
    """`count` TCP ports free on `host` now (held until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@asynccontextmanager
async def open_demo_fleet(
    profile: str, engines: int, *, time_scale: float = 1.0
) -> AsyncIterator[DemoFleet]:
    """`engines` emulated engines of `profile` on 127.0.1.1, .2, ... (one port), publishing
    their KV-cache events, until the block ends. Raises ConfigError for a bad profile."""
    kv_port, replay_port = _free_ports(FIRST_HOST, 2)
    events = EngineKvEvents(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{kv_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
    )
    config = EngineConfig.from_profile(
        load_profile(profile), time_scale=time_scale, kv_events=events
    )
    addresses = fleet_addresses(FIRST_HOST, 0, engines, consecutive_ports=False)
    async with open_fleet([config] * engines, addresses) as fleet:
        yield DemoFleet(fleet, config, kv_port, replay_port)


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    hit_rate: float  # prefix-cache hits over queries, in tokens, over every engine
    ttft_p50: float  # emulated seconds
    ttft_p99: float
    errors: int


async def _stream_chat(url: str, body: bytes) -> float:
    """POST a streamed chat to `url` (one connection, h11); the Trio-clock seconds to its
    first token. Raises OSError or ValueError (a refusal, or a broken answer)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    started = trio.current_time()
    connection = h11.Connection(h11.CLIENT)
    headers = [("host", f"{host}:{port}"), ("content-type", "application/json"),
               ("content-length", str(len(body))), ("connection", "close")]  # fmt: skip
    request = h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
    async with await trio.open_tcp_stream(host, port) as stream:
        for event in (request, h11.Data(data=body), h11.EndOfMessage()):
            await stream.send_all(connection.send(event) or b"")
        pending, first = b"", float("nan")
        while True:
            answer = connection.next_event()
            if answer is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
            elif isinstance(answer, h11.Response) and answer.status_code != 200:
                raise ValueError(f"HTTP {answer.status_code}")
            elif isinstance(answer, h11.Data):
                pending += answer.data
                *events, pending = pending.split(b"\n\n")
                if math.isnan(first) and any(_has_content(e) for e in events):
                    first = trio.current_time() - started
            elif isinstance(answer, h11.EndOfMessage | h11.ConnectionClosed):
                if math.isnan(first):
                    raise ValueError("the stream ended without a token")
                return first


def _has_content(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return False
    choices = json.loads(event[6:]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def _percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))]


async def run_workload(
    router_url: str, model: str, workload: SharedPrefixWorkload
) -> tuple[list[float], int]:
    """Send `workload` to the router at `router_url`, `concurrency` at a time, in order;
    each request's time to first token (Trio-clock seconds) and the errors."""
    ttfts: list[float] = []
    errors = 0
    limiter = trio.CapacityLimiter(workload.concurrency)

    async def one(system: str, question: str) -> None:
        nonlocal errors
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {"model": model, "messages": messages, "max_tokens": workload.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        async with limiter:
            try:
                ttfts.append(await _stream_chat(router_url, json.dumps(body).encode()))
            except (OSError, ValueError, h11.ProtocolError):
                errors += 1

    async with trio.open_nursery() as nursery:
        for system, question in workload.conversations():
            nursery.start_soon(one, system, question)
            await trio.lowlevel.checkpoint()  # in order: the limiter serves first come first
    return ttfts, errors


async def _fresh_engines(demo: DemoFleet) -> None:
    for index in range(len(demo.fleet)):
        demo.fleet.kill(index)
        await demo.fleet.restart(index)


async def compare_policies(
    demo: DemoFleet,
    workload: SharedPrefixWorkload,
    policies: Sequence[str] = POLICIES,
    *,
    on_result: Callable[[PolicyResult], None] | None = None,
) -> list[PolicyResult]:
    """Each policy's figures on `workload` (see the module), also handed to `on_result` as
    each is measured; fresh engines for each."""
    results = []
    model, scale = demo.config.served_model_name, demo.config.time_scale
    for policy in policies:
        await _fresh_engines(demo)
        table = RoutingTable()
        async with trio.open_nursery() as nursery:
            run = partial(server.run, demo.router_config(policy), table=table, handle_signals=False)
            bound: list[str] = await nursery.start(run)
            while len(table.routable(model)) < len(demo.fleet):
                await table.wait_changed()
            ttfts, errors = await run_workload(bound[0], model, workload)
            nursery.cancel_scope.cancel(reason="policy measured")
        engines = [demo.fleet.engine(i) for i in range(len(demo.fleet))]
        hits = sum(e.cache.hits for e in engines if e is not None)
        queries = sum(e.cache.queries for e in engines if e is not None)
        emulated = [t * scale for t in ttfts]
        result = PolicyResult(
            policy,
            hits / queries if queries else float("nan"),
            _percentile(emulated, 50),
            _percentile(emulated, 99),
            errors,
        )
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


TABLE_HEADER: Final = f"{'policy':<14} {'prefix-cache hits':>17} {'TTFT p50':>10} {'TTFT p99':>10}"


def result_row(r: PolicyResult) -> str:
    """One policy's line of the comparison, under TABLE_HEADER."""
    return (
        f"{r.policy:<14} {r.hit_rate:>17.1%} {r.ttft_p50 * 1000:>8.1f}ms "
        f"{r.ttft_p99 * 1000:>8.1f}ms" + (f"  ({r.errors} errors)" if r.errors else "")
    )
