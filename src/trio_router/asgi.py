"""ASGI plumbing shared by the router, the fake engines and the tests: the message types, the
lifespan answer, and a jittered period."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI lifespan scope: acknowledge startup and shutdown, own nothing (the
    server's nursery owns every task)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def jittered(period: float, spread: float, rng: random.Random | None = None) -> float:
    """`period` scaled by a random factor in [1 - spread, 1 + spread], so that many timers
    with one period do not fire in lockstep."""
    return period * (rng or random).uniform(1 - spread, 1 + spread)
