"""Flow control under overload: priority bands, first-token deadlines and shedding, measured at
fake engines with a real capacity, through trio_router with and without them and through
production-stack's router.

    python bench/bench_flow.py [--routers trio-flow,trio-fair,production-stack]
                               [--duration 40] [--engines 4] [--capacity 4] [--load 1.5]
                               [--quick] [--json] [--json-out FILE] [--workdir DIR]

Engines (bench/flow_engines.py, one process, fresh for every router): `--engines` fake vLLM
engines on 127.0.0.1, each serving `--capacity` streams at once and queueing the rest itself,
first come first served (its time to first token grows with its queue, as vLLM's does); a
stream takes `--prefill-ms` to its first token, then `--tokens` tokens `--itl-ms` apart
(`--tokens-spread S`: each request asks for a number drawn uniformly from tokens x [1 - S,
1 + S] instead; with every answer as long, the engines' slots come free in waves, which sets
how long a request must wait for one). The cluster's capacity is engines x capacity /
(prefill + (tokens - 1) x itl) requests per second.

Load: open loop, Poisson arrivals at `--load` x the cluster's capacity for `--duration` seconds
(the same seeded schedule for every router), streamed chats from two tenants: `interactive`
(`--interactive-share` of the requests, 0.3; its clients want the first token within
`--deadline-ms`, 2000, and give up, closing the connection, when it has not come by then: 50 ms
later, so that a router's own refusal at the deadline reaches them first and is counted) and
`batch` (the rest, no deadline: its clients wait). Each request carries its tenant's bearer key,
`x-bench-tenant`, `x-bench-id`, `x-bench-sent-unix` (when it was sent) and (interactive)
`x-bench-deadline-unix` (its client's deadline), which the engines read. After the arrivals,
requests still running get `--drain` seconds to finish; what is left then is cut (counted as
such). The load generator is this process (httpx on Trio); its CPU is reported (`load_cores`)
so that it can be seen not to be the bottleneck.

Routers (`--routers`), one after the other, each in front of fresh engines:

- `trio-flow`: `python -m trio_router --config FILE` (static discovery, `round_robin`) with
  `[admission] max_in_flight_per_engine` = the engines' capacity (so requests wait at the
  router, not at the engines), `fairness = "tenant"`, and the tenants `interactive` (`priority
  = 10`, `ttft_deadline_ms` = the deadline) and `batch` (`priority = 0`, no deadline);
- `trio-fair`: the same without priority and deadline keys (the fair queue alone, equal
  weights);
- `production-stack`: its router (bench/peers.py, `PEER_PS_PYTHON` + `PEER_PS_SRC`; round
  robin), which has no tenants: the same load through it.

Before them, `unloaded`: trio-flow at `--unloaded-load` (0.2) x capacity, interactive requests
only, for `--unloaded-duration` seconds: the interactive TTFT p99 that the goal "interactive
TTFT p99 under overload within 1.5 x its unloaded value" is judged against.

Figures per router (interactive: over every interactive request sent; a request with no first
token counts as later than any, shown as `>DEADLINE`):

- interactive TTFT p50, p99 (ms; also over the served ones alone in the JSON), the share whose
  first token came within the deadline, refusals by reason (the router's
  `x-trio-router-refusal` header, else its error body's `code`, else the status), given up;
- batch: completions within the arrival window per second, their tokens per second, refusals
  by reason, cut;
- engines: requests that reached an engine after their deadline (goal 0) and that took an
  engine slot after it, and engine time spent on answers nobody waited for: for each request
  whose first token was not out by its client's deadline, the time it held an engine slot after
  that deadline (until done, or aborted when the client's leaving reached the engine);
- where an interactive request's time to first token went: from its client to an engine (the
  router's queue, p50 and p99), and in the engine's queue (p99); the engines' aborts;
- CPU (cores, over the arrival window): the router's, the engines', the load generator's, and
  every other process's (should be 0: above 0.1 the run is flagged as disturbed); how late the
  load generator sent its requests (p99 of the lag behind the schedule: should be a few ms).

`--real`: real vLLM engines instead (`trio_router.testing.vllm_engines`: vLLM's CPU build and
its tiny model, built on first use; `--engines` 2 by default on this 2-core machine, one per
core), started once for all routers with `--max-num-seqs` = `--capacity` and
`--scheduling-policy priority`; trio-flow also gets `priority_to_engines = true`. Answers are
`--tokens` tokens (`ignore_eos`). The capacity is measured first (`--calibrate` seconds of
engines x capacity streams back to back, straight to the engines). Each router's engines are
bench/flow_engines.py relays in front of the real ones, which record the same figures ("started":
when the request was handed to the engine, queued or running there, so its wasted time counts
time queued in vLLM too). The prefill and per-token times are the engines' own.

Output: Markdown (the command line, the tables, the goals) on stdout, or JSON with `--json`;
`--json-out` also writes the JSON. `--workdir DIR` keeps the configurations, router logs and,
per router, every request as its client and the engines saw it (NAME-records.json). Progress
on stderr. Loopback only; every run is bounded (at most `--duration` + `--drain` seconds of
load per router) and every process is stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from bench_engines import free_port
from bench_picker import tree_cpu
from peers import Running, available, open_router, wait_routing
from trio_router.testing import vllm_engines
from trio_router.testing.processes import open_command

ROOT: Final = Path(__file__).resolve().parent.parent
MODEL: Final = "fake-model"
CHAT: Final = "/v1/chat/completions"
ROUTERS: Final = ("trio-flow", "trio-fair", "production-stack")
TENANTS: Final = ("interactive", "batch")
KEYS: Final = {"interactive": "bench-flow-interactive-key", "batch": "bench-flow-batch-key"}
KEY_ENVS: Final = {"interactive": "BENCH_FLOW_KEY_INTERACTIVE", "batch": "BENCH_FLOW_KEY_BATCH"}
PRIORITY: Final = 10  # the interactive tenant's band under trio-flow (batch: 0)
# An interactive client closes its connection this long after its deadline, so that a router's
# own refusal at the deadline (504 deadline_exceeded) reaches it first and can be counted.
GIVE_UP_GRACE_S: Final = 0.05
START_S: Final = 60.0  # a router must route within this
RECORDS_S: Final = 10.0  # the engines' records must come within this
OTHER_CORES: Final = 0.1  # more CPU than this taken by other processes: the run is disturbed
IDLE_S: Final = 30.0  # --real: the engines must be idle within this before a run
FIRST_HOST: Final = 51  # --real: vLLM engines on 127.0.1.51, .52, ...
_BUSY: Final = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)


def log(message: str) -> None:
    print(f"[bench_flow {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the workload ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    engines: int
    capacity: int  # streams per engine
    prefill_s: float
    itl_s: float
    tokens: int  # of an answer, on average
    deadline_s: float  # the interactive clients' first-token deadline
    drain_s: float
    tokens_spread: float = 0.0  # answers of tokens x [1 - spread, 1 + spread] tokens
    reserve: int = 0  # trio-flow: admission.reserve_per_engine
    engine_priority: bool = False  # the fake engines schedule by priority (and preempt)
    policy: str = "round_robin"  # trio_router's routing.policy
    model: str = MODEL
    upstreams: tuple[str, ...] = ()  # --real: the vLLM engines the relays lead to
    upstream_pids: tuple[int, ...] = ()  # --real: their API servers' (CPU: with children)
    measured_rps: float | None = None  # --real: the engines' capacity, measured

    @property
    def service_s(self) -> float:
        """One answer's time at an engine, once it has a slot."""
        return self.prefill_s + (self.tokens - 1) * self.itl_s

    @property
    def capacity_rps(self) -> float:
        if self.measured_rps is not None:
            return self.measured_rps
        return self.engines * self.capacity / self.service_s

    @property
    def most_tokens(self) -> int:
        return math.ceil(self.tokens * (1 + self.tokens_spread))


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the load's start
    tenant: str
    tokens: int  # its answer's (the request's max_tokens)


def arrivals(
    rate: float, seconds: float, share: float, seed: int, workload: Workload
) -> list[Arrival]:
    """Poisson arrivals at `rate` per second for `seconds`, each `interactive` with
    probability `share`, else `batch`, each asking for `workload.tokens` tokens (uniformly
    spread by `workload.tokens_spread`)."""
    rng, spread = random.Random(seed), workload.tokens_spread
    out, at = [], rng.expovariate(rate)
    while at < seconds:
        tenant = "interactive" if rng.random() < share else "batch"
        tokens = workload.tokens
        if spread:  # drawn only then: without a spread the schedule stays the same
            tokens = max(1, round(rng.uniform(tokens * (1 - spread), tokens * (1 + spread))))
        out.append(Arrival(at, tenant, tokens))
        at += rng.expovariate(rate)
    return out


# -- engines -----------------------------------------------------------------------------------
@dataclass
class Engines:
    urls: list[str]
    pid: int


@asynccontextmanager
async def open_engines(workload: Workload, workdir: Path) -> AsyncIterator[Engines]:
    """A fresh process of bench/flow_engines.py; killed at the end."""
    spec = {
        "engines": workload.engines,
        "host": "127.0.0.1",
        "capacity": workload.capacity,
        "prefill_s": workload.prefill_s,
        "itl_s": workload.itl_s,
        "tokens": workload.most_tokens,  # each answer: its request's max_tokens
        "upstreams": list(workload.upstreams),
        "priority_scheduling": workload.engine_priority,
    }
    path = workdir / "flow_engines.json"
    path.write_text(json.dumps(spec))
    command = [sys.executable, str(ROOT / "bench" / "flow_engines.py"), str(path)]
    async with open_command(command) as (process, stdout, stderr):
        with trio.fail_after(30):
            try:
                ready = await stdout.wait_for(r"ready( \S+)+\n")
            except AssertionError:
                raise RuntimeError(f"the engines did not start:\n{stderr.text}") from None
        yield Engines(ready.group(0).split()[1:], process.pid)


async def engine_records(url: str) -> tuple[float, list[dict[str, Any]]]:
    """(the engines' clock now, every chat request they have seen): one process serves all."""
    async with httpx.AsyncClient(timeout=RECORDS_S) as client:
        answer = (await client.get(f"{url}/flow/records")).json()
    return float(answer["now"]), list(answer["records"])


# -- routers -----------------------------------------------------------------------------------
def trio_config(port: int, urls: Sequence[str], workload: Workload, *, flow: bool) -> str:
    """trio_router's configuration: static discovery of `urls`, the router's queue in front
    of them (an engine saturated at its capacity), two tenants; with `flow`, their bands and
    the interactive deadline."""
    listed = ", ".join(f'"{u}"' for u in urls)
    # Engines that schedule by priority preempt a lower band for a higher one: the top band
    # may go `reserve` past their capacity, the others only to it.
    priority = flow and (workload.engine_priority or bool(workload.upstreams))
    cap = workload.capacity + (workload.reserve if priority else 0)
    text = (
        f'[server]\nbind = "127.0.0.1:{port}"\ndrain_s = 1.0\naccess_log = false\n'
        f'[routing]\npolicy = "{workload.policy}"\n'
        f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
        f"[admission]\nmax_in_flight_per_engine = {cap}\n"
        'queue_size = 1024\nqueue_timeout_s = 30.0\nfairness = "tenant"\n'
    )
    if priority:  # real vLLM engines started with the priority policy, or such fakes
        text += "priority_to_engines = true\n"
    if flow and workload.reserve:
        text += f"reserve_per_engine = {workload.reserve}\n"
    for tenant in TENANTS:
        text += f'[[tenants]]\nname = "{tenant}"\nkey_env = "{KEY_ENVS[tenant]}"\nweight = 1\n'
        if flow and tenant == "interactive":
            text += (
                f"priority = {PRIORITY}\nttft_deadline_ms = {round(workload.deadline_s * 1000)}\n"
            )
        elif flow:
            text += "priority = 0\n"
    return text


@asynccontextmanager
async def open_trio(
    name: str, urls: Sequence[str], workload: Workload, workdir: Path
) -> AsyncIterator[Running]:
    """trio_router as `name` (trio-flow or trio-fair) in front of `urls`; yields once it
    routes; its process group is killed at the end, its stderr kept as NAME.log."""
    port = free_port()
    config = workdir / f"{name}.toml"
    config.write_text(trio_config(port, urls, workload, flow=name == "trio-flow"))
    command = [sys.executable, "-m", "trio_router", "--config", str(config)]
    env = {KEY_ENVS[t]: KEYS[t] for t in TENANTS}
    running = Running(name, f"http://127.0.0.1:{port}")
    async with open_command(command, env=env) as (process, _, stderr):
        running.pids["router"], running.stderr["router"] = process.pid, stderr
        try:
            key = {"authorization": f"Bearer {KEYS['batch']}"}  # tenants only: no anonymous
            async with httpx.AsyncClient(timeout=10.0, headers=key) as client:
                with trio.move_on_after(START_S) as waited:
                    await wait_routing(client, running.url, workload.model, len(urls))
            if waited.cancelled_caught or process.returncode is not None:
                raise RuntimeError(f"{name} did not route within {START_S} s:\n{stderr.text}")
            yield running
        finally:
            (workdir / f"{name}.log").write_text(stderr.text)


def open_any_router(
    name: str, urls: Sequence[str], workload: Workload, workdir: Path
) -> AbstractAsyncContextManager[Running]:
    """Router `name` of ROUTERS in front of `urls`, yielded once it routes."""
    if name.startswith("trio-"):
        return open_trio(name, urls, workload, workdir)
    return open_router(name, urls, workdir, workload.model)


def why_not(name: str) -> str | None:
    """Why router `name` cannot run here, or None."""
    if name.startswith("trio-"):
        return None if name in ROUTERS else f"unknown router {name!r}"
    return available(name) if name in ROUTERS else f"unknown router {name!r}"


# -- the load ----------------------------------------------------------------------------------
@dataclass
class Sent:
    """One request as its client saw it; times in seconds after the load's start."""

    tenant: str
    at: float
    lag_s: float | None = None  # sent this late after its time in the schedule
    status: int | None = None
    reason: str | None = None  # a refusal's
    ttft_s: float | None = None  # to the first token
    ended: float | None = None
    tokens: int = 0
    outcome: str = "cut"  # done | refused | gave_up | error | cut (still running at the end)


def refusal_reason(response: httpx.Response) -> str:
    if reason := response.headers.get("x-trio-router-refusal"):
        return str(reason)
    try:
        code = response.json().get("error", {}).get("code")
    except (ValueError, AttributeError):
        code = None
    return str(code) if code else f"http_{response.status_code}"


async def send(
    client: httpx.AsyncClient,
    url: str,
    arrival: Arrival,
    number: int,
    sent: Sent,
    workload: Workload,
    t0: float,
) -> None:
    """One streamed chat; its figures written to `sent` as they come (a request cut by the
    load's end keeps outcome "cut")."""
    interactive = arrival.tenant == "interactive"
    started = trio.current_time()
    sent.lag_s = started - (t0 + arrival.at)
    headers = {
        "authorization": f"Bearer {KEYS[arrival.tenant]}",
        "x-bench-tenant": arrival.tenant,
        "x-bench-id": str(number),
    }
    now = time.time()  # wall clock: the engines, in another process, compare it with theirs
    headers["x-bench-sent-unix"] = f"{now:.6f}"
    if interactive:
        headers["x-bench-deadline-unix"] = f"{now + workload.deadline_s:.6f}"
    body = {
        "model": workload.model,
        "messages": [{"role": "user", "content": f"request {number}: say something"}],
        "max_tokens": arrival.tokens,
        "stream": True,
    }
    if workload.upstreams:  # vLLM: exactly `tokens` tokens
        body["ignore_eos"] = True
    give_up = started + workload.deadline_s + GIVE_UP_GRACE_S if interactive else math.inf
    try:
        with trio.move_on_at(give_up) as patience:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                sent.status = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    sent.reason, sent.outcome = refusal_reason(response), "refused"
                    sent.ended = trio.current_time() - t0
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: {") or '"content":"' not in line:
                        continue
                    if '"content":""' in line:  # vLLM's first event: the role alone
                        continue
                    if sent.ttft_s is None:
                        sent.ttft_s = trio.current_time() - started
                        patience.deadline = math.inf  # the client waits for the rest
                    sent.tokens += 1
                sent.outcome, sent.ended = "done", trio.current_time() - t0
        if patience.cancelled_caught:
            sent.outcome, sent.ended = "gave_up", trio.current_time() - t0
    except httpx.HTTPError as exc:
        sent.outcome, sent.reason = "error", type(exc).__name__
        sent.ended = trio.current_time() - t0


@dataclass
class Load:
    sent: list[Sent]
    window_s: float  # the arrivals' span: throughput is counted within it
    cpu: dict[str, float]  # cores over the window, by role
    load_cores: float  # this process's


async def run_load(
    url: str, schedule: Sequence[Arrival], window_s: float, workload: Workload, pids: dict[str, int]
) -> Load:
    """Every arrival of `schedule` sent at its time; bounded: `window_s` + drain seconds."""
    sent = [Sent(a.tenant, a.at) for a in schedule]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(None, connect=10.0)  # the whole load is bounded below
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = trio.current_time()
        before, own_before = tree_cpu(pids), resource.getrusage(resource.RUSAGE_SELF)
        cpu: dict[str, float] = {}
        own: list[float] = []

        async def sample_window() -> None:  # on time even if the arrivals fell behind
            await trio.sleep_until(t0 + window_s)
            after, own_after = tree_cpu(pids), resource.getrusage(resource.RUSAGE_SELF)
            elapsed = trio.current_time() - t0
            cpu.update({role: (after[role] - before[role]) / elapsed for role in [*pids, "all"]})
            used = own_after.ru_utime + own_after.ru_stime
            own.append((used - own_before.ru_utime - own_before.ru_stime) / elapsed)
            log(f"  arrivals done; draining (at most {workload.drain_s:.0f} s)")

        with trio.move_on_at(t0 + window_s + workload.drain_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_window)
                for number, arrival in enumerate(schedule):
                    await trio.sleep_until(t0 + arrival.at)
                    nursery.start_soon(
                        send, client, f"{url}{CHAT}", arrival, number, sent[number], workload, t0
                    )
    if not own:
        raise RuntimeError("the load ended before its window: no CPU figures")
    return Load(sent, window_s, cpu, own[0])


# -- figures -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))]


def ms(value: float) -> float | None:
    """Milliseconds, rounded; None for no value (nan) or no first token (inf) in the JSON."""
    return None if not math.isfinite(value) else round(value * 1000, 1)


def interactive_figures(sent: Sequence[Sent], deadline_s: float) -> dict[str, Any]:
    mine = [s for s in sent if s.tenant == "interactive"]
    every = [s.ttft_s if s.ttft_s is not None else math.inf for s in mine]
    served = [s.ttft_s for s in mine if s.ttft_s is not None]
    refused = Counter(s.reason or "?" for s in mine if s.outcome == "refused")
    return {
        "sent": len(mine),
        "ttft_p50_ms": ms(percentile(every, 50)),
        "ttft_p99_ms": ms(percentile(every, 99)),
        "served_ttft_p50_ms": ms(percentile(served, 50)),
        "served_ttft_p99_ms": ms(percentile(served, 99)),
        "within_deadline": sum(t <= deadline_s for t in served) / len(mine) if mine else None,
        "refused": dict(refused),
        "shed_or_queue_full": refused["shed"] + refused["queue_full"],
        "gave_up": sum(s.outcome == "gave_up" for s in mine),
        "errors": sum(s.outcome == "error" for s in mine),
        "cut": sum(s.outcome == "cut" for s in mine),
    }


def batch_figures(sent: Sequence[Sent], window_s: float) -> dict[str, Any]:
    mine = [s for s in sent if s.tenant == "batch"]
    done = [s for s in mine if s.outcome == "done" and s.ended is not None and s.ended <= window_s]
    return {
        "sent": len(mine),
        "completed_rps": len(done) / window_s,
        "tokens_per_s": sum(s.tokens for s in done) / window_s,
        "completed": sum(s.outcome == "done" for s in mine),
        "refused": dict(Counter(s.reason or "?" for s in mine if s.outcome == "refused")),
        "errors": sum(s.outcome == "error" for s in mine),
        "cut": sum(s.outcome == "cut" for s in mine),
    }


def engine_figures(now: float, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The engines' own view (see the module's docstring); the routers' start-up checks
    (requests without x-bench-id) left out."""
    ours = [r for r in records if r["id"] is not None]
    late = [r for r in ours if r["deadline"] is not None and r["arrived"] > r["deadline"]]
    wasted = 0.0
    for r in ours:
        if r["deadline"] is None or r["started"] is None:
            continue
        if r["first_token"] is not None and r["first_token"] <= r["deadline"]:
            continue
        wasted += max(0.0, (r["ended"] or now) - max(r["started"], r["deadline"]))
    waits = [r["started"] - r["arrived"] for r in ours if r["started"] is not None]
    urgent = [r for r in ours if r["tenant"] == "interactive"]
    return {
        "requests": len(ours),
        "after_deadline": len(late),
        "started_after_deadline": sum(
            r["deadline"] is not None and r["started"] is not None and r["started"] > r["deadline"]
            for r in ours
        ),
        # where an interactive request's first token went: the way to the engine (the
        # router's queue), the engine's queue
        "interactive_to_engine_p50_ms": ms(
            percentile([r["arrived"] - r["sent"] for r in urgent if r["sent"]], 50)
        ),
        "interactive_to_engine_p99_ms": ms(
            percentile([r["arrived"] - r["sent"] for r in urgent if r["sent"]], 99)
        ),
        "interactive_engine_queue_p99_ms": ms(
            percentile([r["started"] - r["arrived"] for r in urgent if r["started"]], 99)
        ),
        "wasted_s": round(wasted, 2),
        "aborted": sum(r["outcome"] == "aborted" for r in ours),
        "running_at_end": sum(r["outcome"] is None for r in ours),
        "queue_wait_p99_ms": ms(percentile(waits, 99)),
        "with_priority": sum(r["priority"] is not None for r in ours),
    }


async def measure(
    name: str,
    workload: Workload,
    schedule: Sequence[Arrival],
    window_s: float,
    workdir: Path,
    *,
    label: str = "",
) -> dict[str, Any]:
    """One router's run in front of fresh engines: its figures. `label`: the run's name in
    the log and the records' file (default: the router's)."""
    label = label or name
    log(f"{label}: {len(schedule)} requests over {window_s:.0f} s")
    if workload.upstreams:
        await wait_idle(workload.upstreams)
    async with (
        open_engines(workload, workdir) as engines,
        open_any_router(name, engines.urls, workload, workdir) as running,
    ):
        pids = {"router": running.pids["router"], "engines": engines.pid, "bench": os.getpid()}
        pids |= {f"vllm{i}": pid for i, pid in enumerate(workload.upstream_pids)}
        load = await run_load(running.url, schedule, window_s, workload, pids)
        now, records = await engine_records(engines.urls[0])
        if running.stderr["router"].closed:
            raise RuntimeError(f"{name} exited during the run:\n{running.stderr['router'].text}")
    sent = [asdict(s) for s in load.sent]  # kept with --workdir: what the figures come from
    (workdir / f"{label}-records.json").write_text(json.dumps({"engines": records, "sent": sent}))
    result: dict[str, Any] = {
        "router": name,
        "requests": len(schedule),
        "window_s": window_s,
        "interactive": interactive_figures(load.sent, workload.deadline_s),
        "batch": batch_figures(load.sent, window_s),
        "engines": engine_figures(now, records),
        "router_cores": round(load.cpu["router"], 3),
        "engine_cores": round(  # with --real: the relays' and the vLLM engines'
            sum(v for role, v in load.cpu.items() if role == "engines" or role[:4] == "vllm"), 3
        ),
        "load_cores": round(load.load_cores, 3),
        # how late the load generator sent requests: above a few ms, it is a bottleneck
        "load_lag_p99_ms": ms(percentile([s.lag_s for s in load.sent if s.lag_s is not None], 99)),
        # every process but this benchmark's (its router, engines and itself): should be 0
        "other_cores": round(max(0.0, load.cpu["all"] - load.cpu["bench"]), 3),
    }
    i, b, e = result["interactive"], result["batch"], result["engines"]
    log(
        f"  interactive TTFT p99 {fmt_ms(i['ttft_p99_ms'], workload.deadline_s)}, within deadline "
        f"{pct(i['within_deadline'])}; batch {b['completed_rps']:.1f} req/s; engines: "
        f"{e['after_deadline']} after deadline, {e['wasted_s']} s wasted; load CPU "
        f"{result['load_cores']:.2f} cores, other processes {result['other_cores']:.2f} cores"
    )
    if result["other_cores"] > OTHER_CORES:
        log(f"  warning: other processes took {result['other_cores']:.2f} cores during the run")
    return result


# -- report ------------------------------------------------------------------------------------
def fmt_ms(value: float | None, deadline_s: float) -> str:
    return f">{deadline_s * 1000:.0f}" if value is None else f"{value:.0f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "0"


def markdown(report: dict[str, Any], deadline_s: float) -> str:
    lines = [f"`{report['command']}`", "", report["setup"], ""]
    lines += [
        f"Each router: {report['interactive_requests']} interactive and "
        f"{report['batch_requests']} batch requests (the same schedule).",
        "",
    ]
    unloaded = report.get("unloaded")
    if unloaded:
        u = unloaded["interactive"]
        lines.append(
            f"Unloaded (trio-flow, {unloaded['requests']} interactive requests at "
            f"{report['unloaded_load']:.0%} of capacity): interactive TTFT p50 "
            f"{fmt_ms(u['ttft_p50_ms'], deadline_s)} ms, "
            f"p99 {fmt_ms(u['ttft_p99_ms'], deadline_s)} ms."
        )
        lines.append("")
    lines += [
        "| router | int. TTFT p50 ms | int. TTFT p99 ms | int. served p99 ms | int. within "
        "deadline | int. refused | int. gave up | batch req/s | batch tok/s | batch refused | "
        "batch cut | reached / started at engine after deadline | engine s wasted |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    measured = [r for r in report["runs"] if "skipped" not in r]
    for r in report["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['router']} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        i, b, e = r["interactive"], r["batch"], r["engines"]
        lines.append(
            f"| {r['router']} | {fmt_ms(i['ttft_p50_ms'], deadline_s)} | "
            f"{fmt_ms(i['ttft_p99_ms'], deadline_s)} | "
            f"{fmt_ms(i['served_ttft_p99_ms'], deadline_s)} | {pct(i['within_deadline'])} | "
            f"{reasons(i['refused'])} | {i['gave_up']} | "
            f"{b['completed_rps']:.1f} | {b['tokens_per_s']:.0f} | {reasons(b['refused'])} | "
            f"{b['cut']} | {e['after_deadline']} / {e['started_after_deadline']} | "
            f"{e['wasted_s']:.1f} |"
        )
    lines += [
        "",
        "| router | int. to engine p50 / p99 ms | int. engine queue p99 ms | engine aborts | "
        "router / engines / load CPU cores | load lag p99 ms | other processes' cores |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in measured:
        e = r["engines"]
        lines.append(
            f"| {r['router']} | {fmt_ms(e['interactive_to_engine_p50_ms'], deadline_s)} / "
            f"{fmt_ms(e['interactive_to_engine_p99_ms'], deadline_s)} | "
            f"{fmt_ms(e['interactive_engine_queue_p99_ms'], deadline_s)} | {e['aborted']} | "
            f"{r['router_cores']:.2f} / {r['engine_cores']:.2f} / {r['load_cores']:.2f} | "
            f"{fmt_ms(r['load_lag_p99_ms'], deadline_s)} | {r['other_cores']:.2f} |"
        )
    noisy = [r["router"] for r in measured if r["other_cores"] > OTHER_CORES]
    if unloaded and unloaded["other_cores"] > OTHER_CORES:
        noisy.append("the unloaded run")
    if noisy:
        lines.append(
            f"\nWarning: other processes took more than {OTHER_CORES} cores during "
            f"{', '.join(noisy)}: those figures are disturbed; run again on an idle machine."
        )
    lines += ["", "Goals:"]
    for goal in report["goals"]:
        lines.append(f"- {goal['router']}: {goal['goal']}: {goal['value']} ({goal['verdict']})")
    return "\n".join(lines)


def goals(report: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    unloaded = (report.get("unloaded") or {}).get("interactive", {}).get("ttft_p99_ms")
    for r in report["runs"]:
        if "skipped" in r:
            continue
        i, e = r["interactive"], r["engines"]
        loaded = i["ttft_p99_ms"]
        if unloaded:
            ok = loaded is not None and loaded <= 1.5 * unloaded
            value = "no first token" if loaded is None else f"{loaded:.0f} ms"
            out.append(
                {
                    "router": r["router"],
                    "goal": f"interactive TTFT p99 <= 1.5 x unloaded ({1.5 * unloaded:.0f} ms)",
                    "value": value,
                    "verdict": "met" if ok else "not met",
                }
            )
        checks = (
            ("no interactive request shed while batch waits", i["shed_or_queue_full"]),
            ("requests reaching an engine after their deadline = 0", e["after_deadline"]),
        )
        for goal, count in checks:
            out.append(
                {
                    "router": r["router"],
                    "goal": goal,
                    "value": str(count),
                    "verdict": "met" if count == 0 else "not met",
                }
            )
    return out


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--drain", type=float, default=20.0, help="seconds to finish, at most")
    parser.add_argument("--engines", type=int, help="default 4 (--real: 2)")
    parser.add_argument("--capacity", type=int, default=4, help="streams per engine")
    parser.add_argument("--load", type=float, default=1.5, help="x the cluster's capacity")
    parser.add_argument("--interactive-share", type=float, default=0.3)
    parser.add_argument("--deadline-ms", type=float, default=2000.0)
    parser.add_argument("--prefill-ms", type=float, default=200.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=40, help="of an answer, on average")
    parser.add_argument(
        "--tokens-spread", type=float, default=0.0, help="answers of tokens x [1 -/+ this]"
    )
    parser.add_argument(
        "--reserve", type=int, default=1, help="trio-flow: admission.reserve_per_engine"
    )
    parser.add_argument("--policy", default="round_robin", help="trio_router's routing.policy")
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="the fake engines schedule by the requests' priority and preempt, as vLLM with "
        "--scheduling-policy priority; trio-flow then passes its bands on and lets the top "
        "band go --reserve past the engines' capacity",
    )
    parser.add_argument("--unloaded-load", type=float, default=0.2)
    parser.add_argument("--unloaded-duration", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="15 s runs, 10 s drain, 5 s unloaded")
    parser.add_argument("--real", action="store_true", help="real vLLM engines (see above)")
    parser.add_argument("--calibrate", type=float, default=12.0, help="--real: seconds")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, not Markdown")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--workdir", type=Path, help="keep configs and router logs here")
    args = parser.parse_args(argv)
    if args.engines is None:
        args.engines = 2 if args.real else 4
    if args.quick:
        args.duration, args.drain, args.unloaded_duration = 15.0, 10.0, 5.0
    return args


@asynccontextmanager
async def open_vllm(
    args: argparse.Namespace, workdir: Path
) -> AsyncIterator[list[vllm_engines.EngineProcess]]:
    """--real: `args.engines` vLLM engines (trio_router.testing.vllm_engines: the CPU build, the
    tiny model), `--max-num-seqs` the capacity, `--scheduling-policy priority`; yields them
    once healthy, stops them at the end. Their start blocks: it runs in a thread."""
    env = await trio.to_thread.run_sync(partial(vllm_engines.ensure_environment, log=log))
    hosts = [f"127.0.1.{FIRST_HOST + i}" for i in range(args.engines)]
    specs = vllm_engines.specs_for(
        args.engines,
        port=vllm_engines.free_port(hosts),
        first_host=FIRST_HOST,
        max_num_seqs=args.capacity,
        extra_args=("--scheduling-policy", "priority"),
    )
    log(f"starting {args.engines} vLLM engines (logs in {workdir / 'vllm'})")
    start = partial(vllm_engines.start_engines, env, specs, log_dir=workdir / "vllm")
    engines = await trio.to_thread.run_sync(start)
    try:
        yield engines
    finally:
        with trio.CancelScope(shield=True):
            for engine in engines:
                await trio.to_thread.run_sync(engine.stop)


async def calibrate(urls: Sequence[str], workload: Workload, seconds: float) -> float:
    """--real: the engines' capacity in requests per second: engines x capacity streams sent
    back to back straight to the engines for `seconds`, answers counted over the last 3/4."""
    finished: list[float] = []
    body = {
        "model": workload.model,
        "messages": [{"role": "user", "content": "calibration: say something"}],
        "max_tokens": workload.tokens,
        "ignore_eos": True,
        "stream": True,
    }
    timeout = httpx.Timeout(None, connect=10.0)  # bounded by `seconds` below
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as c:

        async def back_to_back(url: str) -> None:
            while True:
                async with c.stream("POST", f"{url}{CHAT}", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass
                finished.append(trio.current_time())

        t0 = trio.current_time()
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                for index in range(len(urls) * workload.capacity):
                    nursery.start_soon(back_to_back, urls[index % len(urls)])
    counted = sum(t >= t0 + seconds / 4 for t in finished)
    return counted / (seconds * 3 / 4)


async def wait_idle(urls: Sequence[str]) -> None:
    """--real: until no engine runs or queues a request (the last run's aborted ones
    included), at most IDLE_S. vLLM gives no other sign: its /metrics asked every 0.5 s."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        with trio.move_on_after(IDLE_S):
            while True:
                busy = 0.0
                for url in urls:
                    text = (await client.get(f"{url}/metrics")).text
                    busy += sum(float(v) for v in _BUSY.findall(text))
                if busy == 0:
                    return
                await trio.sleep(0.5)
    log(f"  warning: the engines were still busy after {IDLE_S:.0f} s")


async def main_async(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    workload = Workload(
        engines=args.engines,
        capacity=args.capacity,
        prefill_s=args.prefill_ms / 1000,
        itl_s=args.itl_ms / 1000,
        tokens=args.tokens,
        deadline_s=args.deadline_ms / 1000,
        drain_s=args.drain,
        tokens_spread=args.tokens_spread,
        reserve=args.reserve,
        engine_priority=args.engine_priority,
        policy=args.policy,
    )
    if not args.real:
        return await run_all(args, workload, workdir)
    async with open_vllm(args, workdir) as engines:
        urls = [e.url for e in engines]
        workload = replace(
            workload,
            upstreams=tuple(urls),
            upstream_pids=tuple(e.process.pid for e in engines),
            model=vllm_engines.MODEL_NAME,
        )
        log(f"measuring the engines' capacity ({args.calibrate:.0f} s)")
        rps = await calibrate(urls, workload, args.calibrate)
        return await run_all(args, replace(workload, measured_rps=rps), workdir)


async def run_all(args: argparse.Namespace, workload: Workload, workdir: Path) -> dict[str, Any]:
    """The unloaded run, then every router of `args.routers` under the overload."""
    capacity = workload.capacity_rps
    if workload.upstreams:
        engines = (
            f"{workload.engines} vLLM engines (CPU, tiny model, --max-num-seqs "
            f"{workload.capacity}, --scheduling-policy priority; trio-flow with "
            f"priority_to_engines), {workload.tokens} tokens per answer (measured capacity "
            f"{capacity:.1f} req/s)"
        )
    else:
        engines = (
            f"{workload.engines} engines x {workload.capacity} streams, prefill "
            f"{args.prefill_ms:.0f} ms + {workload.tokens} tokens x {args.itl_ms:.0f} ms "
            f"(capacity {capacity:.1f} req/s)"
        )
    if workload.tokens_spread:
        engines += f", answer lengths spread +/-{workload.tokens_spread:.0%}"
    setup = (
        f"{engines}; load {args.load:.0%} = {args.load * capacity:.1f} req/s Poisson for "
        f"{args.duration:.0f} s (drain <= {args.drain:.0f} s), {args.interactive_share:.0%} "
        f"interactive (deadline {args.deadline_ms:.0f} ms), the rest batch."
    )
    log(setup)
    report: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "setup": setup,
        "workload": asdict(workload) | {"capacity_rps": capacity, "load": args.load},
        "unloaded_load": args.unloaded_load,
        "runs": [],
    }
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    light = [
        a
        for a in arrivals(
            args.unloaded_load * capacity, args.unloaded_duration, 1.0, args.seed, workload
        )
        if a.tenant == "interactive"
    ]
    report["unloaded"] = await measure(
        "trio-flow", workload, light, args.unloaded_duration, workdir, label="unloaded"
    )
    schedule = arrivals(
        args.load * capacity, args.duration, args.interactive_share, args.seed, workload
    )
    report["interactive_requests"] = sum(a.tenant == "interactive" for a in schedule)
    report["batch_requests"] = len(schedule) - report["interactive_requests"]
    for name in names:
        if why := why_not(name):
            log(f"skipping {name}: {why}")
            report["runs"].append({"router": name, "skipped": why})
            continue
        report["runs"].append(await measure(name, workload, schedule, args.duration, workdir))
    report["goals"] = goals(report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = trio.run(main_async, args, workdir)
    deadline_s = args.deadline_ms / 1000
    print(json.dumps(report, indent=2) if args.json else markdown(report, deadline_s))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
