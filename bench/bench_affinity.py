"""Prefix affinity across router replicas: do two `prefix_aware` routers with no shared state
send every turn of a conversation to the same engine, and does a restarted one still do so?

    python bench/bench_affinity.py [--shared-system | --groups] [--seed S] [--router-src PATH]

Two real router processes (replicas, `python -m trio_router --config ...`) with identical
config (`routing.policy = "prefix_aware"`, static discovery) in front of four fake engines
(`trio_router.testing.FakeEngine`, served in this process on 127.0.1.1-4, on --engine-port).
24 conversations, each with its own system prompt of 2-4 KiB of seeded random text
(`--shared-system`: one prompt for all 24), run 6 turns; a turn sends the whole chat so far
(system, user 1, assistant 1, ..., user N; the assistant messages are the engines' answers)
and turn k of every conversation goes to replica k % 2. `--groups`: each of the 24 is a group
of requests instead, sharing its system prompt, each request with a different question and no
history (an application's users asking it in turn); "turns" and "conversations" below are
then a group's requests and the groups. The engine that served each turn is
read from the router's `x-trio-router-engine` response header. Then replica 0 is restarted
(SIGTERM, then a fresh process with the same config) and every conversation sends one more
turn, to the restarted replica. Printed:

- turns on their conversation's modal engine (the engine most of its turns went to; target
  >= 95 %), and conversations whose every turn went to one engine;
- each engine's share of conversations (by modal engine; target: every engine >= 10 %; a
  tie counts for the engine of the earliest turn, and ties are counted) and of turns;
- after the restart: conversations whose extra turn went to the engine replica 0 chose for
  them before its restart (target 24 of 24), and to the engine of their previous turn (which
  replica 1 chose).

`--router-src PATH` runs the routers from another source tree (PATH, or PATH/src when it has
one) through PYTHONPATH, e.g. a `git worktree` of an older commit, for before/after figures.
The engines' ports are fixed (--engine-port, 0: ephemeral) because the ring is built from the
engines' URLs: fixed ports give the same placement on every run of a seed. Loopback only;
bounded: a few seconds per run, at most --limit seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import trio

from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.processes import Output, open_process

REPO: Final = Path(__file__).resolve().parent.parent


ENGINES: Final = 4
REPLICAS: Final = 2
MODEL: Final = "fake-model"
ENGINE_HEADER: Final = "x-trio-router-engine"
CONCURRENCY: Final = 8  # requests in flight at once (every one to the same replica)
WORDS: Final = (
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "an",
    "engine",
    "that",
    "already",
    "holds",
    "prefix",
    "of",
    "its",
    "conversation",
    "in",
    "kv",
    "cache",
    "so",
    "time",
    "first",
    "token",
    "drops",
    "policy",
    "replica",
    "answer",
    "with",
    "care",
    "and",
    "cite",
    "sources",
    "when",
    "asked",
    "about",
    "tools",
)


@dataclass
class Replica:
    process: trio.Process
    stderr: Output
    url: str


async def start_replica(stack: AsyncExitStack, config: Path, env: dict[str, str]) -> Replica:
    """One more router process on `config`, once it listens and every engine is routable;
    `stack` kills it, if it still runs, when it closes."""
    process, _, stderr = await stack.enter_async_context(
        open_process("--config", str(config), "--log-level", "info", env=env)
    )
    url = (await stderr.wait_for(r"Running on (http://\S+)")).group(1)
    await stderr.wait_for(rf"(?:[\s\S]*?is routable){{{ENGINES}}}")
    return Replica(process, stderr, url)


def write_config(path: Path, engine_urls: list[str]) -> Path:
    urls = ", ".join(f'"{url}"' for url in engine_urls)
    path.write_text(f"""
[server]
bind = "127.0.0.1:0"
drain_s = 2.0
access_log = false
[routing]
policy = "prefix_aware"
[discovery]
mode = "static"
[discovery.static]
urls = [{urls}]
""")
    return path


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    rng: random.Random
    engines: list[str] = field(default_factory=list)  # the engine of each turn so far
    history: bool = True  # False: a group, whose every request is its system prompt + a question

    def modal(self) -> str:
        """The engine most turns went to (ties: the one reached first)."""
        return Counter(self.engines).most_common(1)[0][0]


async def turn(
    client: httpx.AsyncClient,
    replica: Replica,
    conversation: Conversation,
    limiter: trio.CapacityLimiter,
) -> str:
    """One more user message, the whole chat sent to `replica`; the engine that served it
    (the assistant's answer joins the chat)."""
    question = {
        "role": "user",
        "content": text(conversation.rng, conversation.rng.randrange(80, 400)),
    }
    messages = [*conversation.messages, question]
    async with limiter:
        response = await client.post(
            f"{replica.url}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 16},
        )
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code} from {replica.url}: {response.text}")
    if conversation.history:
        answer = response.json()["choices"][0]["message"]["content"]
        conversation.messages += [question, {"role": "assistant", "content": answer}]
    engine = response.headers[ENGINE_HEADER]
    conversation.engines.append(engine)
    return engine


async def run_turn(
    client: httpx.AsyncClient, replica: Replica, conversations: list[Conversation]
) -> list[str]:
    """The next turn of every conversation, `CONCURRENCY` at a time; the engines, in order."""
    limiter = trio.CapacityLimiter(CONCURRENCY)
    engines = [""] * len(conversations)

    async def one(i: int) -> None:
        engines[i] = await turn(client, replica, conversations[i], limiter)

    async with trio.open_nursery() as nursery:
        for i in range(len(conversations)):
            nursery.start_soon(one, i)
    return engines


def router_env(router_src: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if router_src is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(router_src), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    return env


def source_dir(path: str | None) -> Path | None:
    if path is None:
        return None
    root = Path(path).resolve()
    src = root / "src" if (root / "src" / "trio_router").is_dir() else root
    if not (src / "trio_router").is_dir():
        raise SystemExit(f"--router-src: no trio_router package in {root} or {root / 'src'}")
    return src


@dataclass
class Run:
    """What one run observed."""

    engines: list[str]  # every engine, as the routers name them (host:port)
    turns: list[list[str]]  # per conversation, the engine of each turn before the restart
    after: list[str]  # per conversation, the engine of its turn after the restart
    exit_code: int | None  # of the replica stopped with SIGTERM
    seconds: float


async def bench(args: argparse.Namespace, env: dict[str, str]) -> Run:
    rng = random.Random(args.seed)
    shared = text(rng, rng.randrange(2048, 4096))
    conversations = [
        Conversation(
            [
                {
                    "role": "system",
                    "content": shared
                    if args.shared_system
                    else text(rng, rng.randrange(2048, 4096)),
                }
            ],
            random.Random(rng.getrandbits(64)),
            history=not args.groups,
        )
        for _ in range(args.conversations)
    ]
    engines = [FakeEngine(name=f"engine-{i}", tokens=12) for i in range(ENGINES)]
    began = trio.current_time()
    with tempfile.TemporaryDirectory() as tmp, trio.fail_after(args.limit):
        async with (
            open_fake_engines(engines, port=args.engine_port) as urls,
            AsyncExitStack() as stack,
            httpx.AsyncClient(timeout=10.0) as client,
        ):
            config = write_config(Path(tmp) / "router.toml", urls)
            replicas = [await start_replica(stack, config, env) for _ in range(REPLICAS)]
            for k in range(args.turns):
                await run_turn(client, replicas[k % REPLICAS], conversations)
            turns = [list(c.engines) for c in conversations]
            replicas[0].process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                exit_code = await replicas[0].process.wait()
            replicas[0] = await start_replica(stack, config, env)
            after = await run_turn(client, replicas[0], conversations)
    return Run(
        [u.removeprefix("http://") for u in urls],
        turns,
        after,
        exit_code,
        trio.current_time() - began,
    )


def report(args: argparse.Namespace, run: Run, source: str) -> None:
    n = len(run.turns)
    if args.groups:
        shape = (
            f"{n} groups x {args.turns} requests (request k to replica k % {REPLICAS}), each "
            "group's own system prompt (2-4 KiB) and a new question per request, no history"
        )
    else:
        shape = (
            f"{n} conversations x {args.turns} turns (turn k to replica k % {REPLICAS}), "
            f"{'one shared system prompt' if args.shared_system else 'own system prompts'} "
            "(2-4 KiB)"
        )
    print(f"prefix_aware: {REPLICAS} replicas, {ENGINES} engines, {shape}, seed {args.seed}")
    print(f"router code: {source}\n")

    def row(label: str, value: str, target: str = "", ok: bool | None = None) -> None:
        verdict = "" if ok is None else ("ok" if ok else "MISSED")
        print(f"{label:56} {value:>11}  {target:>8}  {verdict}".rstrip())

    counts = [Counter(engines).most_common() for engines in run.turns]
    on_modal = sum(c[0][1] for c in counts)
    total = sum(len(engines) for engines in run.turns)
    ties = sum(len(c) > 1 and c[0][1] == c[1][1] for c in counts)
    modal = Counter(c[0][0] for c in counts)  # a tie: the engine of the earliest turn
    per_turn = Counter(engine for engines in run.turns for engine in engines)
    row("figure", "value", "target")
    row(
        "turns on their conversation's modal engine",
        f"{100 * on_modal / total:.1f} %",
        ">= 95 %",
        on_modal >= 0.95 * total,
    )
    row("conversations on one engine throughout", f"{sum(len(c) == 1 for c in counts)}/{n}")
    if ties:
        row("conversations with no single modal engine (a tie)", f"{ties}/{n}")
    low = min(modal.get(engine, 0) for engine in run.engines) / n
    row(
        "engine share of conversations (by modal engine), lowest",
        f"{100 * low:.1f} %",
        ">= 10 %",
        low >= 0.10,
    )
    for engine in run.engines:
        row(
            f"  {engine}: conversations, turns",
            f"{100 * modal.get(engine, 0) / n:3.0f} %, "
            f"{100 * per_turn.get(engine, 0) / total:3.0f} %",
        )
    own = [engines[(len(engines) - 1) // REPLICAS * REPLICAS] for engines in run.turns]
    same_own = sum(a == b for a, b in zip(run.after, own, strict=True))
    row(
        "after the restart: turn on the engine replica 0 chose",
        f"{same_own}/{n}",
        f"{n}",
        same_own == n,
    )
    same_last = sum(a == b[-1] for a, b in zip(run.after, run.turns, strict=True))
    row("  ... on the engine of the previous turn", f"{same_last}/{n}")
    print(
        f"\nreplica 0 (turns 0, 2, ...) restarted: SIGTERM, exit code {run.exit_code}, "
        f"then a fresh process; {run.seconds:.1f} s in all"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shared-system",
        action="store_true",
        help="one system prompt for all conversations (they differ from "
        "their first user message on)",
    )
    parser.add_argument(
        "--groups",
        action="store_true",
        help="groups of requests sharing a system prompt, a new question each, no history",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=24, help="(default 24, max 200)")
    parser.add_argument("--turns", type=int, default=6, help="(default 6, max 20)")
    parser.add_argument(
        "--engine-port",
        type=int,
        default=18400,
        help="port of every fake engine, each on its own 127.0.1.N "
        "(default 18400; 0: ephemeral, a different ring every run)",
    )
    parser.add_argument(
        "--router-src",
        metavar="PATH",
        help="run the routers from this source tree (PATH or PATH/src)",
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=60.0,
        help="seconds after which the run is abandoned (default 60)",
    )
    args = parser.parse_args()
    if args.groups and args.shared_system:
        parser.error("--groups and --shared-system exclude each other")
    args.conversations = max(1, min(args.conversations, 200))
    args.turns = max(1, min(args.turns, 20))
    env = router_env(source_dir(args.router_src))
    where = subprocess.run(  # the package the routers will import
        [sys.executable, "-c", "import trio_router; print(trio_router.__file__)"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    report(args, trio.run(bench, args, env), str(Path(where).parent))


if __name__ == "__main__":
    main()
