"""Streams carried on when their engine dies, at real vLLM engines: a greedy streamed chat of
200 tokens through the router in front of the tier's two engines; after about 50 tokens the
engine serving it is killed (SIGKILL: a crash) or told to stop (SIGTERM: what Kubernetes does
to a deleted pod). The client gets one complete stream whose tokens are those of the same
request run without a failure. The engine is started again afterwards, for the tier's other
tests."""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Final

import httpx
import pytest
import trio

from test_real_vllm import CHAT, LIMIT, messages, open_router, post_raw, read_head, static
from trio_router.testing import vllm_engines
from trio_router.testing.vllm_engines import MODEL_NAME, EngineEnvironment, EngineProcess

pytestmark = pytest.mark.real_vllm

TOKENS: Final = 200
KILL_AFTER: Final = 50  # tokens received before the engine is stopped


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


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_a_stream_whose_engine_dies_is_carried_on_token_for_token(
    real_engines: list[EngineProcess], vllm_env: EngineEnvironment, how: signal.Signals
) -> None:
    with trio.fail_after(3 * LIMIT):
        expected = await reference(real_engines[0])
        assert len(expected) == TOKENS
        stopped: EngineProcess | None = None
        try:
            async with open_router(static(real_engines), len(real_engines)) as (url, _):
                async with await post_raw(url, CHAT, request()) as stream:
                    head, rest = await read_head(stream)
                    serving = next(
                        line.split(b": ", 1)[1].decode()
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"x-trio-router-engine:")
                    )
                    stopped = next(e for e in real_engines if e.url.endswith(serving))
                    events = Events(stream, rest)
                    got: list[int] = []
                    stream_events: list[Any] = []
                    killed_at = None
                    while (event := await events.next()) != "[DONE]":
                        stream_events.append(event)
                        for choice in event["choices"]:
                            got += choice.get("token_ids") or []
                        if len(got) >= KILL_AFTER and killed_at is None:
                            os.killpg(stopped.process.pid, how)
                            killed_at = len(got)
                async with httpx.AsyncClient() as client:
                    text = (await client.get(f"{url}/metrics")).text
        finally:
            if stopped is not None:
                await restart(real_engines, stopped, vllm_env)
    assert killed_at is not None and killed_at < TOKENS  # it died mid-answer
    resumes = [
        line for line in text.splitlines() if line.startswith("trio_router_stream_resumes_total")
    ]
    assert [line.rsplit(" ", 1)[1] for line in resumes if 'outcome="resumed"' in line] == ["1.0"]
    assert got == expected, resumes  # token for token, no repeat, no gap
    assert len({(e["id"], e["created"], e["model"]) for e in stream_events}) == 1
    usage = [e["usage"] for e in stream_events if not e["choices"]]
    assert [(u["completion_tokens"], u["prompt_tokens"] > 0) for u in usage] == [(TOKENS, True)]
    assert all(c["finish_reason"] != "abort" for e in stream_events for c in e["choices"])
