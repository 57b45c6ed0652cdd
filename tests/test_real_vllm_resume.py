"""Streams carried on when their engine dies, at real vLLM engines: a greedy streamed chat of
1,900 tokens (near the context: the tiny model writes 250-600 tokens a second, and the engine
must still be generating when it is stopped, however late a busy machine lets the client see
its tokens) through the router in front of the tier's two engines; after 20 tokens the
engine serving it is killed (SIGKILL: a crash) or told to stop (SIGTERM: what Kubernetes does
to a deleted pod). The client gets one complete stream whose tokens are those of the same
request run without a failure. The engine is started again afterwards, for the tier's other
tests."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import pytest
import trio

from test_real_vllm import CHAT, LIMIT, messages, open_router, post_raw, read_head, static
from trio_router.testing import vllm_engines
from trio_router.testing.vllm_engines import MODEL_NAME, EngineEnvironment, EngineProcess

pytestmark = pytest.mark.real_vllm

TOKENS: Final = 1900
KILL_AFTER: Final = 20  # tokens received before the engine is stopped
ATTEMPTS: Final = 3  # trials a busy machine may spoil (see the test)
_LAST_CHUNK: Final = b"0\r\n\r\n"


def request() -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": messages("tell a long story"),
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }


async def reference(engine: EngineProcess) -> list[int]:
    """The tokens of the request run straight at `engine`, without a failure."""
    async with (
        httpx.AsyncClient(timeout=LIMIT) as client,
        client.stream("POST", f"{engine.url}{CHAT}", json=request()) as answer,
    ):
        tokens: list[int] = []
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
        return tokens


class Events:
    """A stream's SSE events as they arrive on a raw connection (chunked)."""

    def __init__(self, stream: trio.SocketStream, rest: bytes) -> None:
        self._stream, self._buffer = stream, rest
        self._body = b""

    async def next(self) -> Any:
        while b"\n\n" not in self._body:
            while b"\r\n" not in self._buffer:
                self._buffer += await self._receive()
            size_line, _, rest = self._buffer.partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += await self._receive()
            assert size, f"the stream ended without [DONE]: {self._body!r}"
            self._body += rest[:size]
            self._buffer = rest[size + 2 :]
        event, _, self._body = self._body.partition(b"\n\n")
        assert event.startswith(b"data: "), event
        data = event.removeprefix(b"data: ")
        return "[DONE]" if data == b"[DONE]" else json.loads(data)

    async def end(self) -> None:
        """Read the body's last (empty) chunk, which follows [DONE]: the router has then
        settled its account of the answer (a client leaving at [DONE] is counted too, but
        once the router has seen it go)."""
        while len(self._buffer) < len(_LAST_CHUNK):
            self._buffer += await self._receive()
        assert (self._body, self._buffer) == (b"", _LAST_CHUNK), (self._body, self._buffer)

    async def _receive(self) -> bytes:
        data = await self._stream.receive_some()
        assert data, "the router closed the connection mid-stream"
        return data


async def restart(
    engines: list[EngineProcess], dead: EngineProcess, env: EngineEnvironment
) -> None:
    """Start the stopped engine again, in its place in the tier's list."""
    dead.stop()
    log_dir = dead.log_path.parent
    (again,) = await trio.to_thread.run_sync(
        lambda: vllm_engines.start_engines(env, [dead.spec], log_dir=log_dir)
    )
    engines[engines.index(dead)] = again


@dataclass
class Trial:
    """One streamed request whose engine was stopped once it had sent KILL_AFTER tokens."""

    got: list[int] = field(default_factory=list)  # the tokens the client received
    events: list[Any] = field(default_factory=list)  # the JSON events it received
    killed_at: int | None = None  # tokens received when the engine was stopped
    stopped: EngineProcess | None = None
    carried_on: dict[str, float] = field(default_factory=dict)  # resumes, by outcome


async def stop_mid_answer(engines: list[EngineProcess], how: signal.Signals, trial: Trial) -> None:
    """The request through a router in front of `engines`, its engine stopped with `how`."""
    async with open_router(static(engines), len(engines)) as (url, _):
        async with await post_raw(url, CHAT, request()) as stream:
            head, rest = await read_head(stream)
            serving = next(
                line.split(b": ", 1)[1].decode()
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"x-trio-router-engine:")
            )
            trial.stopped = next(e for e in engines if e.url.endswith(serving))
            events = Events(stream, rest)
            while (event := await events.next()) != "[DONE]":
                trial.events.append(event)
                for choice in event.get("choices") or []:  # an error event has none
                    trial.got += choice.get("token_ids") or []
                if len(trial.got) >= KILL_AFTER and trial.killed_at is None:
                    os.killpg(trial.stopped.process.pid, how)
                    trial.killed_at = len(trial.got)
            await events.end()
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("trio_router_stream_resumes_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            trial.carried_on[outcome] = float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_a_stream_whose_engine_dies_is_carried_on_token_for_token(
    real_engines: list[EngineProcess], vllm_env: EngineEnvironment, how: signal.Signals
) -> None:
    """On 2 cores an engine's API server can be starved for seconds while it generates, so
    that a whole answer reaches the client in one burst at its end: an engine stopped then
    had nothing left to fail. Such a trial shows no failure at all (nothing carried on) and
    is run again, up to ATTEMPTS times; any other result is the test's."""
    with trio.fail_after(ATTEMPTS * 3 * LIMIT):
        expected = await reference(real_engines[0])
        assert len(expected) == TOKENS
        for _ in range(ATTEMPTS):
            trial = Trial()
            try:
                await stop_mid_answer(real_engines, how, trial)
            finally:
                if trial.stopped is not None:
                    await restart(real_engines, trial.stopped, vllm_env)
            if trial.carried_on:
                break
    assert trial.killed_at is not None and trial.killed_at < TOKENS  # stopped mid-answer
    assert trial.carried_on == {"resumed": 1.0}  # continued by the other engine
    assert trial.got == expected  # token for token, no repeat, no gap
    assert len({(e["id"], e["created"], e["model"]) for e in trial.events}) == 1
    usage = [e["usage"] for e in trial.events if not e["choices"]]
    assert [(u["completion_tokens"], u["prompt_tokens"] > 0) for u in usage] == [(TOKENS, True)]
    assert all(c["finish_reason"] != "abort" for e in trial.events for c in e["choices"])
