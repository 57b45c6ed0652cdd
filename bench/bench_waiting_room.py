"""The waiting room, measured on the real `trio-router` process: what clients of a model see
while the model has no routable engine (a one-replica rollout, the only engine crashing, no
engine for longer than the queue's bound, scale from zero).

    python bench/bench_waiting_room.py [--scenario rollout,crash,no-engine,from-zero]
        [--rate 5] [--bound 10] [--waiting-room | --no-waiting-room]
        [--set SECTION.KEY=VALUE ...] [--log-dir DIR] [--json-out FILE]

The cluster is `trio_router.testing`'s: the wire-level fake Kubernetes API server
(`fake_apiserver`) and `FakeEngine`s served over HTTP by Hypercorn on the pod IPs 127.0.1.1,
127.0.1.2, ..., all on one port, both in this process; the router is its own process (found as
bench_scale finds it: TRIO_ROUTER_CMD, else .venv/bin/trio-router, else `python -m
trio_router`) in Kubernetes mode with its default settings otherwise. Every scenario sends
`--rate` non-streamed chats per second for a bounded time, each bounded by the queue's bound
(`--bound` in `no-engine`, else the router's default) plus `LIMIT_S`, and polls the router's
/metrics every `SCRAPE_S` for `trio_router_model_queued_requests{model}` (summed over the
bands):

- `rollout`: one pod serves the model; it is deleted (its engine stops) and its replacement,
  created at once, is Ready `ROLLOUT_GAP_S` later.
- `crash`: the only engine stops (connections refused) while its pod stays Ready for
  `CRASH_READY_S`, then NotReady; a replacement pod is Ready `CRASH_REPLACE_S` after that.
- `no-engine`: the model's only pod is deleted and none comes back: with the waiting room each
  request should end 503 `no_engine`, with Retry-After, `admission.queue_timeout_s` after it
  was sent (`--bound`, set for this scenario; within a second either way).
- `from-zero`: no pod at all, the model named in `routing.models`; a pod is Ready
  `FROM_ZERO_S` after the first request.

The load runs from `--lead-s` before the event until `--tail-s` after the replacement is Ready
(`no-engine`: `--no-engine-load-s` from just after the deletion). "The gap" is from the event
to the replacement's Ready (`no-engine`: to the end). Reported per scenario: requests sent,
their answers by status (and error code), the longest wait of an answered (200) request and of
any, the most requests the router counted queued for the model during the gap, and whether
the scenario's goal was met: `rollout`, `crash`: every request answered 200, none after more
than the gap plus 3 s, the series >= 1 during the gap; `no-engine`: every request 503
`no_engine` with Retry-After at the bound; `from-zero`: every request 200, the series >= 1.

`--waiting-room` writes `admission.wait_for_engine = true` (and `routing.models` for
`from-zero`) into the router's config; `--no-waiting-room` writes `false` where the router
knows the key, nothing otherwise. The default is on once `trio_router.config` (as this
process imports it) has the key. `--set admission.known_model_s=600` (repeatable; the value
is TOML) sets any other key of the router's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from bench_scale import router_command
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.processes import Output, open_command
from trio_router.testing.vllm_engines import free_port

MODEL: Final = "fake-model"
CHAT: Final = "/v1/chat/completions"
BODY: Final = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
QUEUED: Final = "trio_router_model_queued_requests"
ROLLOUT_GAP_S: Final = 8.5
CRASH_READY_S: Final = 3.0  # the crashed engine's pod stays Ready this long
CRASH_REPLACE_S: Final = 6.0  # ... and its replacement is Ready this long after that
FROM_ZERO_S: Final = 10.0
QUEUE_TIMEOUT_S: Final = 30.0  # admission.queue_timeout_s's default
LIMIT_S: Final = 15.0  # a request's client-side bound, beyond the queue's
SCRAPE_S: Final = 0.25
START_S: Final = 60.0  # the router must serve (and see the first engine) within this


def pod_ip(n: int) -> str:
    return f"127.0.1.{n + 1}"


# -- the cluster ---------------------------------------------------------------------------------
@dataclass
class Cluster:
    """The fake API server and the engines of the pods, served in this process."""

    api: FakeApiServer
    port: int  # every engine's port, as Kubernetes discovery expects
    nursery: trio.Nursery
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    async def start_engine(self, ip: str) -> None:
        """An engine serving MODEL on `ip`; returns once it accepts connections."""
        scope = self.scopes[ip] = trio.CancelScope()
        await self.nursery.start(
            _serve_engine, FakeEngine(name=ip, ttft_s=0.02), ip, self.port, scope
        )

    def stop_engine(self, ip: str) -> None:
        """The engine on `ip` stops: its connections close, new ones are refused."""
        self.scopes.pop(ip).cancel()


async def _serve_engine(
    engine: FakeEngine,
    ip: str,
    port: int,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await serve_fake_engine(engine, ip, port, task_status=task_status)


@asynccontextmanager
async def open_cluster(workdir: Path) -> AsyncIterator[tuple[Cluster, Path]]:
    """The API server with no pods, and its kubeconfig; engines stop when the block ends."""
    async with trio.open_nursery() as nursery:
        api: FakeApiServer = await nursery.start(FakeApiServer().serve)
        port = free_port([pod_ip(n) for n in range(4)])
        yield Cluster(api, port, nursery), api.write_kubeconfig(workdir / "kubeconfig")
        nursery.cancel_scope.cancel(reason="scenario over")


# -- the router's config and process -------------------------------------------------------------
def waiting_room_known() -> bool:
    """Whether the router's config (as imported here) has `admission.wait_for_engine`."""
    from trio_router.config import AdmissionConfig

    return "wait_for_engine" in {f.name for f in dataclasses.fields(AdmissionConfig)}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`SECTION.KEY=VALUE` (VALUE in TOML; a bare word is a string) as (section, key, value)."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().rpartition(".")
    if not sep or not dot or not section or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected SECTION.KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def router_toml(name: str, kubeconfig: Path, port: int, args: argparse.Namespace) -> str:
    sections: dict[str, dict[str, Any]] = {
        "server": {"bind": "127.0.0.1:0", "drain_s": 1.0},
        "discovery": {"mode": "kubernetes"},
        "discovery.kubernetes": {
            "namespace": "default",
            "label_selector": "app=vllm",
            "port": port,
            "kubeconfig": str(kubeconfig),
        },
        "admission": {},
    }
    if name == "no-engine":
        sections["admission"]["queue_timeout_s"] = args.bound
    if args.waiting_room:
        sections["admission"]["wait_for_engine"] = True
        if name == "from-zero":
            sections["routing"] = {"models": [MODEL]}
    elif waiting_room_known():
        sections["admission"]["wait_for_engine"] = False
    for section, key, value in args.set:
        sections.setdefault(section, {})[key] = value
    return toml_text(sections)


@dataclass
class Router:
    url: str
    client: httpx.AsyncClient  # for the load
    scraper: httpx.AsyncClient  # for /metrics, never behind the load's connections
    stderr: Output


@asynccontextmanager
async def open_router(config: Path, log: Path | None, limit_s: float) -> AsyncIterator[Router]:
    """The router process serving `config`; killed when the block ends (its output kept in
    `log`, if given)."""
    command = [*router_command(), "--config", str(config), "--log-level", "info"]
    async with open_command(command) as (_process, stdout, stderr):
        try:
            with trio.fail_after(START_S):
                url = (await stderr.wait_for(r"Running on (http://\S+)")).group(1)
            limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
            async with (
                httpx.AsyncClient(base_url=url, timeout=limit_s, limits=limits) as client,
                httpx.AsyncClient(base_url=url, timeout=5.0) as scraper,
            ):
                yield Router(url, client, scraper, stderr)
        finally:
            if log is not None:
                await trio.Path(log).write_text(stdout.text + stderr.text)


# -- what clients see ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    sent: float  # trio.current_time() when sent
    took: float  # seconds until answered (or given up)
    status: str  # "200", "503", ..., or what went wrong on the wire ("timeout", "ConnectError")
    code: str  # the OpenAI-style error's code (else its type), "" if none
    retry_after: bool

    @property
    def outcome(self) -> str:
        return f"{self.status} {self.code}".strip()


def error_code(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(error, dict):
        return ""
    return str(error.get("code") or error.get("type") or "")


async def one_request(client: httpx.AsyncClient, answers: list[Answer]) -> None:
    sent = trio.current_time()
    try:
        response = await client.post(CHAT, json=BODY)
    except httpx.TimeoutException:
        answers.append(Answer(sent, trio.current_time() - sent, "timeout", "", False))
        return
    except httpx.HTTPError as exc:
        answers.append(Answer(sent, trio.current_time() - sent, type(exc).__name__, "", False))
        return
    code = error_code(response) if response.status_code != 200 else ""
    retry = "retry-after" in response.headers
    answers.append(Answer(sent, trio.current_time() - sent, str(response.status_code), code, retry))


async def run_load(
    client: httpx.AsyncClient, start: float, count: int, rate: float
) -> list[Answer]:
    """`count` requests, `rate` a second from `start`; returns once every one has ended."""
    answers: list[Answer] = []
    async with trio.open_nursery() as nursery:
        for index in range(count):
            await trio.sleep_until(start + index / rate)
            nursery.start_soon(one_request, client, answers)
    return answers


def queued_requests(text: str, model: str) -> float:
    """`trio_router_model_queued_requests` of `model`, summed over its bands."""
    label = f'model="{model}"'
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(QUEUED + "{") and label in line
    )


async def scrape_queued(scraper: httpx.AsyncClient, samples: list[tuple[float, float]]) -> None:
    """(time, queued requests of MODEL) every SCRAPE_S (the state of another process), until
    cancelled."""
    while True:
        try:
            text = (await scraper.get("/metrics")).text
        except httpx.HTTPError:
            pass
        else:
            samples.append((trio.current_time(), queued_requests(text, MODEL)))
        await trio.sleep(SCRAPE_S)


# -- the scenarios -------------------------------------------------------------------------------
@dataclass
class Gap:
    """From the event to the replacement's Ready (`end` stays inf if none comes)."""

    start: float
    end: float = math.inf


async def drive_rollout(cluster: Cluster, gap: Gap) -> None:
    await trio.sleep_until(gap.start)
    cluster.api.delete_pod("vllm-0")
    cluster.stop_engine(pod_ip(0))
    cluster.api.add_pod("vllm-1", ip=pod_ip(1), ready=False)  # the Deployment's replacement
    await trio.sleep_until(gap.start + ROLLOUT_GAP_S)
    await cluster.start_engine(pod_ip(1))
    cluster.api.modify_pod("vllm-1", ready=True)
    gap.end = trio.current_time()


async def drive_crash(cluster: Cluster, gap: Gap) -> None:
    await trio.sleep_until(gap.start)
    cluster.stop_engine(pod_ip(0))
    await trio.sleep_until(gap.start + CRASH_READY_S)
    cluster.api.modify_pod("vllm-0", ready=False)
    await trio.sleep_until(gap.start + CRASH_READY_S + CRASH_REPLACE_S)
    await cluster.start_engine(pod_ip(1))
    cluster.api.add_pod("vllm-1", ip=pod_ip(1))
    gap.end = trio.current_time()


async def drive_no_engine(cluster: Cluster, gap: Gap) -> None:
    await trio.sleep_until(gap.start)
    cluster.api.delete_pod("vllm-0")
    cluster.stop_engine(pod_ip(0))


async def drive_from_zero(cluster: Cluster, gap: Gap) -> None:
    await trio.sleep_until(gap.start + FROM_ZERO_S)
    await cluster.start_engine(pod_ip(0))
    cluster.api.add_pod("vllm-0", ip=pod_ip(0))
    gap.end = trio.current_time()


@dataclass(frozen=True)
class Scenario:
    drive: Callable[[Cluster, Gap], Awaitable[None]]
    first_pod: bool  # one pod serves the model before the event
    gap_s: float  # event to the replacement's Ready (inf: never)


SCENARIOS: Final = {
    "rollout": Scenario(drive_rollout, True, ROLLOUT_GAP_S),
    "crash": Scenario(drive_crash, True, CRASH_READY_S + CRASH_REPLACE_S),
    "no-engine": Scenario(drive_no_engine, True, math.inf),
    "from-zero": Scenario(drive_from_zero, False, FROM_ZERO_S),
}


def load_window(name: str, scenario: Scenario, args: argparse.Namespace) -> tuple[float, float]:
    """(start relative to the event, seconds) of the scenario's load."""
    if name == "no-engine":
        return 0.5, args.no_engine_load_s
    lead = args.lead_s if scenario.first_pod else 0.0
    return -lead, lead + scenario.gap_s + args.tail_s


async def run_scenario(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    limit_s = (args.bound if name == "no-engine" else QUEUE_TIMEOUT_S) + LIMIT_S
    config = workdir / f"{name}.toml"
    log = args.log_dir / f"{name}.log" if args.log_dir else None
    async with open_cluster(workdir) as (cluster, kubeconfig):
        config.write_text(router_toml(name, kubeconfig, cluster.port, args))
        if scenario.first_pod:
            await cluster.start_engine(pod_ip(0))
            cluster.api.add_pod("vllm-0", ip=pod_ip(0))
        async with open_router(config, log, limit_s) as router:
            if scenario.first_pod:
                with trio.fail_after(START_S):
                    await router.stderr.wait_for("is routable")
                warm = await router.client.post(CHAT, json=BODY)
                if warm.status_code != 200:
                    raise RuntimeError(f"{name}: the first request got {warm.status_code}")
            offset, seconds = load_window(name, scenario, args)
            gap = Gap(trio.current_time() + max(0.0, -offset) + 0.1)
            samples: list[tuple[float, float]] = []
            print(f"{name}: {int(args.rate * seconds)} requests over {seconds} s", file=sys.stderr)
            with trio.fail_after(seconds + limit_s + 30.0):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(scrape_queued, router.scraper, samples)
                    nursery.start_soon(scenario.drive, cluster, gap)
                    count = int(args.rate * seconds)
                    answers = await run_load(router.client, gap.start + offset, count, args.rate)
                    nursery.cancel_scope.cancel(reason="load over")
    end = gap.end if math.isfinite(gap.end) else math.inf
    queued = [value for at, value in samples if gap.start <= at <= end]
    return summary(name, args, answers, max(queued, default=0.0))


def summary(
    name: str, args: argparse.Namespace, answers: Sequence[Answer], queued: float
) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    ok = [a.took for a in answers if a.status == "200"]
    result: dict[str, Any] = {
        "scenario": name,
        "waiting_room": args.waiting_room,
        "sent": len(answers),
        "answered": dict(Counter(a.outcome for a in answers).most_common()),
        "longest_200_s": round(max(ok), 2) if ok else None,
        "longest_s": round(max((a.took for a in answers), default=0.0), 2),
        "gap_s": scenario.gap_s if math.isfinite(scenario.gap_s) else None,
        "queued_max_in_gap": queued,
    }
    if name == "no-engine":
        at_bound = [
            a
            for a in answers
            if a.outcome == "503 no_engine" and a.retry_after and abs(a.took - args.bound) <= 1.0
        ]
        result["bound_s"] = args.bound
        result["no_engine_at_bound"] = len(at_bound)
        result["shortest_s"] = round(min((a.took for a in answers), default=0.0), 2)
        result["goal_met"] = len(at_bound) == len(answers)
    else:
        every_200 = len(ok) == len(answers)
        in_time = name == "from-zero" or max(ok, default=math.inf) <= scenario.gap_s + 3.0
        result["goal_met"] = every_200 and in_time and queued >= 1
    return result


# -- the report ----------------------------------------------------------------------------------
def table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| scenario | waiting room | sent | answered | longest 200 s | longest s | gap s |"
    head += " queued in gap (max) | goal |"
    lines = [head, "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        answered = ", ".join(f"{k} x{v}" for k, v in r["answered"].items())
        gap = r["gap_s"] if r["gap_s"] is not None else "-"
        lines.append(
            f"| {r['scenario']} | {'on' if r['waiting_room'] else 'off'} | {r['sent']} | "
            f"{answered} | {r['longest_200_s'] or '-'} | {r['longest_s']} | {gap} | "
            f"{r['queued_max_in_gap']:g} | {'met' if r['goal_met'] else 'missed'} |"
        )
    for r in rows:
        if r["scenario"] == "no-engine":
            lines.append(
                f"\nno-engine: {r['no_engine_at_bound']} of {r['sent']} ended 503 no_engine "
                f"with Retry-After at the bound ({r['bound_s']} s +- 1 s); shortest "
                f"{r['shortest_s']} s, longest {r['longest_s']} s"
            )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="waiting-room-") as tmp:
        for name in args.scenario:
            workdir = Path(tmp) / name
            workdir.mkdir()
            rows.append(await run_scenario(name, args, workdir))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default=",".join(SCENARIOS))
    parser.add_argument("--rate", type=float, default=5.0, help="requests per second")
    parser.add_argument("--bound", type=float, default=10.0, help="queue_timeout_s (no-engine)")
    parser.add_argument("--lead-s", type=float, default=2.0, help="load before the event")
    parser.add_argument("--tail-s", type=float, default=3.0, help="load after the replacement")
    parser.add_argument("--no-engine-load-s", type=float, default=5.0)
    parser.add_argument(
        "--waiting-room",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write admission.wait_for_engine (default: on if the router's config knows it)",
    )
    parser.add_argument(
        "--set",
        type=parse_override,
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a key of the router's config (VALUE in TOML); repeatable",
    )
    parser.add_argument("--log-dir", type=Path, help="keep the router's log (SCENARIO.log)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    args.scenario = [s for s in args.scenario.split(",") if s]
    if unknown := [s for s in args.scenario if s not in SCENARIOS]:
        parser.error(f"--scenario: unknown {unknown} (known: {', '.join(SCENARIOS)})")
    if args.waiting_room is None:
        args.waiting_room = waiting_room_known()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    rows = trio.run(main_async, args)
    print(table(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
