"""Engines killed under load: what a client of each router loses, and what trio_router's stream
continuation (`proxy.resume`) costs a resumed stream.

    python bench/bench_chaos.py fakes [--routers trio,production-stack,vllm-router-rs]
                                      [--streams 64] [--engines 4] [--duration 60]
    python bench/bench_chaos.py real  [--streams 16] [--engines 4] [--tokens 96]
    python bench/bench_chaos.py exactness [--kills 20] [--tokens 200] [--kill-after 50]

`fakes`: `--engines` fake vLLM engines (`trio_router.testing.FakeEngine` served by Hypercorn,
each its own process on 127.0.1.51, .52, ...) that stream `--tokens` tokens, the first after
`--ttft-ms`, then one every `--itl-ms`; greedy like vLLM (a prompt ending with an engine's own
tokens goes on from there), so a continued answer can be checked word for word. `real`: real
vLLM engines (the CPU build and tiny model of `trio_router.testing.vllm_engines`, the first run
installs it), a greedy chat (`temperature` 0, `ignore_eos`) of `--tokens` tokens.

Each router in turn (`--routers`; the peers when their environment names them, as
`../shared/bench`'s README sets them up, never committed: production-stack `PEER_PS_PYTHON` +
`PEER_PS_SRC`, the Rust vllm-router `PEER_VR_BIN`), in front of the same engines: `--streams`
clients, each sending one streamed chat after another for `--duration` seconds (0.5 s apart
after one that was refused); every `--kill-every` seconds one engine (in turn) gets `--signal`
(KILL: a crash; TERM: what Kubernetes sends a deleted pod) and is started again `--down-s`
seconds later (a real engine once it has stopped; it takes its start-up time, and the next
kill waits until every engine serves again). After
`--duration` no new request starts; the ones running finish (bounded by `--limit`).
`--log-dir` keeps each router's log there.

Each request is one of: `ok` (200, one `[DONE]`, the whole answer: the same text as the same
request answered without a failure), `diverged` (well-formed and complete, another text: engine
numerics of a continuation), `cut` (200, then broken off: no `[DONE]`, an error event, the
connection closed or a shorter text), `lost` (no 200: an error status or no answer). A stream
"hit" is one running on an engine when it was killed (trio_router names the engine in
`x-trio-router-engine`); the latency a resumed stream pays is its duration less the median of
the streams no kill touched (p50, p99). For trio_router the report also has the router's own
count of resumes (`trio_router_stream_resumes_total`).

`exactness`: `--engines` (3) real engines behind trio_router; greedy streamed chats of
`--tokens` tokens, each one's engine stopped (SIGKILL and SIGTERM in turn) once the client has
`--kill-after` tokens, then started again in the background, until `--kills` of them were
carried on by the router (a trial whose engine had written its whole answer before it was
stopped had nothing to fail); each trial waits until two engines serve and the router shows
exactly those healthy. Reported: whether each stream's tokens equal those of the same request
run straight at an engine without a failure, and where the first difference is when not.

Loopback only; every load stops by itself (`--duration`, `--limit`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from peers import ROUTERS, open_router
from trio_router.testing import vllm_engines
from trio_router.testing.processes import open_command
from trio_router.testing.vllm_engines import MODEL_NAME, EngineEnvironment, EngineProcess

CHAT: Final = "/v1/chat/completions"
FAKE_MODEL: Final = "fake-model"
FIRST_HOST: Final = 51  # engines on 127.0.1.51, .52, ...
START_S: Final = 90.0  # a fake engine must be up within this
LOST_PAUSE_S: Final = 0.5  # a client whose request was refused waits this before its next


# -- engines -------------------------------------------------------------------------------------
async def serve_one_fake(args: argparse.Namespace) -> None:
    """The `engine` command: one fake engine in this process, until killed."""
    from trio_router.testing import FakeEngine
    from trio_router.testing.fake_engine_app import serve_fake_engine

    engine = FakeEngine(
        name=args.host,
        tokens=args.tokens,
        ttft_s=args.ttft_ms / 1000,
        inter_token_s=args.itl_ms / 1000,
        keep_requests=16,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_fake_engine, engine, args.host, args.port)
        print("ready", flush=True)


class Slot:
    """One engine's place (host:port) and whatever process serves it now."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.up = trio.Event()  # set while an engine serves here

    async def kill(self, how: signal.Signals) -> None:
        """`how` to the engine; returns once it has exited."""
        raise NotImplementedError

    async def restart(self) -> None:
        """An engine started here again; returns once it serves."""
        raise NotImplementedError


class FakeSlot(Slot):
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        super().__init__(url)
        host, port = url.removeprefix("http://").split(":")
        self._command = [sys.executable, __file__, "engine", "--host", host, "--port", port]
        self._command += ["--tokens", str(args.tokens), "--ttft-ms", str(args.ttft_ms)]
        self._command += ["--itl-ms", str(args.itl_ms)]
        self._pid = 0
        self._exited, self._again = trio.Event(), trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve; after each kill, serve again once `restart` is called. Until cancelled."""
        status = task_status
        while True:
            async with open_command(self._command) as (process, stdout, _):
                with trio.fail_after(START_S):
                    await stdout.wait_for("ready")
                self._pid = process.pid
                self.up.set()
                status.started()
                status = trio.TASK_STATUS_IGNORED
                await process.wait()
            self._exited.set()
            await self._again.wait()
            self._again = trio.Event()

    async def kill(self, how: signal.Signals) -> None:
        self.up, self._exited = trio.Event(), trio.Event()
        os.killpg(self._pid, how)
        await self._exited.wait()

    async def restart(self) -> None:
        self._again.set()
        await self.up.wait()


class RealSlot(Slot):
    def __init__(self, engine: EngineProcess, env: EngineEnvironment, log_dir: Path) -> None:
        super().__init__(engine.url)
        self.engine, self._env, self._log_dir = engine, env, log_dir
        self.up.set()

    async def kill(self, how: signal.Signals) -> None:
        self.up = trio.Event()
        os.killpg(self.engine.process.pid, how)
        await trio.to_thread.run_sync(self.engine.process.wait)

    async def restart(self) -> None:
        self.engine.stop()
        spec, log_dir = self.engine.spec, self._log_dir
        (self.engine,) = await trio.to_thread.run_sync(
            lambda: vllm_engines.start_engines(self._env, [spec], log_dir=log_dir)
        )
        self.up.set()


# -- the client ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str  # ok | diverged | cut | lost
    started: float
    ended: float
    engine: str = ""  # as the router named it (trio_router)
    detail: str = ""

    @property
    def duration(self) -> float:
        return self.ended - self.started


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "stream": True, "max_tokens": args.tokens}
    body["messages"] = [{"role": "user", "content": "tell a long story"}]
    if args.mode != "fakes":
        body |= {"temperature": 0, "ignore_eos": True}
    return body


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    """One streamed chat: its outcome, and its text in `detail` when it ended well-formed."""
    started = trio.current_time()
    engine, text, done = "", [], 0
    try:
        async with client.stream("POST", f"{url}{CHAT}", json=body) as answer:
            engine = answer.headers.get("x-trio-router-engine", "")
            if answer.status_code != 200:
                await answer.aread()
                detail = f"{answer.status_code} {answer.text[:120]}"
                return Outcome("lost", started, trio.current_time(), engine, detail)
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    detail = f"error event: {str(event['error'])[:120]}"
                    return Outcome("cut", started, trio.current_time(), engine, detail)
                for choice in event.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
    except (httpx.HTTPError, ValueError) as exc:
        kind = "cut" if text or engine else "lost"
        return Outcome(kind, started, trio.current_time(), engine, f"{type(exc).__name__}: {exc}")
    ended = trio.current_time()
    if done != 1:
        return Outcome("cut", started, ended, engine, f"{done} [DONE]")
    return Outcome("ok", started, ended, engine, "".join(text))


@dataclass
class Run:
    router: str
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[tuple[float, float, str]] = field(default_factory=list)  # (at, back, url)
    counted: dict[str, float] = field(default_factory=dict)  # trio_router's resume counter


async def load(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], run: Run, until: float
) -> None:
    while trio.current_time() < until:
        outcome = await one_stream(client, url, body)
        run.outcomes.append(outcome)
        if outcome.kind == "lost":
            await trio.sleep(LOST_PAUSE_S)


async def chaos(slots: Sequence[Slot], args: argparse.Namespace, run: Run, t0: float) -> None:
    """One engine killed every `--kill-every` s (the first after half of it), in turn, each
    started again `--down-s` s later; never while another is down (a real engine's start-up
    can outlast the interval: then the next kill waits for it)."""
    how = signal.Signals[f"SIG{args.signal}"]
    async with trio.open_nursery() as nursery:
        for index in range(int(args.duration // args.kill_every)):
            await trio.sleep_until(t0 + args.kill_every * (index + 0.5))
            slot = slots[index % len(slots)]
            for every in slots:  # one engine down at a time: a real one takes its start-up
                await every.up.wait()
            if trio.current_time() >= t0 + args.duration:  # the load is over
                break
            killed = trio.current_time()
            await slot.kill(how)
            nursery.start_soon(back_up, slot, args, run, killed)


async def back_up(slot: Slot, args: argparse.Namespace, run: Run, killed: float) -> None:
    await trio.sleep(args.down_s)
    await slot.restart()
    run.kills.append((killed, trio.current_time(), slot.url))
    print(f"  {slot.url} killed at {killed:.1f}, back", file=sys.stderr)


# -- figures -------------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] if ordered else 0.0


def summary(run: Run, expected: str) -> dict[str, Any]:
    for outcome in run.outcomes:
        if outcome.kind == "ok" and outcome.detail != expected:
            short = len(outcome.detail) < len(expected) and expected.startswith(outcome.detail)
            outcome.kind = "cut" if short else "diverged"
    counts = {kind: 0 for kind in ("ok", "diverged", "cut", "lost")}
    for outcome in run.outcomes:
        counts[outcome.kind] += 1

    def hit(outcome: Outcome) -> bool:
        return any(
            outcome.started < at < outcome.ended and url.endswith(outcome.engine or "?")
            for at, _, url in run.kills
        )

    whole = [o for o in run.outcomes if o.kind == "ok"]
    calm = [
        o.duration for o in whole if not any(o.started < at < o.ended for at, _, _ in run.kills)
    ]
    base = statistics.median(calm) if calm else 0.0
    resumed = [o.duration - base for o in whole if o.engine and hit(o)]
    failures: dict[str, int] = {}
    for outcome in run.outcomes:
        if outcome.kind in ("cut", "lost"):
            key = outcome.detail.split(":")[0][:60]
            failures[key] = failures.get(key, 0) + 1
    return {
        "router": run.router,
        "requests": len(run.outcomes),
        **counts,
        "kills": len(run.kills),
        "stream_p50_s": round(percentile([o.duration for o in whole], 50), 3),
        "calm_p50_s": round(base, 3),
        "resumed": len(resumed),
        "resumed_added_p50_s": round(percentile(resumed, 50), 3) if resumed else None,
        "resumed_added_p99_s": round(percentile(resumed, 99), 3) if resumed else None,
        "failures": failures,
        "router_counted": run.counted,
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| router | requests | ok | lost | cut | diverged | kills | stream p50 s | resumed |"
    head += " added p50 / p99 s |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        added = f"{r['resumed_added_p50_s']} / {r['resumed_added_p99_s']}" if r["resumed"] else "-"
        lines.append(
            f"| {r['router']} | {r['requests']} | {r['ok']} | {r['lost']} | {r['cut']} | "
            f"{r['diverged']} | {r['kills']} | {r['stream_p50_s']} | {r['resumed']} | {added} |"
        )
    return "\n".join(lines)


# -- the runs ------------------------------------------------------------------------------------
async def expected_text(url: str, body: dict[str, Any]) -> str:
    """The answer of the request run straight at one engine, without a failure."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        outcome = await one_stream(client, url, body)
    if outcome.kind != "ok":
        raise RuntimeError(f"the reference request at {url} failed: {outcome.detail}")
    return outcome.detail


async def run_router(
    name: str, slots: Sequence[Slot], args: argparse.Namespace, workdir: Path
) -> Run:
    body, run = request_body(args), Run(name)
    for slot in slots:
        await slot.up.wait()
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams)
    async with (
        open_router(name, [s.url for s in slots], workdir, args.model) as router,
        httpx.AsyncClient(timeout=args.limit, limits=limits) as client,
    ):
        url = router.url
        print(f"{name}: {args.streams} streams for {args.duration} s", file=sys.stderr)
        t0 = trio.current_time()
        with trio.fail_after(args.duration + args.limit + 60 * len(slots)):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(chaos, slots, args, run, t0)
                for _ in range(args.streams):
                    nursery.start_soon(load, client, url, body, run, t0 + args.duration)
        if name == "trio":  # what the router itself counted
            run.counted = await resume_counts(client, url)
    for slot in slots:  # every engine back before the next router
        await slot.up.wait()
    return run


@asynccontextmanager
async def open_slots(args: argparse.Namespace) -> AsyncIterator[list[Slot]]:
    hosts = [f"127.0.1.{FIRST_HOST + i}" for i in range(args.engines)]
    if args.mode == "fakes":
        port = vllm_engines.free_port(hosts)
        async with trio.open_nursery() as nursery:
            slots = [FakeSlot(f"http://{host}:{port}", args) for host in hosts]
            for fake in slots:
                await nursery.start(fake.run)
            yield list(slots)
            nursery.cancel_scope.cancel()
        return
    env = await trio.to_thread.run_sync(vllm_engines.ensure_environment)
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-vllm-"))
    port = vllm_engines.free_port(hosts)
    specs = vllm_engines.specs_for(args.engines, port=port, first_host=FIRST_HOST)
    engines = await trio.to_thread.run_sync(
        lambda: vllm_engines.start_engines(env, specs, log_dir=log_dir)
    )
    real = [RealSlot(engine, env, log_dir) for engine in engines]
    try:
        yield list(real)
    finally:
        for slot in real:
            slot.engine.stop()


async def main_load(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        workdir = args.log_dir or Path(tmp)
        async with open_slots(args) as slots:
            expected = await expected_text(slots[0].url, request_body(args))
            for name in args.routers:
                if (why := ROUTERS[name].available()) is not None:
                    print(f"{name}: skipped ({why})", file=sys.stderr)
                    continue
                run = await run_router(name, slots, args, workdir)
                rows.append(summary(run, expected))
                print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


# -- exactness -----------------------------------------------------------------------------------
async def main_exactness(args: argparse.Namespace) -> dict[str, Any]:
    """See the module's docstring: greedy streams, each one's engine stopped mid-answer,
    until `--kills` of them were carried on (a trial whose engine had sent its whole answer
    before it was stopped had nothing to fail: run again, at most 3 x `--kills` trials); how
    many came out token for token as the uninterrupted answer."""
    body = request_body(args) | {"return_token_ids": True}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        async with open_slots(args) as slots, trio.open_nursery() as nursery:
            reference = await token_ids(slots[0].url, body)
            urls = [s.url for s in slots]
            async with (
                open_router("trio", urls, args.log_dir or Path(tmp), args.model) as router,
                httpx.AsyncClient(timeout=30.0) as client,
            ):
                url = router.url
                for index in range(3 * args.kills):
                    if sum(bool(r["carried_on"]) for r in results) >= args.kills:
                        break
                    how = (signal.SIGKILL, signal.SIGTERM)[index % 2]
                    await routable(client, url, slots)  # one to stop, one to go on
                    before = await resume_counts(client, url)
                    result = await one_kill(url, slots, body, args.kill_after, how)
                    after = await resume_counts(client, url)
                    result["carried_on"] = {k: v - before.get(k, 0) for k, v in after.items()}
                    result["carried_on"] = {k: v for k, v in result["carried_on"].items() if v}
                    slot = result.pop("slot")
                    if slot is not None:
                        nursery.start_soon(slot.restart)
                    result["exact"] = result["tokens"] == reference
                    result["first_difference"] = first_difference(result.pop("tokens"), reference)
                    results.append(result)
                    print(json.dumps(results[-1]), file=sys.stderr)
            nursery.cancel_scope.cancel()  # restarts still running
    carried = [r for r in results if r["carried_on"]]
    return {
        "trials": len(results),
        "kills": len(carried),
        "exact": sum(r["exact"] for r in carried),
        "tokens": len(reference),
        "results": results,
    }


async def routable(client: httpx.AsyncClient, url: str, slots: Sequence[Slot]) -> None:
    """Until at least two engines serve and trio_router at `url` shows exactly those healthy
    (not one that was stopped and not yet found out): the state of other processes, asked
    every 0.5 s."""
    while True:
        up = {slot.url for slot in slots if slot.up.is_set()}
        if len(up) >= 2:
            shown = (await client.get(f"{url}/engines")).json()["engines"]
            if {e["url"] for e in shown if e["healthy"]} == up:
                return
        await trio.sleep(0.5)


async def resume_counts(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """trio_router's `trio_router_stream_resumes_total`, by its labels' text."""
    text = (await client.get(f"{url}/metrics")).text
    return {
        line.split("{", 1)[1].rsplit("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("trio_router_stream_resumes_total{")
    }


async def token_ids(url: str, body: dict[str, Any]) -> list[int]:
    async with (
        httpx.AsyncClient(timeout=300.0) as client,
        client.stream("POST", f"{url}{CHAT}", json=body) as answer,
    ):
        tokens: list[int] = []
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
        return tokens


async def one_kill(
    url: str, slots: Sequence[Slot], body: dict[str, Any], kill_after: int, how: signal.Signals
) -> dict[str, Any]:
    tokens: list[int] = []
    killed_at, victim, done = None, None, 0
    with trio.fail_after(600):
        async with (
            httpx.AsyncClient(timeout=300.0) as client,
            client.stream("POST", f"{url}{CHAT}", json=body) as answer,
        ):
            serving = answer.headers.get("x-trio-router-engine", "")
            async for line in answer.aiter_lines():
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or []:
                        tokens += choice.get("token_ids") or []
                if killed_at is None and len(tokens) >= kill_after:
                    victim = next(s for s in slots if s.url.endswith(serving))
                    killed_at = len(tokens)
                    await victim.kill(how)
    return {
        "signal": how.name,
        "killed_at": killed_at,
        "done": done,
        "received": len(tokens),
        "tokens": tokens,
        "slot": victim,
    }


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return index
    return None if len(got) == len(want) else min(len(got), len(want))


# -- the command ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["fakes", "real", "exactness", "engine"])
    parser.add_argument("--routers", default="trio,production-stack,vllm-router-rs")
    parser.add_argument("--streams", type=int, default=None)
    parser.add_argument("--engines", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=40.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--down-s", type=float, default=2.0)
    parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--limit", type=float, default=120.0, help="bounds one request (s)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=50)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--log-dir", type=Path, help="keep each router's log (NAME.log) here")
    args = parser.parse_args(argv)
    defaults = {"fakes": (64, 4, 64), "real": (16, 4, 96), "exactness": (1, 3, 200)}
    streams, engines, tokens = defaults.get(args.mode, (1, 1, 64))
    args.streams = args.streams or streams
    args.engines = args.engines or engines
    args.tokens = args.tokens or tokens
    args.model = FAKE_MODEL if args.mode == "fakes" else MODEL_NAME
    args.routers = [r for r in args.routers.split(",") if r]
    if unknown := [r for r in args.routers if r not in ROUTERS]:
        parser.error(f"--routers: unknown {unknown} (known: {', '.join(ROUTERS)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "engine":
        trio.run(serve_one_fake, args)
        return 0
    started = time.monotonic()
    if args.mode == "exactness":
        report: Any = trio.run(main_exactness, args)
        print(json.dumps({k: v for k, v in report.items() if k != "results"}))
        print(f"{report['exact']} of {report['kills']} carried on exact", file=sys.stderr)
    else:
        report = trio.run(main_load, args)
        print(table(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
