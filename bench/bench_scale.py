"""Discovery at scale, measured black box on the real `trio-router` process.

    python bench/bench_scale.py [--scenario hang,slow,idle,watch] [--json-out FILE]

Three processes besides this one, all on loopback:

- the wire-level fake Kubernetes API server (trio_router.testing.fake_apiserver) with realistic pod
  objects (about 2.4 KB per watch event), driven by this script over a pipe;
- a fleet of fake vLLM engines (bench/fleet.py), each on its own address 127.0.x.y (the pod
  IPs), healthy, slow or hanging, closing idle connections after 5 s as vLLM does;
- the router itself: `trio-router --config FILE` in Kubernetes mode with the default probe and
  stats settings (found as TRIO_ROUTER_CMD, else .venv/bin/trio-router, else
  `python -m trio_router`).

Scenarios (sizes are flags):

- `hang`: 3 healthy engines serve traffic at 20 req/s while 300 pods whose engines never
  answer are Ready; one hanging pod is deleted midway. Reports request outcomes and latency,
  ejections of healthy engines, the router's CPU, `/engines` latency, and how long the
  deleted pod stayed in `/engines`.
- `slow`: 500 pods become Ready at once and every engine answers after 1 s: time until all
  are routable, ejections, CPU.
- `idle`: N routable healthy engines (100, 500, 1000) and no traffic: the router's CPU (share
  of one core) and RSS, once the start-up probes are over; the cost of `/engines` and
  `/metrics` at that size; then one request at a time, alternately through the router and
  straight to an engine (the engines in turn, as the router's default round robin takes
  them): the p50 and p99 of each and what the router adds.
- `watch`: heartbeat MODIFIED events for 100 pods (nothing routing reads changes), first a
  burst as fast as the API server sends them, then a trickle of 200 events/s, each alone:
  router CPU per event, beyond its idle cost.

The router's CPU is user + system time of its process (all threads) from /proc. Every load
is bounded in count and time; every process is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import trio
import trio.lowlevel

from trio_router.testing.fake_apiserver import FakeApiServer

ROOT = Path(__file__).resolve().parent.parent


ENGINE_PORT = 18800
TICK = os.sysconf("SC_CLK_TCK")
CHAT: Final = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}


def address(group: int, n: int) -> str:
    """The pod IP of engine `n` of `group` (a /16 per group, so groups never overlap)."""
    return f"127.{group}.{n // 250}.{n % 250 + 1}"


# -- the API server child ------------------------------------------------------------------
async def apiserver_child() -> None:
    """Serve pods; apply the JSON commands read from stdin, one per line, answering each."""
    server = FakeApiServer()
    server.bookmark_interval_s = 60.0
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        print(json.dumps({"url": server.url}), flush=True)
        stdin = trio.lowlevel.FdStream(0)
        buffer = b""
        while True:
            while b"\n" not in buffer:
                if not (data := await stdin.receive_some()):
                    nursery.cancel_scope.cancel()
                    return
                buffer += data
            line, buffer = buffer.split(b"\n", 1)
            command = json.loads(line)
            op = command["op"]
            if op == "add":
                for pod in command["pods"]:
                    server.add_pod(
                        pod["name"], ip=pod["ip"], ready=pod.get("ready", True), realistic=True
                    )
            elif op == "delete":
                for name in command["names"]:
                    server.delete_pod(name)
            elif op == "heartbeats":
                names, count, rate = command["names"], command["count"], command["rate"]
                start = trio.current_time()
                for i in range(count):
                    server.modify_pod(names[i % len(names)], heartbeat=i + 1)
                    if rate:
                        await trio.sleep_until(start + (i + 1) / rate)
                    elif i % 256 == 0:
                        await trio.lowlevel.checkpoint()  # let the watch stream flush
            print(json.dumps({"ok": True, "rv": server.resource_version}), flush=True)


class ApiServer:
    """The parent's handle on the API server child."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def read_line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            data = await self.process.stdout.receive_some()
            if not data:
                raise RuntimeError("the API server child exited")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    async def command(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(json.dumps(command).encode() + b"\n")
        return await self.read_line()

    async def add(self, pods: list[tuple[str, str]]) -> None:
        await self.command(op="add", pods=[{"name": n, "ip": ip} for n, ip in pods])


# -- the router process --------------------------------------------------------------------
def router_command() -> list[str]:
    if cmd := os.environ.get("TRIO_ROUTER_CMD"):
        return cmd.split()
    venv = ROOT / ".venv" / "bin" / "trio-router"
    if venv.exists():
        return [str(venv)]
    return [sys.executable, "-m", "trio_router"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid`, all threads, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Router:
    pid: int
    url: str
    log: Path
    client: httpx.AsyncClient

    async def engines(self) -> list[dict[str, Any]]:
        response = await self.client.get(f"{self.url}/engines")
        response.raise_for_status()
        engines: list[dict[str, Any]] = response.json()["engines"]
        return engines

    async def routable(self) -> set[str]:
        return {e["name"] for e in await self.engines() if e["healthy"]}

    async def wait_routable(self, names: set[str], limit_s: float) -> float:
        """Seconds until every one of `names` is routable (polled every 0.1 s)."""
        start = time.perf_counter()
        with trio.fail_after(limit_s):
            while not names <= await self.routable():  # noqa: ASYNC110 (another process)
                await trio.sleep(0.1)
        return time.perf_counter() - start

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def ejections(self, names: set[str] | None = None) -> int:
        """Engines taken out of routing by failed probes or requests (from the router's
        log), only those named in `names` if given."""
        count = 0
        for line in self.log.read_text(errors="replace").splitlines():
            match = re.search(r"engine (\S+) (?:at \S+ )?ejected", line)
            if match and (names is None or match.group(1) in names):
                count += 1
        return count


@asynccontextmanager
async def cluster(
    engines: dict[str, str], workdir: Path, extra: str = ""
) -> AsyncIterator[tuple[ApiServer, Router]]:
    """The API server, the engine fleet and the router, running; all killed on exit."""
    spec = workdir / "fleet.json"
    spec.write_text(json.dumps({"port": ENGINE_PORT, "engines": engines}))
    processes: list[trio.Process] = []
    try:
        fleet = await trio.lowlevel.open_process(
            [sys.executable, str(ROOT / "bench" / "fleet.py"), str(spec)], stdout=subprocess.PIPE
        )
        processes.append(fleet)
        api = await trio.lowlevel.open_process(
            [sys.executable, __file__, "--apiserver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        processes.append(api)
        apiserver = ApiServer(api)
        url = (await apiserver.read_line())["url"]
        assert fleet.stdout is not None
        ready = b""
        while b"\n" not in ready:
            if not (data := await fleet.stdout.receive_some()):
                raise RuntimeError("the engine fleet exited")
            ready += data
        kubeconfig = workdir / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "bench",
                    "clusters": [{"name": "bench", "cluster": {"server": url}}],
                    "users": [{"name": "bench", "user": {"token": "t"}}],
                    "contexts": [
                        {"name": "bench", "context": {"cluster": "bench", "user": "bench"}}
                    ],
                }
            )
        )
        port = free_port()
        config = workdir / "router.toml"
        config.write_text(f"""
[server]
bind = "127.0.0.1:{port}"
drain_s = 2.0

[discovery]
mode = "kubernetes"

[discovery.kubernetes]
namespace = "default"
label_selector = "app=vllm"
port = {ENGINE_PORT}
kubeconfig = "{kubeconfig}"
{extra}""")
        log = workdir / "router.log"
        with log.open("wb") as log_file:
            router = await trio.lowlevel.open_process(
                [*router_command(), "--config", str(config), "--log-level", "info"],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        processes.append(router)
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
            handle = Router(router.pid, f"http://127.0.0.1:{port}", log, client)
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get(f"{handle.url}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if router.poll() is not None:
                        raise RuntimeError(f"the router exited; see {log}")
                    await trio.sleep(0.1)
            yield apiserver, handle
    finally:
        for process in reversed(processes):
            if process.returncode is None:
                process.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await process.wait()


# -- measurements ------------------------------------------------------------------------
@dataclass
class Load:
    """Requests sent at a fixed rate, and what became of them."""

    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = sorted(self.latencies)

        def pct(q: float) -> float:
            return round(1000 * ok[min(len(ok) - 1, int(q * len(ok)))], 1) if ok else math.nan

        return {
            "requests": sum(self.statuses.values()),
            "outcomes": dict(self.statuses),
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "max_ms": pct(1.0),
        }


async def run_load(router: Router, rate: float, duration: float) -> Load:
    """`rate` chat requests per second for `duration` seconds, each with a 10 s budget."""
    load = Load()

    async def one() -> None:
        start = time.perf_counter()
        try:
            response = await router.client.post(
                f"{router.url}/v1/chat/completions", json=CHAT, timeout=10.0
            )
            load.statuses[str(response.status_code)] += 1
            if response.status_code == 200:
                load.latencies.append(time.perf_counter() - start)
        except httpx.TimeoutException:
            load.statuses["timeout"] += 1
        except httpx.HTTPError as exc:
            load.statuses[type(exc).__name__] += 1

    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        for i in range(int(rate * duration)):
            await trio.sleep_until(start + i / rate)
            nursery.start_soon(one)
    return load


def percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


async def routed_and_direct(
    router: Router, ips: list[str], count: int, warmup: int = 20
) -> tuple[list[float], list[float]]:
    """Seconds of `count` chat requests one at a time through the router and as many straight
    to the engines (in turn), alternating so that both see the same machine."""
    routed: list[float] = []
    direct: list[float] = []
    for i in range(warmup + count):
        for url, into in (
            (f"{router.url}/v1/chat/completions", routed),
            (f"http://{ips[i % len(ips)]}:{ENGINE_PORT}/v1/chat/completions", direct),
        ):
            start = time.perf_counter()
            response = await router.client.post(url, json=CHAT)
            elapsed = time.perf_counter() - start
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
            if i >= warmup:
                into.append(elapsed)
    return routed, direct


async def timed_get(router: Router, path: str) -> tuple[float, int]:
    start = time.perf_counter()
    response = await router.client.get(f"{router.url}{path}")
    return time.perf_counter() - start, len(response.content)


async def cpu_over(router: Router, seconds: float) -> float:
    """The router's CPU as a share of one core over the next `seconds`."""
    cpu0, wall0 = router.cpu(), time.perf_counter()
    await trio.sleep(seconds)
    return (router.cpu() - cpu0) / (time.perf_counter() - wall0)


# -- scenarios ---------------------------------------------------------------------------
async def scenario_hang(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    healthy = [(f"ok-{n}", address(10, n)) for n in range(args.healthy)]
    hanging = [(f"hang-{n}", address(20, n)) for n in range(args.hanging)]
    engines = {ip: "ok" for _, ip in healthy} | {ip: "hang" for _, ip in hanging}
    async with cluster(engines, workdir) as (api, router):
        await api.add(healthy)
        await router.wait_routable({n for n, _ in healthy}, 30)
        cpu0, wall0 = router.cpu(), time.perf_counter()
        await api.add(hanging)
        windows: list[float] = []
        engines_ms: list[float] = []
        lost_healthy: set[str] = set()
        deleted: dict[str, float] = {}

        async def watch_router(cancel: trio.CancelScope) -> None:
            with cancel:
                while True:
                    c0, w0 = router.cpu(), time.perf_counter()
                    for _ in range(5):
                        await trio.sleep(1.0)
                        took, _size = await timed_get(router, "/engines")
                        engines_ms.append(took * 1000)
                        lost_healthy.update({n for n, _ in healthy} - await router.routable())
                    windows.append((router.cpu() - c0) / (time.perf_counter() - w0))

        async def delete_one() -> None:
            await trio.sleep(args.duration / 2)
            name = hanging[0][0]
            start = time.perf_counter()
            await api.command(op="delete", names=[name])
            while any(e["name"] == name for e in await router.engines()):
                pass
            deleted[name] = time.perf_counter() - start

        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()
            nursery.start_soon(watch_router, cancel)
            nursery.start_soon(delete_one)
            load = await run_load(router, args.rate, args.duration)
            cancel.cancel()
        cpu = (router.cpu() - cpu0) / (time.perf_counter() - wall0)
        return {
            "scenario": "hang",
            "healthy": args.healthy,
            "hanging": args.hanging,
            "rate": args.rate,
            "duration_s": args.duration,
            "load": load.summary(),
            "healthy_ejections": router.ejections({n for n, _ in healthy}),
            "healthy_seen_unroutable": sorted(lost_healthy),
            "cpu_cores_mean": round(cpu, 3),
            "cpu_cores_max_5s": round(max(windows, default=math.nan), 3),
            "engines_ms_median": round(statistics.median(engines_ms), 1) if engines_ms else None,
            "engines_ms_max": round(max(engines_ms), 1) if engines_ms else None,
            "deleted_gone_ms": round(1000 * deleted[hanging[0][0]], 1) if deleted else None,
            "rss_mib": round(rss_mib(router.pid), 1),
        }


async def scenario_slow(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    slow = [(f"slow-{n}", address(30, n)) for n in range(args.slow)]
    engines = {ip: f"slow:{args.probe_delay}" for _, ip in slow}
    async with cluster(engines, workdir) as (api, router):
        cpu0 = router.cpu()
        start = time.perf_counter()
        await api.add(slow)
        names = {n for n, _ in slow}
        marks: dict[str, float] = {}
        with trio.move_on_after(args.slow_limit):
            while True:
                routable = len(names & await router.routable())
                now = time.perf_counter() - start
                for share in (0.5, 0.9, 1.0):
                    if routable >= share * len(names):
                        marks.setdefault(f"{int(share * 100)}%", round(now, 2))
                if routable == len(names):
                    break
                await trio.sleep(0.1)
        elapsed = time.perf_counter() - start
        return {
            "scenario": "slow",
            "pods": args.slow,
            "probe_delay_s": args.probe_delay,
            "routable_after_s": marks,
            "all_routable": "100%" in marks,
            "ejections": router.ejections(),
            "cpu_cores_mean": round((router.cpu() - cpu0) / elapsed, 3),
        }


async def scenario_idle(args: argparse.Namespace, workdir: Path, size: int) -> dict[str, Any]:
    pods = [(f"idle-{n}", address(40, n)) for n in range(size)]
    extra = f'[metrics]\nengine_series = "{args.engine_series}"\n' if args.engine_series else ""
    if args.stats_interval is not None:
        extra += f"[stats]\ninterval_s = {args.stats_interval}\n"
    async with cluster({ip: "ok" for _, ip in pods}, workdir, extra) as (api, router):
        await api.add(pods)
        routable_s = await router.wait_routable({n for n, _ in pods}, 60)
        await trio.sleep(args.settle)
        cpu = await cpu_over(router, args.idle_window)
        engines = [await timed_get(router, "/engines") for _ in range(5)]
        metrics = [await timed_get(router, "/metrics") for _ in range(5)]
        routed, direct = await routed_and_direct(router, [ip for _, ip in pods], args.requests)
        return {
            "scenario": "idle",
            "engines": size,
            "routable_after_s": round(routable_s, 2),
            "cpu_cores": round(cpu, 4),
            "rss_mib": round(rss_mib(router.pid), 1),
            "open_fds": open_fds(router.pid),
            "engines_ms": round(1000 * statistics.median(t for t, _ in engines), 1),
            "engines_kib": round(engines[0][1] / 1024, 1),
            "metrics_ms": round(1000 * statistics.median(t for t, _ in metrics), 1),
            "metrics_kib": round(metrics[0][1] / 1024, 1),
            "routed_p50_ms": percentile_ms(routed, 0.5),
            "direct_p50_ms": percentile_ms(direct, 0.5),
            "added_p50_ms": round(percentile_ms(routed, 0.5) - percentile_ms(direct, 0.5), 2),
            "routed_p99_ms": percentile_ms(routed, 0.99),
            "direct_p99_ms": percentile_ms(direct, 0.99),
            "ejections": router.ejections(),
        }


async def events_applied(router: Router) -> int:
    text = (await router.client.get(f"{router.url}/metrics")).text
    match = re.search(r"^trio_router_discovery_events_total (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else 0


async def scenario_watch(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    pods = [(f"watch-{n}", address(50, n)) for n in range(args.watch_pods)]
    async with cluster({ip: "ok" for _, ip in pods}, workdir) as (api, router):
        await api.add(pods)
        await router.wait_routable({n for n, _ in pods}, 60)
        await trio.sleep(args.settle)
        idle = await cpu_over(router, 5.0)
        result: dict[str, Any] = {
            "scenario": "watch",
            "pods": args.watch_pods,
            "idle_cpu_cores": round(idle, 4),
        }
        # A burst as fast as the API server sends, then a steady trickle (each event alone).
        for label, count, rate in (
            ("burst", args.events, 0.0),
            ("paced", int(args.paced_rate * 10), args.paced_rate),
        ):
            before = await events_applied(router)
            cpu0, start = router.cpu(), time.perf_counter()
            await api.command(op="heartbeats", names=[n for n, _ in pods], count=count, rate=rate)
            with trio.fail_after(120):
                while await events_applied(router) < before + count:  # noqa: ASYNC110
                    await trio.sleep(0.25)
            elapsed = time.perf_counter() - start
            cpu = router.cpu() - cpu0 - idle * elapsed
            result[label] = {
                "events": count,
                "seconds": round(elapsed, 2),
                "events_per_s": round(count / elapsed),
                "router_cpu_us_per_event": round(1e6 * cpu / count, 1),
            }
        return result


def markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(
            f"- {r['scenario']}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "scenario")
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    results: list[dict[str, Any]] = []
    runners: dict[str, Callable[..., Any]] = {
        "hang": scenario_hang,
        "slow": scenario_slow,
        "watch": scenario_watch,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenario.split(","):
            workdir = Path(tmp) / name
            workdir.mkdir()
            if name == "idle":
                for size in (int(s) for s in args.idle_sizes.split(",")):
                    sized = workdir / str(size)
                    sized.mkdir()
                    result = await scenario_idle(args, sized, size)
                    results.append(result)
                    print(markdown([result]), file=sys.stderr, flush=True)
            else:
                result = await runners[name](args, workdir)
                results.append(result)
                print(markdown([result]), file=sys.stderr, flush=True)
    print(markdown(results))
    if args.json_out:
        await trio.Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="hang,slow,idle,watch")
    parser.add_argument("--healthy", type=int, default=3)
    parser.add_argument("--hanging", type=int, default=300)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s (hang)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (hang)")
    parser.add_argument("--slow", type=int, default=500)
    parser.add_argument("--probe-delay", type=float, default=1.0)
    parser.add_argument(
        "--slow-limit",
        type=float,
        default=30.0,
        help="give up waiting for the slow pods after this many seconds",
    )
    parser.add_argument("--idle-sizes", default="100,500,1000")
    parser.add_argument("--idle-window", type=float, default=30.0)
    parser.add_argument(
        "--requests", type=int, default=300, help="one-at-a-time requests of each kind (idle)"
    )
    parser.add_argument(
        "--engine-series",
        default="",
        help="metrics.engine_series of the router (idle; default: the router's default)",
    )
    parser.add_argument(
        "--stats-interval",
        type=float,
        default=None,
        help="stats.interval_s of the router (idle; 0: no scraping; default: the router's)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="seconds between all routable and the idle measurement",
    )
    parser.add_argument("--watch-pods", type=int, default=100)
    parser.add_argument("--events", type=int, default=20000, help="events of the burst (watch)")
    parser.add_argument(
        "--paced-rate",
        type=float,
        default=200.0,
        help="events/s of the steady trickle, for 10 s (watch)",
    )
    parser.add_argument("--json-out", default="")
    parser.add_argument("--apiserver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.apiserver:
        trio.run(apiserver_child)
    else:
        trio.run(main_async, args)


if __name__ == "__main__":
    main()
