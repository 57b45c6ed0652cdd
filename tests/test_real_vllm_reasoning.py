"""Reasoning streams at a real vLLM engine: the thinking model of
`trio_router.testing.vllm_engines` (`EngineSpec(thinking=True)`: `<think>`/`</think>` and
`<tool_call>` markers, a template that opens a think block, vLLM's `deepseek_r1` reasoning
parser and `hermes` tool parser, the launcher's ScriptedTokens logits processor) with the
scale-out routes open. One engine of its own, on an address and port the tier's engines do not
use, started once for the module.

What is checked is the wire a router relies on to carry such a stream on elsewhere: reasoning
deltas come with their token ids, a script ends the reasoning where it says on any engine, and
a stream cut after some events is continued token for token by `/inference/v1/generate` from
the prompt plus the tokens already sent, each event turned into a chat delta by
`/v1/chat/completions/derender` from a state built out of what the client saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import httpx
import pytest
import trio

from trio_router.testing import vllm_engines
from trio_router.testing.vllm_engines import (
    THINKING_MODEL_NAME,
    EngineEnvironment,
    EngineProcess,
    EngineSpec,
)

pytestmark = pytest.mark.real_vllm

LIMIT: Final = 120.0  # seconds: bounds a hang; a machine busy with engines is slow
HOST: Final = "127.0.1.31"  # not one of the tier's (127.0.1.11, 127.0.1.12)
THINK: Final = 4096  # the thinking model's `<think>`
END_THINK: Final = 4097  # and its `</think>`
EOS: Final = 2  # `<|im_end|>`
CHAT: Final = "/v1/chat/completions"
MESSAGES: Final = [
    {"role": "system", "content": "you are a test"},
    {"role": "user", "content": "say a few words"},
]


@pytest.fixture(scope="module")
def thinker(
    vllm_env: EngineEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """One thinking engine with the scale-out routes, for this module."""
    spec = EngineSpec(
        host=HOST,
        port=vllm_engines.free_port([HOST]),
        core=1,
        max_num_seqs=4,
        thinking=True,
        scale_out=True,
    )
    log_dir = tmp_path_factory.mktemp("vllm-thinker-logs")
    with vllm_engines.running_engines(vllm_env, [spec], log_dir=log_dir) as (engine,):
        yield engine


def chat_request(**extra: Any) -> dict[str, Any]:
    return {
        "model": THINKING_MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def events(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    """The JSON events of a streamed answer (`[DONE]` checked and left out)."""
    async with client.stream("POST", url, json=body) as answer:
        assert answer.status_code == 200, await answer.aread()
        lines = [line async for line in answer.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def choices(stream: list[Any]) -> list[Any]:
    return [choice for event in stream for choice in event["choices"]]


def texts(stream: list[Any]) -> tuple[str, str]:
    """The reasoning and the content a stream's deltas add up to."""
    deltas = [choice["delta"] for choice in choices(stream)]
    return (
        "".join(d.get("reasoning") or "" for d in deltas),
        "".join(d.get("content") or "" for d in deltas),
    )


async def tokens_of(client: httpx.AsyncClient, engine: EngineProcess, text: str) -> list[int]:
    answer = await client.post(
        f"{engine.url}/tokenize",
        json={"model": THINKING_MODEL_NAME, "prompt": text, "add_special_tokens": False},
    )
    return list(answer.json()["tokens"])


async def test_a_reasoning_stream_carries_its_token_ids(thinker: EngineProcess) -> None:
    """The greedy answer of random weights never leaves the think block its prompt opened:
    every delta is reasoning, with the ids of its tokens."""
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            stream = await events(client, f"{thinker.url}{CHAT}", chat_request(max_tokens=24))
    role, *deltas = choices(stream)
    assert role["delta"] == {"role": "assistant", "content": ""}
    assert stream[0]["prompt_token_ids"][-2] == THINK  # the prompt ends `<think>\n`
    assert all(set(c["delta"]) == {"reasoning"} and c["token_ids"] for c in deltas)
    assert sum(len(c["token_ids"]) for c in deltas) == 24
    assert deltas[-1]["finish_reason"] == "length"
    assert stream[-1]["usage"]["completion_tokens"] == 24
    reasoning, content = texts(stream)
    assert reasoning and not content


async def test_a_script_ends_the_reasoning_where_it_says(thinker: EngineProcess) -> None:
    """ScriptedTokens puts `</think>`, a sentence and the end of the answer at the prompt's
    length + 5: five tokens of reasoning, then the sentence as content."""
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            sentence = await tokens_of(client, thinker, " the water is good")
            counted = await client.post(
                f"{thinker.url}/tokenize",
                json={"model": THINKING_MODEL_NAME, "messages": MESSAGES},
            )
            script_at = counted.json()["count"] + 5
            body = chat_request(
                max_tokens=40,
                vllm_xargs={"script_at": script_at, "script": [END_THINK, *sentence, EOS]},
            )
            stream = await events(client, f"{thinker.url}{CHAT}", body)
    deltas = choices(stream)[1:]  # one event may carry several tokens: a busy machine
    ids = [token for choice in deltas for token in choice["token_ids"]]
    assert ids[5:] == [END_THINK, *sentence, EOS]
    switch = next(i for i, choice in enumerate(deltas) if END_THINK in choice["token_ids"])
    assert all(set(choice["delta"]) == {"reasoning"} for choice in deltas[:switch])
    assert all(set(choice["delta"]) <= {"content"} for choice in deltas[switch + 1 :])
    assert texts(stream)[1] == " the water is good"
    assert deltas[-1]["finish_reason"] == "stop"


def without_stop_token(event: dict[str, Any]) -> dict[str, Any]:
    """A generate event as derender must get it: an answer that ended on a stop token (eos
    or one of `stop_token_ids`; `stop_reason` is then null or that id, not a string) has it
    last in its ids, and the engine's own detokenizer leaves its text out; derender decodes
    special tokens (its parsers need the markers) and would add `<|im_end|>` to the text."""
    event = json.loads(json.dumps(event))
    for choice in event["choices"]:
        if choice["finish_reason"] == "stop" and not isinstance(choice["stop_reason"], str):
            choice["token_ids"] = choice["token_ids"][:-1]
    return event


def cut(stream: list[Any], most: int) -> list[Any]:
    """The first choices of `stream` that carry tokens, at most `most` tokens in all (at least
    one choice)."""
    carrying = [choice for choice in choices(stream) if choice.get("token_ids")]
    seen = carrying[:1]
    for choice in carrying[1:]:
        if sum(len(c["token_ids"]) for c in seen) + len(choice["token_ids"]) > most:
            break
        seen.append(choice)
    return seen


async def derendered(
    client: httpx.AsyncClient,
    engine: EngineProcess,
    prompt: list[int],
    seen: list[Any],
    generated: list[Any],
) -> list[Any]:
    """The chat chunks of `generated` (a continuation of a stream whose client saw the
    choices `seen`), one derender call each, the state carried from call to call."""
    state: dict[str, Any] = {
        "output_token_ids": [token for choice in seen for token in choice["token_ids"]],
        "output_chunk_lens": [len(choice["token_ids"]) for choice in seen],
        "role_sent": True,
        "tools_streamed": False,
        "last_tool_call_ids": [],
    }
    chunks = []
    for event in generated:
        answer = await client.post(
            f"{engine.url}{CHAT}/derender",
            json={
                "stream": True,
                "generate_chunk": without_stop_token(event),
                "stream_state": state,
                "prompt_token_ids": prompt,
                "prompt_tokens": len(prompt),
                "chat_request": {"messages": [], "return_token_ids": True},
            },
        )
        assert answer.status_code == 200, answer.text
        state = answer.json()["stream_state"]
        chunks.append(answer.json()["chunk"])
    return chunks


async def test_a_cut_stream_is_continued_by_generate_and_derender(thinker: EngineProcess) -> None:
    """A scripted stream (reasoning, then content) cut after at most 6 tokens, before the
    switch: the prompt's ids and the ids sent are generated on from, and each generated event
    derendered with the state carried along; what the client saw plus the derendered deltas
    is the uninterrupted stream's text, and the generated ids its ids."""
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            sentence = await tokens_of(client, thinker, " the water is good")
            render = await client.post(f"{thinker.url}{CHAT}/render", json=chat_request())
            prompt = render.json()["token_ids"]
            script = {"script_at": len(prompt) + 10, "script": [END_THINK, *sentence, EOS]}
            whole = await events(
                client, f"{thinker.url}{CHAT}", chat_request(max_tokens=40, vllm_xargs=script)
            )
            seen = cut(whole, 6)
            sent = [token for choice in seen for token in choice["token_ids"]]
            params = render.json()["sampling_params"] | {
                "max_tokens": 40 - len(sent),
                "extra_args": script,
            }
            generated = await events(
                client,
                f"{thinker.url}/inference/v1/generate",
                {"token_ids": prompt + sent, "sampling_params": params, "stream": True},
            )
            continued = await derendered(client, thinker, prompt, seen, generated)
    reasoning, content = texts(whole)
    assert content == " the water is good"  # the switch came after the cut
    head = texts([{"choices": seen}])
    tail = texts(continued)
    assert (head[0] + tail[0], head[1] + tail[1]) == (reasoning, content)
    whole_ids = [token for choice in choices(whole) for token in choice.get("token_ids") or []]
    assert sent + [token for c in choices(generated) for token in c["token_ids"]] == whole_ids
    assert choices(continued)[-1]["finish_reason"] == "stop"
