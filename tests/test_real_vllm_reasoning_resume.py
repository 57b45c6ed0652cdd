"""Reasoning and tool-call streams carried on when their engine dies, at real vLLM engines: two
thinking engines of their own (`EngineSpec(thinking=True, scale_out=True)`: vLLM's
`deepseek_r1` reasoning parser, `hermes` tool parser and scale-out routes, the launcher's
ScriptedTokens), on addresses the tier's other engines do not use, with the router in front.

One trial per signal sends two greedy streams to one engine (the `session` policy keeps a
session on one engine): a tool-call stream (some reasoning, `</think>`, a little content, then
a `get_weather` call with long arguments) and, once it reasons, a reasoning stream whose
script ends the reasoning long after the engine is stopped, so that its continuation must
switch to content where the script says. The engine is stopped once the client has the call's
first argument fragment: killed (SIGKILL: a crash) or told to stop (SIGTERM to its API server
alone, as Kubernetes signals a deleted pod's main process; with vLLM's default
`--shutdown-timeout 0` its running streams end with an abort event or, when its engine core
is killed before the aborts come back, stay open and silent until the router's stall bound).

Each client's reasoning, content, tool call (name, arguments, one id, the finish) and usage
counts equal the surviving engine's answer to the same request sent straight, with one
`[DONE]`; the router counted one resume of each `kind`. The stopped engine is started again
when the next trial needs it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import httpx
import pytest
import trio

from test_real_vllm import post_raw, read_head
from test_real_vllm_resume import restart
from trio_router import server
from trio_router.config import RoutingConfig
from trio_router.table import RoutingTable
from trio_router.testing import vllm_engines
from trio_router.testing._vllm_model import WORDS
from trio_router.testing.harness import router_config
from trio_router.testing.vllm_engines import (
    THINKING_MODEL_NAME,
    EngineEnvironment,
    EngineProcess,
    EngineSpec,
)

pytestmark = pytest.mark.real_vllm

LIMIT: Final = 120.0  # seconds: bounds a hang; a machine busy with engines is slow
HOSTS: Final = ("127.0.1.21", "127.0.1.22")  # not the tier's (.11, .12) nor .31
CHAT: Final = "/v1/chat/completions"
END_THINK: Final = 4097  # the thinking model's `</think>`
EOS: Final = 2  # `<|im_end|>`
REASONING: Final = 1200  # tokens of reasoning before the reasoning stream's script ends it
CALL_AFTER: Final = 200  # ... and before the tool-call stream's script (fewer in all)
ATTEMPTS: Final = 3  # trials a busy machine may spoil (see the test)
USAGE_COUNTS: Final = ("prompt_tokens", "completion_tokens", "total_tokens")
SESSION: Final = "handover"  # the body's `user`: the session policy's key
MESSAGES: Final = [
    {"role": "system", "content": "you are a test"},
    {"role": "user", "content": "say a few words"},
]
TOOLS: Final = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "notes": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SENTENCE: Final = " the water is good"  # the reasoning stream's content
# The call's arguments: long enough (about 750 tokens) that the engine is still writing them
# when the client has their beginning, however late a busy machine lets the client see it
# (and the reasoning stream has begun by then); the reasoning stream's script ends after the
# call's, so that it is still reasoning when the engine is stopped.
NOTES: Final = " ".join(WORDS[i % 40] for i in range(720))
ARGUMENTS: Final = json.dumps({"city": "Paris", "notes": NOTES})
CALL: Final = (
    '</think>ok <tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + "}\n</tool_call>"
)


@dataclass
class Pair:
    """The module's two engines; one stopped by a trial is started again by `revive`."""

    env: EngineEnvironment
    engines: list[EngineProcess]  # running_engines' own list: it stops whatever is in it
    stopped: list[EngineProcess] = field(default_factory=list)

    async def revive(self) -> None:
        while self.stopped:
            await restart(self.engines, self.stopped.pop(), self.env)


@pytest.fixture(scope="module")
def pair(vllm_env: EngineEnvironment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Two thinking engines with the scale-out routes, for this module, one port."""
    port = vllm_engines.free_port(HOSTS)
    specs = [
        EngineSpec(host=host, port=port, core=i, max_num_seqs=4, thinking=True, scale_out=True)
        for i, host in enumerate(HOSTS)
    ]
    log_dir = tmp_path_factory.mktemp("vllm-thinker-pair-logs")
    with vllm_engines.running_engines(vllm_env, specs, log_dir=log_dir) as engines:
        yield Pair(vllm_env, engines)


# -- the requests ------------------------------------------------------------------------------
async def requests(client: httpx.AsyncClient, engine: EngineProcess) -> tuple[Any, Any]:
    """The reasoning stream's request and the tool-call stream's, their scripts placed from
    the prompts' lengths."""

    async def prompt_length(**extra: Any) -> int:
        body = {"model": THINKING_MODEL_NAME, "messages": MESSAGES, **extra}
        answer = await client.post(f"{engine.url}/tokenize", json=body)
        return int(answer.json()["count"])

    async def tokens(text: str) -> list[int]:
        body = {"model": THINKING_MODEL_NAME, "prompt": text, "add_special_tokens": False}
        return list((await client.post(f"{engine.url}/tokenize", json=body)).json()["tokens"])

    common = {
        "model": THINKING_MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": SESSION,
    }
    sentence, call = await tokens(SENTENCE), await tokens(CALL)
    reasoning = common | {
        "max_tokens": REASONING + 40,
        "vllm_xargs": {
            "script_at": await prompt_length() + REASONING,
            "script": [END_THINK, *sentence, EOS],
        },
    }
    calling = common | {
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": CALL_AFTER + len(call) + 40,
        "vllm_xargs": {
            "script_at": await prompt_length(tools=TOOLS) + CALL_AFTER,
            "script": [*call, EOS],
        },
    }
    return reasoning, calling


@dataclass
class Answer:
    """What a client puts together from a chat stream."""

    reasoning: str = ""
    content: str = ""
    calls: dict[int, list[Any]] = field(default_factory=dict)  # index: [name, arguments, ids]
    finish: list[str] = field(default_factory=list)  # every finish reason, in order
    usage: list[Any] = field(default_factory=list)
    done: int = 0  # [DONE] events
    heads: set[tuple[Any, ...]] = field(default_factory=set)  # (id, created, model) seen

    def add(self, event: Any) -> None:
        if event == "[DONE]":
            self.done += 1
            return
        assert "error" not in event, event
        self.heads.add((event["id"], event["created"], event["model"]))
        if "usage" in event and not event["choices"]:
            self.usage.append(event["usage"])
        for choice in event["choices"]:
            delta = choice["delta"]
            self.reasoning += delta.get("reasoning") or ""
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                made = self.calls.setdefault(call["index"], ["", "", []])
                function = call.get("function") or {}
                made[0] += function.get("name") or ""
                made[1] += function.get("arguments") or ""
                made[2] += [call["id"]] if call.get("id") else []
            if choice.get("finish_reason") is not None:
                self.finish.append(choice["finish_reason"])

    def said(self) -> tuple[Any, ...]:
        """Everything but the tool calls' ids (the engine draws them at random), the event
        heads, and of the usage only its counts: vLLM adds `completion_tokens_details` (its
        reasoning parser's count), which a continued stream's usage object leaves out."""
        calls = [(name, arguments, len(ids)) for name, arguments, ids in self.calls.values()]
        counts = [{k: u[k] for k in USAGE_COUNTS} for u in self.usage]
        return self.reasoning, self.content, calls, self.finish, counts, self.done


async def straight(client: httpx.AsyncClient, engine: EngineProcess, body: Any) -> Answer:
    """`body` answered by `engine` without the router."""
    answer = Answer()
    async with client.stream("POST", f"{engine.url}{CHAT}", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                answer.add("[DONE]" if data == "[DONE]" else json.loads(data))
    return answer


# -- through the router ------------------------------------------------------------------------
class Stream:
    """A streamed chat through the router on a raw connection, its events read as they come
    into `answer` until the body's last chunk."""

    def __init__(
        self, connection: trio.SocketStream, head: bytes, rest: bytes, answer: Answer
    ) -> None:
        self._connection, self._buffer, self._body = connection, rest, b""
        assert head.startswith(b"HTTP/1.1 200"), head
        self.engine = next(
            line.split(b": ", 1)[1].decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"x-trio-router-engine:")
        )
        self.answer = answer
        self.ended = False

    async def step(self) -> None:
        """Read until at least one more event, or the end of the body."""
        while b"\n\n" not in self._body and not self.ended:
            while b"\r\n" not in self._buffer:
                self._buffer += await self._receive()
            size_line, _, rest = self._buffer.partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += await self._receive()
            self._body += rest[:size]
            self._buffer = rest[size + 2 :]
            self.ended = size == 0
        while b"\n\n" in self._body:
            event, _, self._body = self._body.partition(b"\n\n")
            assert event.startswith(b"data: "), event
            data = event.removeprefix(b"data: ")
            self.answer.add("[DONE]" if data == b"[DONE]" else json.loads(data))

    async def read_to_end(self, after_each: Callable[[], None] = lambda: None) -> None:
        while not self.ended:
            await self.step()
            after_each()

    async def _receive(self) -> bytes:
        data = await self._connection.receive_some()
        assert data, "the router closed the connection mid-stream"
        return data


@asynccontextmanager
async def open_stream(url: str, body: Any, answer: Answer) -> AsyncIterator[Stream]:
    """`body` POSTed to the router at `url`, its events read into `answer`."""
    async with await post_raw(url, CHAT, body) as connection:
        head, rest = await read_head(connection)
        yield Stream(connection, head, rest, answer)


@asynccontextmanager
async def open_router(engines: list[EngineProcess]) -> AsyncIterator[str]:
    """The router in front of `engines` (static; sessions kept on one engine); yields its URL
    once both serve the thinking model."""
    config = router_config([e.url for e in engines], routing=RoutingConfig(policy="session"))
    table = RoutingTable()
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(partial(server.run, config, table=table, handle_signals=False))
        while len(table.routable(THINKING_MODEL_NAME)) < len(engines):
            await table.wait_changed()
        yield url
        nursery.cancel_scope.cancel()


@dataclass
class Trial:
    """Both streams through the router, their engine stopped mid-answer."""

    thinking: Answer = field(default_factory=Answer)  # the reasoning stream's client
    calling: Answer = field(default_factory=Answer)  # the tool-call stream's client
    stopped: EngineProcess | None = None
    at_stop: tuple[str, str] | None = None  # the reasoning client's texts then
    counted: dict[tuple[str, str, str], float] = field(default_factory=dict)  # kind, reason,
    # outcome: trio_router_stream_resumes_total


def stop(engine: EngineProcess, how: signal.Signals) -> None:
    """SIGKILL to the engine's process group (everything dies at once), or SIGTERM to its API
    server alone (Kubernetes signals a container's main process)."""
    if how == signal.SIGKILL:
        os.killpg(engine.process.pid, how)
    else:
        os.kill(engine.process.pid, how)


async def stop_mid_answers(
    url: str,
    engines: list[EngineProcess],
    how: signal.Signals,
    bodies: tuple[Any, Any],
    trial: Trial,
) -> None:
    """The tool-call stream, then (once it reasons) the reasoning stream on the same engine
    (one session): begun later, the reasoning stream is still reasoning when the engine is
    stopped with `how`, once the tool call's arguments have begun."""
    reasoning, calling_body = bodies
    async with open_stream(url, calling_body, trial.calling) as calling:
        while not calling.answer.reasoning:
            await calling.step()
        victim = next(e for e in engines if e.url.endswith(calling.engine))

        def stop_in_arguments() -> None:
            arguments = any(made[1] for made in calling.answer.calls.values())
            going = trial.thinking.reasoning and not calling.answer.finish
            if arguments and going and trial.stopped is None:
                stop(victim, how)
                trial.stopped = victim
                trial.at_stop = (trial.thinking.reasoning, trial.thinking.content)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(calling.read_to_end, stop_in_arguments)
            async with open_stream(url, reasoning, trial.thinking) as thinking:
                assert thinking.engine == calling.engine  # one session, one engine
                await thinking.read_to_end()


async def resumes(client: httpx.AsyncClient, url: str) -> dict[tuple[str, str, str], float]:
    """trio_router_stream_resumes_total by (kind, reason, outcome)."""
    counted = {}
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("trio_router_stream_resumes_total{"):
            labels = dict(
                part.split("=", 1) for part in line.split("{", 1)[1].rsplit("}", 1)[0].split(",")
            )
            kind, reason, outcome = (labels[k].strip('"') for k in ("kind", "reason", "outcome"))
            counted[kind, reason, outcome] = float(line.rsplit(" ", 1)[1])
    return counted


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_reasoning_and_tool_call_streams_whose_engine_dies_are_carried_on(
    pair: Pair, how: signal.Signals
) -> None:
    """On 2 cores an engine's API server can be starved while it generates, so that the
    tool-call stream's whole answer reaches the client in one burst: an engine stopped then
    had nothing of it left to fail. Such a trial (a stream of the two not carried on at all)
    is run again, up to ATTEMPTS times; any other result is the test's."""
    with trio.fail_after(ATTEMPTS * 3 * LIMIT):
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            for _ in range(ATTEMPTS):
                await pair.revive()
                bodies = await requests(client, pair.engines[0])
                trial = Trial()
                async with open_router(pair.engines) as url:
                    try:
                        await stop_mid_answers(url, pair.engines, how, bodies, trial)
                    finally:
                        if trial.stopped is not None:
                            pair.stopped.append(trial.stopped)
                    trial.counted = await resumes(client, url)
                if trial.stopped is not None and sum(trial.counted.values()) >= 2:
                    break
            survivor = next(e for e in pair.engines if e is not trial.stopped)
            thinking = await straight(client, survivor, bodies[0])
            calling = await straight(client, survivor, bodies[1])
    assert trial.at_stop is not None
    assert trial.at_stop[0] and not trial.at_stop[1]  # stopped while it reasoned
    # The reasoning stream: the switch to content came where the script says.
    assert thinking.content == SENTENCE and thinking.finish == ["stop"]
    assert trial.thinking.said() == thinking.said()
    assert len(trial.thinking.heads) == 1
    # The tool-call stream: one call, one id, its arguments whole.
    assert calling.content == "ok " and calling.finish == ["tool_calls"]
    assert [made[:2] for made in calling.calls.values()] == [["get_weather", ARGUMENTS]]
    assert trial.calling.said() == calling.said()
    assert len(trial.calling.heads) == 1
    # Counted as what had passed of each: reasoning, and a tool call begun.
    kinds = {(kind, outcome): n for (kind, _, outcome), n in trial.counted.items()}
    assert kinds == {("reasoning", "resumed"): 1.0, ("tool_call", "resumed"): 1.0}, trial.counted
    # SIGTERM: vLLM ends the streams with an abort event, or (its engine core killed before
    # the aborts came back) leaves them open and silent until the stall bound.
    reasons = {"abort", "stall"} if how == signal.SIGTERM else {"closed", "reset"}
    assert {reason for _, reason, _ in trial.counted} <= reasons, trial.counted
