"""Flow control at emulated engines in virtual time: where an interactive request's time to a
first token goes when the engines are capped.

    python bench/flow_virtual.py [--engines 16] [--max-num-seqs 8] [--capacity 8] [--reserve 0]
                                 [--load 1.5] [--duration 1.5] [--max-tokens 64]
                                 [--tokens-spread 0] [--json-out FILE] [--traces-out FILE]

One process, on Trio's MockClock (autojump): `--engines` emulated H100s (`EmulatedEngine`, the
h100 profile, `--max-num-seqs`, `--scheduling-policy priority`, time scale 1: virtual seconds
are emulated seconds) served by the emulator's own HTTP server over socket pairs, and the
router as `server.open_router` builds it, with bench_emulator.py flow's trio-flow settings
(`round_robin`, `max_in_flight_per_engine` = `--capacity` + `--reserve`,
`reserve_per_engine` = `--reserve`, `priority_to_engines`, `fairness = "tenant"`, tenants
`interactive` priority 10 with a 2 s first-token deadline and `batch` priority 0), its ASGI
app called directly with each request (streamed chats of `--max-tokens` tokens, `ignore_eos`;
`--tokens-spread S`: each asks for tokens x [1 - S, 1 + S], uniformly). Neither side's CPU
time counts: what is measured is what the router and the engines decide. The defaults are
bench_emulator.py flow's spans in emulated seconds at its time scale of 0.05 (30 wall seconds
of load: 1.5 emulated).

The capacity is measured first (engines x max-num-seqs generations back to back, straight to
the engines, counted over the last 3/4 of `--calibrate` seconds); then interactive requests
alone at `--unloaded-load` x it for `--unloaded-duration` seconds, and the mix
(`--interactive-share` interactive, Poisson, bench_flow's seeded schedule) at `--load` x it
for `--duration` seconds (then `--drain` more), each in front of fresh engines and a fresh
router. For every request: its arrival, when admission gave it an engine, when it reached the
engine (with the engine's running requests then), when the engine admitted it (the start of
the step that first ran it), its first token and its end at the client. Reported: the
interactive TTFT p50/p99/max, unloaded and loaded, and its parts (the router's queue, on the
way to the engine, the engine's queue, admission to first token); how many interactive
requests a batch request was dispatched ahead of while they waited, how many reached an
engine running `--max-num-seqs` already, and the gaps between the moments a slot came free
in the fleet (an answer ended) over the second half of the load. `--traces-out` writes every
request's trace (JSON).
"""

from __future__ import annotations

import argparse
import contextvars
import itertools
import json
import logging
import math
import os
import random
import socket
import sys
import tomllib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import trio
import trio.testing

from trio_router import server
from trio_router.config import parse_config
from trio_router.emulator.app import EngineApp
from trio_router.emulator.engine import EmulatedEngine, EngineConfig, SamplingParams
from trio_router.emulator.http_server import KEEP_ALIVE_S, _serve_connection
from trio_router.emulator.profiles import load_profile
from trio_router.emulator.scheduler import Policy, Step
from trio_router.table import RoutingTable

CHAT: Final = "/v1/chat/completions"
KEYS: Final = {"interactive": "flow-virtual-interactive", "batch": "flow-virtual-batch"}
KEY_ENVS: Final = {"interactive": "FLOW_VIRTUAL_INTERACTIVE", "batch": "FLOW_VIRTUAL_BATCH"}
DEADLINE_MS: Final = 2000
_REQUEST: contextvars.ContextVar[int] = contextvars.ContextVar("flow_virtual_request")


@dataclass
class Trace:
    """One request as the client, the router and its engine saw it (virtual seconds)."""

    tenant: str
    arrived: float
    dispatched: float | None = None
    engine: str = ""
    at_engine: float | None = None
    running_there: int = -1  # the engine's running requests when it arrived there
    waiting_there: int = -1  # and its waiting ones
    admitted: float | None = None  # the start of the engine step that first ran it
    first_token: float | None = None
    done: float | None = None


class Fleet:
    """Emulated engines reached over socket pairs (an `UpstreamPool` connector), each request
    traced by its `x-flow-id` header."""

    def __init__(self, engines: list[EmulatedEngine], traces: dict[int, Trace]) -> None:
        self.engines = engines
        self._apps = {
            f"10.0.1.{i + 1}": _TracedApp(e, f"e{i}", traces) for i, e in enumerate(engines)
        }
        self._nursery: trio.Nursery | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://{host}:8000" for host in self._apps]

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Fleet]:
        async with trio.open_nursery() as nursery:
            for engine in self.engines:
                nursery.start_soon(engine.run)
            self._nursery = nursery
            yield self
            nursery.cancel_scope.cancel()

    async def connect(self, host: str, port: int) -> socket.socket:
        await trio.lowlevel.checkpoint()
        assert self._nursery is not None
        ours, theirs = socket.socketpair()
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(theirs))
        self._nursery.start_soon(_serve_connection, self._apps[host], KEEP_ALIVE_S, stream)
        return ours


class _TracedApp:
    def __init__(self, engine: EmulatedEngine, name: str, traces: dict[int, Trace]) -> None:
        self._app, self._engine, self._name, self._traces = EngineApp(engine), engine, name, traces
        self._by_request: dict[str, Trace] = {}
        submit, record = engine.submit, engine._record_scheduled

        def traced_submit(*args: Any, **kwargs: Any) -> Any:
            trace = traces.get(_REQUEST.get(-1))
            scheduler = engine.scheduler
            running, waiting = len(scheduler.running), len(scheduler.waiting)
            generation = submit(*args, **kwargs)
            if trace is not None:
                trace.engine, trace.at_engine = name, trio.current_time()
                trace.running_there, trace.waiting_there = running, waiting
                self._by_request[generation.request_id] = trace
            return generation

        def traced_record(step: Step, now: float) -> None:
            for request in step.admitted:
                trace = self._by_request.pop(request.request_id, None)
                if trace is not None and trace.admitted is None:
                    trace.admitted = now
            record(step, now)

        engine.submit = traced_submit  # type: ignore[method-assign]
        engine._record_scheduled = traced_record  # type: ignore[method-assign]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        if (number := headers.get(b"x-flow-id")) is not None:
            _REQUEST.set(int(number))
        await self._app(scope, receive, send)


def engines_of(args: argparse.Namespace) -> list[EmulatedEngine]:
    config = EngineConfig.from_profile(
        load_profile("h100"), max_num_seqs=args.max_num_seqs, policy=Policy.PRIORITY, time_scale=1.0
    )
    return [EmulatedEngine(config, rng=random.Random(i)) for i in range(args.engines)]


def router_toml(urls: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    listed = ", ".join(f'"{u}"' for u in urls)
    text = (
        f'[server]\nbind = "127.0.0.1:0"\naccess_log = false\n'
        f'[routing]\npolicy = "{args.policy}"\n'
        f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
        f"[admission]\nmax_in_flight_per_engine = {args.capacity + args.reserve}\n"
        'queue_size = 1024\nqueue_timeout_s = 30.0\nfairness = "tenant"\n'
        "priority_to_engines = true\n"
    )
    if args.reserve:
        text += f"reserve_per_engine = {args.reserve}\n"
    text += (
        f'[[tenants]]\nname = "interactive"\nkey_env = "{KEY_ENVS["interactive"]}"\n'
        f"priority = 10\nttft_deadline_ms = {DEADLINE_MS}\n"
        f'[[tenants]]\nname = "batch"\nkey_env = "{KEY_ENVS["batch"]}"\npriority = 0\n'
    )
    return tomllib.loads(text)


async def call(app: Any, number: int, tenant: str, trace: Trace, tokens: int, model: str) -> None:
    """One streamed chat through the router's ASGI app, traced."""
    _REQUEST.set(number)
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"request {number}: say something"}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "headers": [
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {KEYS[tenant]}".encode()),
            (b"x-flow-id", str(number).encode()),
        ],
        "client": ("127.0.0.1", 40000 + number % 20000),
        "extensions": {},
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await trio.sleep_forever()
        return {}

    async def send(message: dict[str, Any]) -> None:
        data = message.get("body", b"")
        first = b'"content":"' in data and b'"content":""' not in data  # not the role alone
        if trace.first_token is None and first:
            trace.first_token = trio.current_time()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            trace.done = trio.current_time()

    await app(scope, receive, send)


@asynccontextmanager
async def open_router(args: argparse.Namespace, traces: dict[int, Trace]) -> AsyncIterator[Any]:
    fleet = Fleet(engines_of(args), traces)
    table = RoutingTable()
    config = parse_config(router_toml(fleet.urls, args))
    async with fleet.open(), server.open_router(config, table=table, connect=fleet.connect) as r:
        model = fleet.engines[0].config.served_model_name
        while len(table.routable(model)) < args.engines:
            await table.wait_changed()
        admission = r.runtime.services.admission
        acquire = admission.acquire

        async def traced_acquire(*a: Any, **k: Any) -> Any:
            engine = await acquire(*a, **k)
            trace = traces.get(_REQUEST.get(-1))
            if trace is not None and trace.dispatched is None:
                trace.dispatched = trio.current_time()
            return engine

        admission.acquire = traced_acquire  # type: ignore[method-assign]
        yield r.app, model


async def calibrate(args: argparse.Namespace) -> float:
    """Engines x max-num-seqs generations back to back, straight to fresh engines: answers
    a second, counted over the last 3/4 of `--calibrate` seconds."""
    finished: list[float] = []
    fleet = Fleet(engines_of(args), {})
    async with fleet.open():

        async def back_to_back(engine: EmulatedEngine) -> None:
            prompt = list(range(1000, 1020))  # about a short chat's prompt
            while True:
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
                generation = engine.submit(prompt, params)
                while (await generation.wait())[1] is None:
                    pass
                finished.append(trio.current_time())

        t0 = trio.current_time()
        with trio.move_on_after(args.calibrate):
            async with trio.open_nursery() as nursery:
                for engine in fleet.engines:
                    for _ in range(args.max_num_seqs):
                        nursery.start_soon(back_to_back, engine)
    seconds = float(args.calibrate)
    counted = sum(t >= t0 + seconds / 4 for t in finished)
    return counted / (seconds * 3 / 4)


def arrivals(
    rate: float, seconds: float, share: float, args: argparse.Namespace, *, seed: int
) -> list[tuple[float, str, int]]:
    """Poisson arrivals: (when, tenant, max_tokens), the tokens spread uniformly by
    `--tokens-spread` (drawn only then, so that the schedule is otherwise bench_flow's)."""
    rng, spread = random.Random(seed), args.tokens_spread
    out, at = [], rng.expovariate(rate)
    while at < seconds:
        tenant = "interactive" if rng.random() < share else "batch"
        tokens = args.max_tokens
        if spread:
            tokens = max(1, round(rng.uniform(tokens * (1 - spread), tokens * (1 + spread))))
        out.append((at, tenant, tokens))
        at += rng.expovariate(rate)
    return out


async def run_load(
    args: argparse.Namespace, schedule: list[tuple[float, str, int]], seconds: float
) -> list[Trace]:
    traces = {n: Trace(tenant, at) for n, (at, tenant, _) in enumerate(schedule)}
    async with open_router(args, traces) as (app, model):
        t0 = trio.current_time()
        for trace in traces.values():
            trace.arrived += t0
        with trio.move_on_after(seconds + args.drain):
            async with trio.open_nursery() as nursery:
                for number, (at, tenant, tokens) in enumerate(schedule):
                    await trio.sleep_until(t0 + at)
                    nursery.start_soon(call, app, number, tenant, traces[number], tokens, model)
    return list(traces.values())


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))]


def _ms(value: float) -> float | None:
    return round(value * 1000, 2) if math.isfinite(value) else None


def _parts(name: str, values: Sequence[float]) -> dict[str, float | None]:
    return {
        f"{name}_p50_ms": _ms(percentile(values, 50)),
        f"{name}_p99_ms": _ms(percentile(values, 99)),
        f"{name}_max_ms": _ms(max(values, default=math.nan)),
    }


def _count(values: Sequence[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return dict(sorted(out.items()))


def figures(traces: Sequence[Trace], window: float, max_num_seqs: int) -> dict[str, Any]:
    """Where the interactive requests' time went, and how the fleet's slots came free."""
    t0 = min((t.arrived for t in traces), default=0.0)
    mine = [t for t in traces if t.tenant == "interactive"]
    batch = [t for t in traces if t.tenant == "batch"]
    sent = [t for t in mine if t.dispatched is not None]
    overtaken = sum(
        any(t.arrived < b.dispatched < t.dispatched for b in batch if b.dispatched is not None)
        for t in sent
        if t.dispatched is not None and t.dispatched > t.arrived
    )
    # Slots come free when an answer ends: the gaps between such moments in the fleet, over
    # the second half of the window (the load's start is long past).
    ends = sorted(
        t.done for t in traces if t.done is not None and t0 + window / 2 < t.done < t0 + window
    )
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "interactive": len(mine),
        **_parts("ttft", [(t.first_token or math.inf) - t.arrived for t in mine]),
        **_parts("router_queue", [t.dispatched - t.arrived for t in sent if t.dispatched]),
        **_parts(
            "dispatch_to_engine",
            [t.at_engine - t.dispatched for t in sent if t.at_engine and t.dispatched],
        ),
        **_parts(
            "engine_queue", [t.admitted - t.at_engine for t in mine if t.admitted and t.at_engine]
        ),
        **_parts(
            "admitted_to_first_token",
            [t.first_token - t.admitted for t in mine if t.first_token and t.admitted],
        ),
        "overtaken_by_batch": overtaken,
        "reached_a_full_engine": sum(t.running_there >= max_num_seqs for t in mine),
        "running_there": _count([t.running_there for t in mine]),
        **_parts("gap_between_slots_freed", gaps),
        "slots_freed_per_s": round(len(ends) / (window / 2), 1),
        "batch": len(batch),
        "batch_done_in_window": sum(
            1 for t in batch if t.done is not None and t.done <= t0 + window
        ),
    }


async def main_async(args: argparse.Namespace) -> tuple[dict[str, Any], list[Trace]]:
    rps = await calibrate(args)
    print(json.dumps({"capacity_rps": round(rps, 2)}), file=sys.stderr, flush=True)
    light = arrivals(args.unloaded_load * rps, args.unloaded_duration, 1.0, args, seed=args.seed)
    heavy = arrivals(args.load * rps, args.duration, args.interactive_share, args, seed=args.seed)
    quiet = figures(
        await run_load(args, light, args.unloaded_duration),
        args.unloaded_duration,
        args.max_num_seqs,
    )
    print(json.dumps({"unloaded": quiet}), file=sys.stderr, flush=True)
    traces = await run_load(args, heavy, args.duration)
    busy = figures(traces, args.duration, args.max_num_seqs)
    quiet_p99, busy_p99 = quiet["ttft_p99_ms"], busy["ttft_p99_ms"]
    report = {
        "args": vars(args),
        "capacity_rps": round(rps, 2),
        "unloaded": quiet,
        "loaded": busy,
        "ratio": round(busy_p99 / quiet_p99, 2) if quiet_p99 and busy_p99 else None,
    }
    return report, traces


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--reserve", type=int, default=0)
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tokens-spread", type=float, default=0.0)
    parser.add_argument("--load", type=float, default=1.5)
    parser.add_argument("--duration", type=float, default=1.5)
    parser.add_argument("--drain", type=float, default=1.0)
    parser.add_argument("--interactive-share", type=float, default=0.3)
    parser.add_argument("--unloaded-load", type=float, default=0.2)
    parser.add_argument("--unloaded-duration", type=float, default=0.75)
    parser.add_argument("--calibrate", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces-out", default="")
    parser.add_argument("--json-out", default="")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("trio_router").setLevel(logging.ERROR)  # refusals at the queue's end
    for tenant, env in KEY_ENVS.items():
        os.environ[env] = KEYS[tenant]
    clock = trio.testing.MockClock(autojump_threshold=0)
    report, traces = trio.run(main_async, args, clock=clock)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    if args.traces_out:
        Path(args.traces_out).write_text(json.dumps([asdict(t) for t in traces]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
