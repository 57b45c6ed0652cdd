"""`prefix_aware` across router replicas, end to end: two real router processes with the same
config and no shared state, in front of four fake engines, send every turn of a conversation
to the same engine whichever replica gets the turn, and a restarted replica keeps doing so.
Real processes, so the real clock (bench/bench_affinity.py measures the same at a larger
scale)."""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Final

import httpx
import trio

from test_main import LIMIT
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.processes import Output, open_process, router_url

ENGINES: Final = 4
CONVERSATIONS: Final = 8  # the first half with their own system prompts, the rest share one
TURNS: Final = 4  # turn k goes to replica k % 2
ENGINE_HEADER: Final = "x-trio-router-engine"
WORDS: Final = (
    "the",
    "router",
    "sends",
    "each",
    "turn",
    "to",
    "an",
    "engine",
    "that",
    "holds",
    "prefix",
    "of",
    "its",
    "conversation",
    "in",
    "kv",
    "cache",
)


def write_config(path: Path, engine_urls: list[str]) -> Path:
    urls = ", ".join(f'"{url}"' for url in engine_urls)
    path.write_text(f"""
[server]
bind = "127.0.0.1:0"
drain_s = 1.0
access_log = false
[routing]
policy = "prefix_aware"
[discovery]
mode = "static"
[discovery.static]
urls = [{urls}]
[stats]
interval_s = 0.0
""")
    return path


async def ready(stderr: Output) -> str:
    """The router's URL, once every engine is routable."""
    return await router_url(stderr, engines=ENGINES)


def text(rng: random.Random, chars: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(chars // 4))[:chars]


def conversations() -> list[list[dict[str, str]]]:
    rng = random.Random(7)
    shared = text(rng, 2048)
    return [
        [{"role": "system", "content": text(rng, 2048) if i < CONVERSATIONS // 2 else shared}]
        for i in range(CONVERSATIONS)
    ]


async def turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], rng: random.Random
) -> str:
    """Append a user message, send the whole chat to the router at `url`, append the answer;
    the engine that served it."""
    messages.append({"role": "user", "content": text(rng, rng.randrange(40, 200))})
    response = await client.post(
        f"{url}/v1/chat/completions", json={"model": "fake-model", "messages": messages}
    )
    assert response.status_code == 200, response.text
    messages.append(
        {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
    )
    return response.headers[ENGINE_HEADER]


async def test_replicas_and_a_restarted_one_send_a_conversation_to_one_engine(
    tmp_path: Path,
) -> None:
    chats = conversations()
    rng = random.Random(8)
    seen: list[list[str]] = [[] for _ in chats]  # per conversation, the engine of each turn
    with trio.fail_after(LIMIT):
        async with (
            open_fake_engines([FakeEngine(tokens=4) for _ in range(ENGINES)]) as urls,
            httpx.AsyncClient(timeout=LIMIT) as client,
        ):
            config = str(write_config(tmp_path / "r.toml", urls))
            async with (
                open_process("--config", config) as (first, _, first_err),
                open_process("--config", config) as (_, _, second_err),
            ):
                replicas = [await ready(first_err), await ready(second_err)]
                for k in range(TURNS):
                    for chat, engines in zip(chats, seen, strict=True):
                        engines.append(await turn(client, replicas[k % 2], chat, rng))

                first.send_signal(signal.SIGTERM)
                assert await first.wait() == 0, first_err.text
                async with open_process("--config", config) as (_, _, restarted_err):
                    restarted = await ready(restarted_err)
                    after = [await turn(client, restarted, chat, rng) for chat in chats]

    split = {i: engines for i, engines in enumerate(seen) if len(set(engines)) > 1}
    assert not split, f"conversations whose turns went to several engines: {split}"
    # The conversations spread (a policy sending everything to one engine would pass the
    # rest): all eight on one of four engines is a ~1e-4 chance.
    assert len({engines[0] for engines in seen}) >= 2, seen
    moved = {
        i: (engines[0], engine)
        for i, (engines, engine) in enumerate(zip(seen, after, strict=True))
        if engine != engines[0]
    }
    assert not moved, f"after the restart, conversations moved (before, after): {moved}"
