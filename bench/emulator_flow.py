"""bench_emulator.py's `flow`: issue 35's workload (bench_flow.py's load and tenants) at the
emulated fleet's capacity x `--load`, through trio_router's flow control (bench_flow's
trio-flow router) and through the peers, which have none (round robin): each router's
interactive TTFT p99 unloaded and loaded, and what it refused."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import httpx
import trio

import bench_flow as flow
from emulator_fleet import MODEL, open_emulator
from peers import available

PEERS: Final = ("production-stack", "vllm-router-rs")


async def calibrate(urls: Sequence[str], workload: flow.Workload, seconds: float) -> float:
    """The fleet's capacity in requests per second: engines x capacity streams back to back
    straight to the engines for `seconds`, answers counted over the last 3/4 (bench_flow's
    calibration). A stream whose keep-alive connection the engine closed as it was reused
    (idle past the engines' 5 s, uvicorn's) is sent again and not counted."""
    finished: list[float] = []
    body = {"model": workload.model, "max_tokens": workload.tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "calibration: say something"}],
            "stream": True}  # fmt: skip
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as c:

        async def back_to_back(url: str) -> None:
            while True:
                try:
                    async with c.stream("POST", f"{url}{flow.CHAT}", json=body) as response:
                        async for _ in response.aiter_raw():
                            pass
                except httpx.TransportError:
                    continue
                finished.append(trio.current_time())

        t0 = trio.current_time()
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                for index in range(len(urls) * workload.capacity):
                    nursery.start_soon(back_to_back, urls[index % len(urls)])
    return sum(t >= t0 + seconds / 4 for t in finished) / (seconds * 3 / 4)


def flow_routers(text: str) -> tuple[list[str], dict[str, str]]:
    """`--routers` (`trio`, the peers) as bench_flow's router names, and those that cannot
    run here, with why."""
    names: list[str] = []
    skipped: dict[str, str] = {}
    for name in filter(None, (part.strip() for part in text.split(","))):
        if name == "trio":
            names.append("trio-flow")
        elif name not in PEERS:
            raise SystemExit(f"--routers: unknown router {name!r}")
        elif why := available(name):
            skipped[name] = why
        else:
            names.append(name)
    return names, skipped


async def flow_run(
    name: str,
    workload: flow.Workload,
    schedule: Sequence[flow.Arrival],
    window_s: float,
    workdir: Path,
    emulator_pid: int,
) -> dict[str, Any]:
    """Router `name` (bench_flow's trio-flow: tenants, bands, deadline; or a peer, round robin)
    in front of the emulated engines, and `schedule` sent through it; its figures (wall
    milliseconds)."""
    await flow.wait_idle(workload.upstreams)
    async with flow.open_any_router(name, workload.upstreams, workload, workdir) as running:
        pids = running.pids | {"emulator": emulator_pid}
        load = await flow.run_load(running.url, schedule, window_s, workload, pids)
    return {
        "interactive": flow.interactive_figures(load.sent, workload.deadline_s),
        "batch": flow.batch_figures(load.sent, load.window_s),
        "cpu": {role: round(cores, 3) for role, cores in load.cpu.items()},
    }


def verdict(
    name: str, unloaded: dict[str, Any], loaded: dict[str, Any], scale: float
) -> dict[str, Any]:
    """One router's interactive TTFT p99 (emulated ms) unloaded and loaded, their ratio, and
    what it refused or its clients gave up on at the deadline, per tenant."""
    quiet, busy = unloaded["interactive"]["ttft_p99_ms"], loaded["interactive"]["ttft_p99_ms"]
    return {
        "router": name,
        "interactive_ttft_p99_ms_emulated": {
            "unloaded": None if quiet is None else round(quiet * scale, 2),
            "loaded": None if busy is None else round(busy * scale, 2),
        },
        "ratio": round(busy / quiet, 2) if quiet and busy else None,
        "refused": {t: sum(loaded[t]["refused"].values()) for t in ("interactive", "batch")},
        "gave_up": loaded["interactive"]["gave_up"],
        "unloaded": unloaded,
        "loaded": loaded,
    }


async def bench_flow(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 35's workload (bench_flow.py's) at `--load` x the emulated fleet's capacity,
    through each router of `--routers` in turn, in front of one emulated fleet."""
    names, skipped = flow_routers(args.routers)
    wall = 1 / args.time_scale  # wall seconds per emulated second
    extra = ["--scheduling-policy", "priority"]
    if args.engine_max_num_seqs:
        extra += ["--max-num-seqs", str(args.engine_max_num_seqs)]
    results = []
    async with open_emulator(args.engines, args.time_scale, *extra) as (process, urls, _):
        workload = flow.Workload(
            engines=args.engines, capacity=args.capacity, prefill_s=0.0, itl_s=0.0,
            tokens=args.max_tokens, deadline_s=args.deadline_ms / 1000 * wall,
            drain_s=args.drain, reserve=args.reserve, model=MODEL, upstreams=tuple(urls),
        )  # fmt: skip
        rps = await calibrate(urls, workload, args.calibrate)
        workload = replace(workload, measured_rps=rps)
        print(json.dumps({"capacity_rps_wall": round(rps, 2)}), flush=True)
        light = flow.arrivals(args.unloaded_load * rps, args.unloaded_duration, 1.0, args.seed,
                              workload)  # fmt: skip
        heavy = flow.arrivals(args.load * rps, args.duration, args.interactive_share,
                              args.seed, workload)  # fmt: skip
        with tempfile.TemporaryDirectory() as workdir:
            for name in names:
                unloaded = await flow_run(
                    name, workload, light, args.unloaded_duration, Path(workdir), process.pid
                )
                loaded = await flow_run(
                    name, workload, heavy, args.duration, Path(workdir), process.pid
                )
                results.append(verdict(name, unloaded, loaded, args.time_scale))
                print(json.dumps({k: v for k, v in results[-1].items()
                                  if k not in ("unloaded", "loaded")}), flush=True)  # fmt: skip
    return {
        "engines": args.engines,
        "time_scale": args.time_scale,
        "capacity_rps_emulated": round(rps / args.time_scale, 1),
        "load": args.load,
        "results": results,
        "skipped": skipped,
    }
