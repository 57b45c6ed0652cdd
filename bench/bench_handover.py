"""Handover: from an engine's death to the client's next event, measured on the real
`trio-router` process in front of two real thinking engines.

    python bench/bench_handover.py [--trials 3] [--modes kill,term,stop] [--kill-after 20]
        [--reasoning 600] [--log-dir DIR] [--json-out FILE]

The engines are `trio_router.testing.vllm_engines`' thinking engines (vLLM's CPU build, the
thinking model served as `tiny-thinker` with the `deepseek_r1` reasoning parser, the `hermes`
tool parser, the scale-out routes and the launcher's ScriptedTokens; the first run installs
the environment), on 127.0.1.61 and 127.0.1.62, one port, vLLM's default
`--shutdown-timeout 0`. The router is its own process (TRIO_ROUTER_CMD, else
.venv/bin/trio-router, else `python -m trio_router`), static discovery of the two engines,
every other setting its default (`proxy.resume = "on"`, `proxy.stall_timeout_s`, probes).

One greedy reasoning stream at a time (`stream_options.include_usage`, `return_token_ids`):
`--reasoning` tokens of reasoning, then a script ends it (`</think>`), a sentence of content
and the end of the answer. Once the client has `--kill-after` tokens, the engine serving it
(the router names it in `x-trio-router-engine`) gets, by mode in turn:

- `kill`: SIGKILL to its process group (a crash);
- `term`: SIGTERM to its API server alone (Kubernetes signals a deleted pod's main process);
- `stop`: SIGSTOP to its process group (an engine that falls silent, its connections open:
  nothing but the silence tells the router).

The stream goes on to its end; the engine is then started again (`kill`, `term`) or let go on
(`stop`: SIGCONT), and the next trial waits until the router shows both engines healthy. On 2
cores an engine's API server can hold a whole answer back and write it at once: a trial whose
answer had reached the client whole before the signal (nothing carried on) is `spoiled` and
run again, up to 3 x `--trials` trials per mode.

Reported per mode, over the trials not spoiled: how many streams came out equal to the
uninterrupted answer (the same request sent straight to an engine: reasoning, content, token
ids, finish, usage counts, one `[DONE]`); the stream's own time to its first token; the time
from the signal to the client's next event (the dying engine's events still in flight); the
time from the signal to the continuation's first event (min / median / max), taken as the
event that ends the longest silence after the signal, with the longest gap between two events
before the signal beside it; and the reasons the router counted its resumes with
(`trio_router_stream_resumes_total`). The router's log and the engines' are kept in
`--log-dir` (default: a temporary folder, named on stderr).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from bench_scale import free_port, router_command
from trio_router.testing import vllm_engines
from trio_router.testing.processes import open_command, router_url
from trio_router.testing.vllm_engines import (
    THINKING_MODEL_NAME,
    EngineEnvironment,
    EngineProcess,
    EngineSpec,
)

HOSTS: Final = ("127.0.1.61", "127.0.1.62")
CHAT: Final = "/v1/chat/completions"
END_THINK: Final = 4097  # the thinking model's `</think>`
EOS: Final = 2  # `<|im_end|>`
MESSAGES: Final = [
    {"role": "system", "content": "you are a test"},
    {"role": "user", "content": "say a few words"},
]
SENTENCE: Final = " the water is good"
SIGNALS: Final = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
LIMIT_S: Final = 300.0  # bounds one trial (a silent engine waits for the stall bound)
POLL_S: Final = 0.5  # how often the router's /engines is asked while an engine comes back


# -- engines and the router ----------------------------------------------------------------------
@dataclass
class Engines:
    env: EngineEnvironment
    log_dir: Path
    running: list[EngineProcess]

    async def restart(self, dead: EngineProcess) -> None:
        """`dead` (stopped, whatever is left of it) started again in its place."""
        dead.stop()
        (again,) = await trio.to_thread.run_sync(
            lambda: vllm_engines.start_engines(self.env, [dead.spec], log_dir=self.log_dir)
        )
        self.running[self.running.index(dead)] = again


@asynccontextmanager
async def open_engines(log_dir: Path) -> AsyncIterator[Engines]:
    env = await trio.to_thread.run_sync(vllm_engines.ensure_environment)
    port = vllm_engines.free_port(HOSTS)
    specs = [
        EngineSpec(host=host, port=port, core=i, max_num_seqs=4, thinking=True, scale_out=True)
        for i, host in enumerate(HOSTS)
    ]
    running = await trio.to_thread.run_sync(
        lambda: vllm_engines.start_engines(env, specs, log_dir=log_dir)
    )
    engines = Engines(env, log_dir, running)
    try:
        yield engines
    finally:
        for engine in engines.running:
            engine.stop()


@asynccontextmanager
async def open_router(urls: Sequence[str], workdir: Path) -> AsyncIterator[str]:
    """The router process in front of `urls` (its log kept as workdir/router.log); yields its
    URL once both engines are routable."""
    listed = ", ".join(f'"{url}"' for url in urls)
    config = workdir / "router.toml"
    config.write_text(
        f'[server]\nbind = "127.0.0.1:{free_port()}"\ndrain_s = 1.0\n'
        f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
    )
    async with open_command([*router_command(), "--config", str(config)]) as (_, _, stderr):
        try:
            with trio.fail_after(60):
                url = await router_url(stderr, engines=len(urls))
            yield url
        finally:
            (workdir / "router.log").write_text(stderr.text)


async def wait_healthy(client: httpx.AsyncClient, url: str, engines: Engines) -> None:
    """Until the router shows every engine healthy (another process's state: asked every
    POLL_S)."""
    wanted = {engine.url for engine in engines.running}
    with trio.fail_after(LIMIT_S):
        while True:
            shown = (await client.get(f"{url}/engines")).json()["engines"]
            if {e["url"] for e in shown if e["healthy"]} == wanted:
                return
            await trio.sleep(POLL_S)


async def resume_counts(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """trio_router_stream_resumes_total by its labels' text."""
    text = (await client.get(f"{url}/metrics")).text
    return {
        line.split("{", 1)[1].rsplit("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("trio_router_stream_resumes_total{")
    }


# -- one stream ----------------------------------------------------------------------------------
@dataclass
class Answer:
    """What a client puts together from a reasoning stream."""

    reasoning: str = ""
    content: str = ""
    ids: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    usage: list[tuple[int, int, int]] = field(default_factory=list)  # prompt, completion, total
    done: int = 0
    errors: list[Any] = field(default_factory=list)

    def add(self, data: str) -> None:
        if data == "[DONE]":
            self.done += 1
            return
        event = json.loads(data)
        if "error" in event:
            self.errors.append(event["error"])
            return
        if usage := event.get("usage"):
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")
            self.usage.append(tuple(usage[k] for k in counts))
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            self.reasoning += delta.get("reasoning") or ""
            self.content += delta.get("content") or ""
            self.ids += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                self.finish.append(choice["finish_reason"])


def request(args: argparse.Namespace, prompt_tokens: int, sentence: list[int]) -> dict[str, Any]:
    return {
        "model": THINKING_MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": args.reasoning + 40,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        "vllm_xargs": {
            "script_at": prompt_tokens + args.reasoning,
            "script": [END_THINK, *sentence, EOS],
        },
    }


async def prepared_request(
    client: httpx.AsyncClient, engine: EngineProcess, args: argparse.Namespace
) -> dict[str, Any]:
    """The stream's request, its script placed from the prompt's length."""
    counted = await client.post(
        f"{engine.url}/tokenize", json={"model": THINKING_MODEL_NAME, "messages": MESSAGES}
    )
    tokenized = await client.post(
        f"{engine.url}/tokenize",
        json={"model": THINKING_MODEL_NAME, "prompt": SENTENCE, "add_special_tokens": False},
    )
    return request(args, counted.json()["count"], tokenized.json()["tokens"])


async def straight(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    answer = Answer()
    async with client.stream("POST", f"{url}{CHAT}", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                answer.add(line[6:])
    return answer


@dataclass
class Trial:
    mode: str
    engine: str = ""  # the engine signalled
    signalled_at_token: int = 0
    first_token_s: float | None = None  # the request sent -> its first token
    next_event_s: float | None = None  # signal -> the client's next event
    handover_s: float | None = None  # signal -> the continuation's first event
    gap_before_s: float = 0.0  # the longest gap between two events before the signal
    equal: bool = False
    spoiled: bool = False  # the answer had reached the client whole: nothing to carry on
    differs: list[str] = field(default_factory=list)
    counted: dict[str, float] = field(default_factory=dict)


async def one_trial(
    client: httpx.AsyncClient,
    url: str,
    engines: Engines,
    body: dict[str, Any],
    kill_after: int,
    trial: Trial,
) -> tuple[Answer, EngineProcess | None]:
    """The stream through the router, its engine signalled once the client has `kill_after`
    tokens; the answer and the engine signalled (None: the stream ended first)."""
    answer = Answer()
    arrivals: list[float] = []
    signalled: float | None = None
    victim: EngineProcess | None = None
    sent = trio.current_time()
    async with client.stream("POST", f"{url}{CHAT}", json=body) as response:
        name = response.headers.get("x-trio-router-engine", "")
        victim = next(e for e in engines.running if e.url.endswith(name))
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            arrivals.append(trio.current_time())
            answer.add(line[6:])
            if answer.ids and trial.first_token_s is None:
                trial.first_token_s = arrivals[-1] - sent
            if signalled is None and len(answer.ids) >= kill_after:
                signalled = trio.current_time()
                send(victim, SIGNALS[trial.mode])
                trial.engine, trial.signalled_at_token = name, len(answer.ids)
    timed(trial, arrivals, signalled)
    return answer, victim if signalled is not None else None


def send(engine: EngineProcess, how: signal.Signals) -> None:
    """SIGTERM to the API server alone; every other signal to the whole process group."""
    if how == signal.SIGTERM:
        os.kill(engine.process.pid, how)
    else:
        os.killpg(engine.process.pid, how)


def timed(trial: Trial, arrivals: list[float], signalled: float | None) -> None:
    """The trial's times (see the module's docstring) from the events' arrival times."""
    if signalled is None:
        return
    before = [t for t in arrivals if t <= signalled]
    after = [t for t in arrivals if t > signalled]
    trial.gap_before_s = max((b - a for a, b in itertools.pairwise(before[1:])), default=0.0)
    if not after:
        return
    trial.next_event_s = after[0] - signalled
    edges = [signalled, *after]
    ends = max(range(1, len(edges)), key=lambda i: edges[i] - edges[i - 1])
    trial.handover_s = edges[ends] - signalled


def compare(got: Answer, want: Answer) -> list[str]:
    """The members in which `got` differs from `want` (and [DONE] not exactly once)."""
    names = ("reasoning", "content", "ids", "finish", "usage", "errors")
    differs = [n for n in names if getattr(got, n) != getattr(want, n)]
    return [*differs, *(["done"] if got.done != 1 else [])]


# -- the run -------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, workdir: Path) -> list[Trial]:
    """`--trials` streams carried on per mode, the modes in turn; a trial whose stream had
    reached the client whole before the signal (nothing carried on: see `measured`) does not
    count, at most 3 x `--trials` trials per mode."""
    trials: list[Trial] = []
    async with (
        open_engines(workdir / "engines") as engines,
        httpx.AsyncClient(timeout=LIMIT_S) as client,
    ):
        base = await prepared_request(client, engines.running[0], args)
        sent = trio.current_time()
        want = await straight(client, engines.running[0].url, base)
        print(
            f"uninterrupted (straight at an engine, {trio.current_time() - sent:.2f} s): "
            f"{len(want.ids)} tokens, reasoning {len(want.reasoning)} chars, "
            f"content {want.content!r}, finish {want.finish}",
            file=sys.stderr,
        )
        async with open_router([e.url for e in engines.running], workdir) as url:
            while (mode := next_mode(trials, args)) is not None:
                trial = await measured(client, url, engines, base, want, args, mode)
                trials.append(trial)
                print(json.dumps(asdict(trial)), file=sys.stderr)
    return trials


def next_mode(trials: Sequence[Trial], args: argparse.Namespace) -> str | None:
    """The mode after the last trial's, in `--modes` order, that still wants a trial."""

    def wants(mode: str) -> bool:
        mine = [t for t in trials if t.mode == mode]
        wanted: int = args.trials
        return sum(not t.spoiled for t in mine) < wanted and len(mine) < 3 * wanted

    order: list[str] = args.modes
    start = order.index(trials[-1].mode) + 1 if trials else 0
    return next((m for m in order[start:] + order[:start] if wants(m)), None)


async def measured(
    client: httpx.AsyncClient,
    url: str,
    engines: Engines,
    base: dict[str, Any],
    want: Answer,
    args: argparse.Namespace,
    mode: str,
) -> Trial:
    """One trial of `mode` once the router shows both engines healthy; the engine signalled
    is let go on (SIGCONT) or started again afterwards. On 2 cores an engine's API server can
    be starved while it generates and send a whole answer in one burst at its end: a signal
    then had nothing left to fail, and the trial is `spoiled` (nothing carried on, the answer
    whole)."""
    trial = Trial(mode)
    await wait_healthy(client, url, engines)
    before = await resume_counts(client, url)
    with trio.fail_after(LIMIT_S):
        got, victim = await one_trial(client, url, engines, base, args.kill_after, trial)
    after = await resume_counts(client, url)
    trial.counted = {k: v - before.get(k, 0) for k, v in after.items()}
    trial.counted = {k: v for k, v in trial.counted.items() if v}
    trial.differs = compare(got, want)
    trial.equal = not trial.differs
    trial.spoiled = trial.equal and not trial.counted
    if victim is not None and mode == "stop":
        os.killpg(victim.process.pid, signal.SIGCONT)
    elif victim is not None:
        await engines.restart(victim)
    return trial


def reasons(trials: Sequence[Trial]) -> str:
    counts: dict[str, int] = {}
    for trial in trials:
        for labels, n in trial.counted.items():
            named = dict(part.split("=", 1) for part in labels.split(","))
            key = f"{named['reason'].strip(chr(34))} {named['outcome'].strip(chr(34))}"
            counts[key] = counts.get(key, 0) + int(n)
    return ", ".join(f"{key} {n}" for key, n in sorted(counts.items())) or "-"


def table(trials: Sequence[Trial], modes: Sequence[str]) -> str:
    """Per mode, over the trials that were not spoiled (see `measured`)."""
    lines = [
        "| signal | streams | spoiled | equal to the uninterrupted answer"
        " | the stream's first token, s (median) | signal → next event, ms (median)"
        " | signal → continuation's first event, s: min / median / max"
        " | longest gap before the signal, s | resumes counted (reason outcome) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    names = {"kill": "SIGKILL", "term": "SIGTERM (API server)", "stop": "SIGSTOP"}
    for mode in modes:
        mine = [t for t in trials if t.mode == mode and not t.spoiled]
        spoiled = sum(t.mode == mode and t.spoiled for t in trials)
        handover = [t.handover_s for t in mine if t.handover_s is not None]
        spread = (
            f"{min(handover):.2f} / {statistics.median(handover):.2f} / {max(handover):.2f}"
            if handover
            else "-"
        )
        first = median([t.first_token_s for t in mine], "{:.2f}", 1)
        nearest = median([t.next_event_s for t in mine], "{:.1f}", 1000)
        gap = max((t.gap_before_s for t in mine), default=0.0)
        lines.append(
            f"| {names[mode]} | {len(mine)} | {spoiled} | {sum(t.equal for t in mine)} | "
            f"{first} | {nearest} | {spread} | {gap:.2f} | {reasons(mine)} |"
        )
    return "\n".join(lines)


def median(values: Sequence[float | None], form: str, scale: float) -> str:
    known = [v * scale for v in values if v is not None]
    return form.format(statistics.median(known)) if known else "-"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="streams per mode")
    parser.add_argument("--modes", default="kill,term,stop")
    parser.add_argument("--kill-after", type=int, default=20, help="tokens before the signal")
    parser.add_argument("--reasoning", type=int, default=600, help="tokens of reasoning")
    parser.add_argument("--log-dir", type=Path, help="keep the router's and engines' logs here")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    args.modes = [mode for mode in args.modes.split(",") if mode]
    if unknown := [mode for mode in args.modes if mode not in SIGNALS]:
        parser.error(f"--modes: unknown {unknown} (known: {', '.join(SIGNALS)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.log_dir or Path(tempfile.mkdtemp(prefix="handover-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {workdir}", file=sys.stderr)
    trials = trio.run(run, args, workdir)
    print(table(trials, args.modes))
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(t) for t in trials], indent=1))
    return 0 if all(t.equal for t in trials) else 1  # a spoiled trial is equal too


if __name__ == "__main__":
    sys.exit(main())
