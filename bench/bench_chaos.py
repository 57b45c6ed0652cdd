"""Engines killed under load: what a client of each router loses, and what trio_router's stream
continuation (`proxy.resume`) costs a resumed stream.

    python bench/bench_chaos.py fakes [--routers trio,production-stack,vllm-router-rs]
                                      [--streams 64] [--engines 4] [--duration 60]
                                      [--mix plain,reasoning,tools] [--reasoning-tokens 24]
    python bench/bench_chaos.py real  [--streams 16] [--engines 4] [--tokens 96]
    python bench/bench_chaos.py emulated [--engines 16] [--streams 64] [--tokens 64]
                                         [--profile h100] [--time-scale 1]
    python bench/bench_chaos.py exactness [--kills 20] [--tokens 200] [--kill-after 50]

`fakes`: `--engines` fake vLLM engines (`trio_router.testing.FakeEngine` served by Hypercorn,
each its own process on 127.0.1.51, .52, ...) that stream `--tokens` tokens, the first after
`--ttft-ms`, then one every `--itl-ms`; greedy like vLLM (a prompt ending with an engine's own
tokens goes on from there), so a continued answer can be checked word for word. `real`: real
vLLM engines (the CPU build and tiny model of `trio_router.testing.vllm_engines`, the first run
installs it), a greedy chat (`temperature` 0, `ignore_eos`) of `--tokens` tokens. `emulated`:
one `trio-router emulate` fleet of `--engines` engines on `--profile` at `--time-scale`
(127.0.1.51, .52, ... on one port), the same greedy chat; an engine is killed (KILL) or
terminated (TERM: what vLLM does on SIGTERM, its requests aborted) and recovered through the
fleet's control API.

`--mix` (fakes; default `plain`): the kinds of chat each client sends in turn (each client
begins with another): `plain` (the chat above), `reasoning` (answered with
`--reasoning-tokens` reasoning tokens, the end of the reasoning, then `--tokens` of content),
`tools` (offering two tools, auto tool choice: answered with the reasoning, then two tool
calls whose arguments span many tokens, finish "tool_calls"). Those two go to engines with a
reasoning and a tool parser serving vLLM's scale-out endpoints (render, generate, derender:
what trio_router carries such a stream on with), of another model; with plain chats in the
mix, every other engine is one (a fake reasoning parser answers every chat with reasoning).
A fake chat's `max_tokens` is `SLACK` above its answer, so the answer ends by itself. The
peers run plain chats only.

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

Each request is one of: `ok` (200, one `[DONE]`, the whole answer: what the client puts
together — reasoning, content, each tool call's name and arguments and its one id, the finish —
is that of the same request answered without a failure), `diverged` (well-formed and complete,
another answer: engine numerics of a continuation), `cut` (200, then broken off: no `[DONE]`,
an error event, the connection closed or an answer that stops short of the whole one), `lost`
(no 200: an error status or no answer); counted for all requests and by kind. A stream
"hit" is one running on an engine when it was killed (trio_router names the engine in
`x-trio-router-engine`); the latency a resumed stream pays is its duration less the median of
the streams of its kind no kill touched (p50, p99). For trio_router the report also has the
router's own count of resumes (`trio_router_stream_resumes_total`), by its `kind` label
(content, reasoning, tool_call, whole).

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
import itertools
import json
import os
import re
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
THINKER_MODEL: Final = "fake-thinker"  # fake engines with a reasoning and a tool parser
KINDS: Final = ("plain", "reasoning", "tools")  # the requests of --mix
OUTCOMES: Final = ("ok", "diverged", "cut", "lost")
# The tool calls a thinker engine answers a chat offering tools with: arguments of many tokens
# (the fake's tool parser gives a call's arguments six characters a token).
CALLS: Final = (
    (
        "search_flights",
        '{"from": "Paris CDG", "to": "Tokyo Haneda", "date": "2027-03-14", '
        '"passengers": 2, "cabin": "economy"}',
    ),
    (
        "book_hotel",
        '{"city": "Tokyo", "nights": 5, "near": "Shinjuku station", '
        '"max_price_eur": 180, "breakfast": true}',
    ),
)
TOOLS: Final = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name, _ in CALLS
]
# A fake chat's max_tokens is this much above its answer, so the answer ends by itself
# ("stop", "tool_calls") and a stream whose engine died after its last token is carried on
# to that end rather than ended by the router for its token limit ("length").
SLACK: Final = 16


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
    if args.thinker:  # vLLM with --reasoning-parser, --enable-auto-tool-choice, scale-out
        engine.models = [THINKER_MODEL]
        engine.reasoning_tokens, engine.tool_calls = args.reasoning_tokens, list(CALLS)
        engine.scale_out = True
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_fake_engine, engine, args.host, args.port)
        print("ready", flush=True)


class Slot:
    """One engine's place (host:port) and whatever process serves it now."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.up = trio.Event()  # set while an engine serves here

    async def kill(self, how: signal.Signals) -> None:
        """`how` to the engine; returns once it has exited."""
        raise NotImplementedError

    async def restart(self) -> None:
        """An engine started here again; returns once it serves."""
        raise NotImplementedError


class FakeSlot(Slot):
    def __init__(self, url: str, args: argparse.Namespace, *, thinker: bool) -> None:
        super().__init__(url, THINKER_MODEL if thinker else FAKE_MODEL)
        host, port = url.removeprefix("http://").split(":")
        self._command = [sys.executable, __file__, "engine", "--host", host, "--port", port]
        self._command += ["--tokens", str(args.tokens), "--ttft-ms", str(args.ttft_ms)]
        self._command += ["--itl-ms", str(args.itl_ms)]
        if thinker:
            self._command += ["--thinker", "--reasoning-tokens", str(args.reasoning_tokens)]
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
        super().__init__(engine.url, MODEL_NAME)
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


class EmulatedSlot(Slot):
    """An engine of one `trio-router emulate` fleet, stopped and served again through the
    fleet's control API: KILL is its `kill`, TERM its `terminate`, restart its `recover`."""

    def __init__(self, url: str, model: str, index: int, control: httpx.AsyncClient) -> None:
        super().__init__(url, model)
        self.index, self._control = index, control
        self.up.set()

    async def _fault(self, fault: str) -> None:
        body = {"engine": self.index, "fault": fault}
        (await self._control.post("/emulator/fault", json=body)).raise_for_status()

    async def kill(self, how: signal.Signals) -> None:
        self.up = trio.Event()
        await self._fault("kill" if how == signal.SIGKILL else "terminate")

    async def restart(self) -> None:
        await self._fault("recover")
        self.up.set()


@asynccontextmanager
async def emulated_slots(args: argparse.Namespace) -> AsyncIterator[list[Slot]]:
    """`--engines` engines of one emulated fleet (`trio-router emulate`, a process of its
    own), with its control API."""
    command = [sys.executable, "-m", "trio_router", "emulate", "--engines", str(args.engines)]
    command += ["--host", f"127.0.1.{FIRST_HOST}", "--port", "0", "--control-port", "0"]
    command += ["--profile", args.profile, "--time-scale", str(args.time_scale)]
    async with open_command(command) as (process, stdout, stderr):
        with trio.fail_after(START_S):
            control = (await stderr.wait_for(r"fault control at (http://\S+)/emulator/fault"))[1]
            await stdout.wait_for(rf"(?:http://\S+\n){{{args.engines}}}")
        urls = stdout.text.split()
        models = await emulated_models(urls[0])
        args.model = models[0]
        async with httpx.AsyncClient(base_url=control, timeout=30.0) as client:
            yield [EmulatedSlot(url, args.model, i, client) for i, url in enumerate(urls)]
        process.send_signal(signal.SIGINT)


async def emulated_models(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        reply = await client.get(f"{url}/v1/models")
        reply.raise_for_status()
        return [card["id"] for card in reply.json()["data"]]


# -- the client ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Answer:
    """What a client puts together from a chat stream: the reasoning, the content, each tool
    call's name, arguments and how many ids it was given, and the finish."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[tuple[str, str, int], ...] = ()
    finish: str | None = None

    def short_of(self, whole: Answer) -> bool:
        """Another answer that is `whole` broken off: its texts, in order (reasoning, content,
        each call's name and arguments), the same up to one that `whole`'s begins with, and
        nothing after that one."""
        got = [self.reasoning, self.content, *(t for c in self.calls for t in c[:2])]
        want = [whole.reasoning, whole.content, *(t for c in whole.calls for t in c[:2])]
        if self == whole or len(got) > len(want):
            return False
        got += [""] * (len(want) - len(got))
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        return at is not None and want[at].startswith(got[at]) and not any(got[at + 1 :])


class Reassembly:
    """A chat stream's choices, put together as a client does (see `Answer`)."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, list[Any]] = {}  # index -> [name, arguments, ids]
        self.finish: str | None = None

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        self.reasoning.append(delta.get("reasoning") or "")
        self.content.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or ():
            made = self.calls.setdefault(call.get("index", 0), ["", "", 0])
            function = call.get("function") or {}
            made[0] += function.get("name") or ""
            made[1] += function.get("arguments") or ""
            made[2] += bool(call.get("id"))
        self.finish = choice.get("finish_reason") or self.finish

    def answer(self) -> Answer:
        calls = tuple((str(c[0]), str(c[1]), int(c[2])) for _, c in sorted(self.calls.items()))
        return Answer("".join(self.reasoning), "".join(self.content), calls, self.finish)


@dataclass
class Outcome:
    kind: str  # ok | diverged | cut | lost
    started: float
    ended: float
    engine: str = ""  # as the router named it (trio_router)
    detail: str = ""  # why it was not ok
    answer: Answer | None = None  # when it ended well-formed
    asked: str = "plain"  # the request's kind (KINDS)
    rid: str = ""  # its x-request-id

    @property
    def duration(self) -> float:
        return self.ended - self.started


def request_body(args: argparse.Namespace, kind: str = "plain") -> dict[str, Any]:
    """A streamed chat of `kind` (KINDS): plain, of `args.model`; at the fakes, a reasoning
    chat, or one offering TOOLS (auto tool choice), of the thinker engines' model."""
    body: dict[str, Any] = {"model": args.model, "stream": True, "max_tokens": args.tokens}
    body["messages"] = [{"role": "user", "content": "tell a long story"}]
    if args.mode != "fakes":
        return body | {"temperature": 0, "ignore_eos": True}
    body["max_tokens"] = args.tokens + SLACK
    if kind != "plain":
        body["model"] = THINKER_MODEL
        calls = sum(3 + (len(arguments) + 5) // 6 for _, arguments in CALLS)
        body["max_tokens"] = args.reasoning_tokens + 1 + max(args.tokens, calls) + SLACK
    if kind == "reasoning":
        body["messages"] = [{"role": "user", "content": "think, then tell a long story"}]
    if kind == "tools":
        body["messages"] = [{"role": "user", "content": "book a week in Tokyo"}]
        body |= {"tools": TOOLS, "tool_choice": "auto"}
    return body


async def one_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], asked: str = "plain", rid: str = ""
) -> Outcome:
    """One streamed chat of kind `asked` (its `x-request-id` `rid` when given, which
    trio_router's log lines name): its outcome, with what the client put together when it
    ended well-formed."""
    started = trio.current_time()
    engine, done, parts = "", 0, Reassembly()
    headers = {"x-request-id": rid} if rid else {}

    def ended(kind: str, detail: str) -> Outcome:
        return Outcome(kind, started, trio.current_time(), engine, detail, None, asked, rid)

    try:
        async with client.stream("POST", f"{url}{CHAT}", json=body, headers=headers) as answer:
            engine = answer.headers.get("x-trio-router-engine", "")
            if answer.status_code != 200:
                await answer.aread()
                return ended("lost", f"{answer.status_code} {answer.text[:120]}")
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return ended("cut", f"error event: {str(event['error'])[:120]}")
                for choice in event.get("choices") or []:
                    parts.add(choice)
    except (httpx.HTTPError, ValueError) as exc:
        kind = "cut" if parts.content or engine else "lost"
        return ended(kind, f"{type(exc).__name__}: {exc}")
    if done != 1:
        return ended("cut", f"{done} [DONE]")
    outcome = ended("ok", "")
    outcome.answer = parts.answer()
    return outcome


@dataclass
class Run:
    router: str
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[tuple[float, float, str]] = field(default_factory=list)  # (at, back, url)
    counted: dict[str, float] = field(default_factory=dict)  # trio_router's resume counter


async def load(
    client: httpx.AsyncClient,
    url: str,
    asks: Sequence[tuple[str, dict[str, Any]]],
    run: Run,
    until: float,
    name: str,
) -> None:
    """Client `name`: one request after another (x-request-id `name-N`), of each (kind,
    body) of `asks` in turn."""
    for n, (asked, body) in enumerate(itertools.cycle(asks)):
        if trio.current_time() >= until:
            return
        outcome = await one_stream(client, url, body, asked, f"{name}-{n}")
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


def judged(outcome: Outcome, expected: Answer) -> None:
    """An `ok` outcome whose answer is not `expected` becomes `cut` (the answer broken off
    but ended as if whole) or `diverged` (another answer), with what differs in `detail`."""
    got = outcome.answer
    if outcome.kind != "ok" or got is None or got == expected:
        return
    outcome.kind = "cut" if got.short_of(expected) else "diverged"
    fields = ("reasoning", "content", "calls", "finish")
    differs = [f for f in fields if getattr(got, f) != getattr(expected, f)]
    outcome.detail = f"the answer of a {outcome.asked} chat differs in {', '.join(differs)}"


def hit(outcome: Outcome, kills: Sequence[tuple[float, float, str]]) -> bool:
    """The outcome's stream ran on an engine when it was killed (trio_router names it)."""
    return any(
        outcome.started < at < outcome.ended and url.endswith(outcome.engine or "?")
        for at, _, url in kills
    )


def figures(
    outcomes: Sequence[Outcome], kills: Sequence[tuple[float, float, str]]
) -> dict[str, Any]:
    """Counts by outcome; of the whole streams, the p50 duration and those a kill hit, with
    what that added to them: the duration less the median of the streams of their kind that
    no kill touched."""
    whole = [o for o in outcomes if o.kind == "ok"]
    calm: dict[str, list[float]] = {}
    for o in whole:
        if not any(o.started < at < o.ended for at, _, _ in kills):
            calm.setdefault(o.asked, []).append(o.duration)
    bases = {kind: statistics.median(durations) for kind, durations in calm.items()}
    resumed = [o.duration - bases.get(o.asked, 0.0) for o in whole if o.engine and hit(o, kills)]
    return {
        "requests": len(outcomes),
        **{kind: sum(o.kind == kind for o in outcomes) for kind in OUTCOMES},
        "stream_p50_s": round(percentile([o.duration for o in whole], 50), 3),
        "calm_p50_s": {kind: round(base, 3) for kind, base in bases.items()},
        "resumed": len(resumed),
        "resumed_added_p50_s": round(percentile(resumed, 50), 3) if resumed else None,
        "resumed_added_p99_s": round(percentile(resumed, 99), 3) if resumed else None,
    }


def summary(run: Run, expected: dict[str, Answer]) -> dict[str, Any]:
    for outcome in run.outcomes:
        judged(outcome, expected[outcome.asked])
    failures: dict[str, list[str]] = {}  # why -> the requests' kinds and ids
    for outcome in run.outcomes:
        if outcome.kind in ("cut", "lost", "diverged"):
            key = f"{outcome.kind}: {outcome.detail.split(':')[0][:80]}"
            failures.setdefault(key, []).append(f"{outcome.asked} {outcome.rid}")
    asked = [kind for kind in KINDS if kind in expected]
    return {
        "router": run.router,
        **figures(run.outcomes, run.kills),
        "kills": len(run.kills),
        "by_kind": {
            k: figures([o for o in run.outcomes if o.asked == k], run.kills) for k in asked
        },
        "failures": failures,
        "router_counted": run.counted,
        "router_resumes": resumes_by_kind(run.counted),
    }


def resumes_by_kind(counted: dict[str, float]) -> dict[str, dict[str, int]]:
    """trio_router's resume counter (its labels' text -> value) by its `kind`, then
    `outcome` label."""
    out: dict[str, dict[str, int]] = {}
    for labels, value in counted.items():
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        by_outcome = out.setdefault(named.get("kind", "?"), {})
        outcome = named.get("outcome", "?")
        by_outcome[outcome] = by_outcome.get(outcome, 0) + int(value)
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Per router, a row per kind of request (when more than one) and one for all; below,
    trio_router's own count of resumes by kind."""
    head = "| router | requests | ok | lost | cut | diverged | kills | stream p50 s | resumed |"
    head += " added p50 / p99 s |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    counted = []
    for r in rows:
        parts = [(f"{r['router']} {k}", f) for k, f in r["by_kind"].items()]
        parts = [*parts, (r["router"], r)] if len(parts) > 1 else [(r["router"], r)]
        for name, f in parts:
            added = (
                f"{f['resumed_added_p50_s']} / {f['resumed_added_p99_s']}" if f["resumed"] else "-"
            )
            kills = r["kills"] if f is r else ""
            lines.append(
                f"| {name} | {f['requests']} | {f['ok']} | {f['lost']} | {f['cut']} | "
                f"{f['diverged']} | {kills} | {f['stream_p50_s']} | {f['resumed']} | {added} |"
            )
        if r["router_resumes"]:
            kinds = ", ".join(
                f"{kind} {' '.join(f'{o} {n}' for o, n in sorted(by.items()))}"
                for kind, by in sorted(r["router_resumes"].items())
            )
            counted.append(f"{r['router']} counted resumes by kind: {kinds}")
    return "\n".join([*lines, "", *counted] if counted else lines)


# -- the runs ------------------------------------------------------------------------------------
async def expected_answers(slots: Sequence[Slot], args: argparse.Namespace) -> dict[str, Answer]:
    """Each kind of request of `--mix` run straight at an engine of its model, without a
    failure: what its client put together."""
    out = {}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for kind in args.mix:
            body = request_body(args, kind)
            slot = next(s for s in slots if s.model == body["model"])
            outcome = await one_stream(client, slot.url, body, kind)
            if outcome.answer is None:
                raise RuntimeError(f"the reference request at {slot.url} failed: {outcome.detail}")
            out[kind] = outcome.answer
    return out


async def run_router(
    name: str, slots: Sequence[Slot], args: argparse.Namespace, workdir: Path
) -> Run:
    asks, run = [(kind, request_body(args, kind)) for kind in args.mix], Run(name)
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
                for index in range(args.streams):  # each client begins with another kind
                    turn = index % len(asks)
                    mine = [*asks[turn:], *asks[:turn]]
                    until, who = t0 + args.duration, f"chaos-{index}"
                    nursery.start_soon(load, client, url, mine, run, until, who)
        if name == "trio":  # what the router itself counted
            metrics = (await client.get(f"{url}/metrics")).text
            (workdir / f"{name}-metrics.txt").write_text(metrics)
            run.counted = resume_counts_of(metrics)
    for slot in slots:  # every engine back before the next router
        await slot.up.wait()
    return run


def thinkers(args: argparse.Namespace) -> list[bool]:
    """Which fake engines have the parsers (and serve the thinker model): all of them when
    the mix asks only reasoning or tool calls, none for plain chats only, else every other
    one (a fake engine's reasoning parser answers every chat with reasoning, so plain chats
    are served by engines without one, as a model without reasoning would be)."""
    parsed = any(kind != "plain" for kind in args.mix)
    if "plain" not in args.mix or not parsed:
        return [parsed] * args.engines
    return [index % 2 == 1 for index in range(args.engines)]


@asynccontextmanager
async def open_slots(args: argparse.Namespace) -> AsyncIterator[list[Slot]]:
    hosts = [f"127.0.1.{FIRST_HOST + i}" for i in range(args.engines)]
    if args.mode == "emulated":
        async with emulated_slots(args) as emulated:
            yield emulated
        return
    if args.mode == "fakes":
        port = vllm_engines.free_port(hosts)
        async with trio.open_nursery() as nursery:
            slots = [
                FakeSlot(f"http://{host}:{port}", args, thinker=thinker)
                for host, thinker in zip(hosts, thinkers(args), strict=True)
            ]
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
            expected = await expected_answers(slots, args)
            for kind, answer in expected.items():
                calls = ", ".join(
                    f"{name} ({len(arguments)} chars)" for name, arguments, _ in answer.calls
                )
                print(
                    f"{kind}: {len(answer.reasoning)} chars of reasoning, "
                    f"{len(answer.content)} of content, calls: {calls or '-'}, "
                    f"finish {answer.finish}",
                    file=sys.stderr,
                )
            for name in args.routers:
                if (why := ROUTERS[name].available()) is not None:
                    print(f"{name}: skipped ({why})", file=sys.stderr)
                    continue
                if name != "trio" and args.mix != ["plain"]:
                    print(f"{name}: skipped (the peers run plain chats only)", file=sys.stderr)
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
    return resume_counts_of((await client.get(f"{url}/metrics")).text)


def resume_counts_of(text: str) -> dict[str, float]:
    """`trio_router_stream_resumes_total` in trio_router's /metrics `text`, by its labels'
    text."""
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
    parser.add_argument("mode", choices=["fakes", "real", "emulated", "exactness", "engine"])
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
    parser.add_argument("--mix", default="plain", help=f"kinds of chat, of {','.join(KINDS)}")
    parser.add_argument("--reasoning-tokens", type=int, default=24)
    parser.add_argument("--thinker", action="store_true", help=argparse.SUPPRESS)  # `engine`
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--profile", default="h100", help="the emulated engines' (emulated)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the emulated fleet's")
    parser.add_argument("--log-dir", type=Path, help="keep each router's log (NAME.log) here")
    args = parser.parse_args(argv)
    defaults = {"fakes": (64, 4, 64), "real": (16, 4, 96), "emulated": (64, 16, 64),
                "exactness": (1, 3, 200)}  # fmt: skip
    streams, engines, tokens = defaults.get(args.mode, (1, 1, 64))
    args.streams = args.streams or streams
    args.engines = args.engines or engines
    args.tokens = args.tokens or tokens
    args.mix = [kind for kind in args.mix.split(",") if kind]
    if not args.mix or (unknown := [k for k in args.mix if k not in KINDS]):
        parser.error(f"--mix: unknown {args.mix} (known: {', '.join(KINDS)})")
    if args.mix != ["plain"] and args.mode != "fakes":
        parser.error("--mix: reasoning and tool calls at the fake engines only (fakes)")
    if "plain" in args.mix and len(args.mix) > 1 and args.engines < 4:
        parser.error("--mix: plain and parsed chats need --engines 4 or more (two of each)")
    parsed_only = args.mode == "fakes" and "plain" not in args.mix
    args.model = (
        MODEL_NAME if args.mode != "fakes" else THINKER_MODEL if parsed_only else FAKE_MODEL
    )
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
