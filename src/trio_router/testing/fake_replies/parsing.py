"""A fake engine's reasoning and tool parsers, and vLLM's scale-out endpoints that use them.

With `FakeEngine.reasoning_tokens` or `FakeEngine.tool_calls` set, a chat's greedy answer is a
`layout`: one `Piece` per generated token (the token at position i is REPLY_TOKEN + i, as
every answer of a fake engine): reasoning words, a marker that ends the reasoning (a token
with no delta, like `</think>`), then either the tool calls (when the request offers tools
and does not say "none": an opening marker, the function's name, its arguments a few
characters a token, a closing marker) or content words. Streamed, each token is one event
whose delta is its piece's (`delta`): `reasoning`, `content`, or `tool_calls` (the name's
token brings the call's `id` and `type`); a marker's event has an empty delta. The answer's
finish is "tool_calls" when it made a call.

With `FakeEngine.scale_out` (vLLM's `--enable-scale-out`), the engine also serves
`/v1/chat/completions/render` (the chat's prompt token ids and sampling parameters),
`/inference/v1/generate` (token ids in, token ids out: the answer's pieces after those the
prompt already ends with) and `/v1/chat/completions/derender` (one generate chunk and the
client's `stream_state` -> the chat chunk of those tokens and the next state; the tool calls
whose ids the state pins keep them, a call the state does not know gets a fresh id of this
engine's). Derender's deltas carry every member, null or empty where unused, as vLLM's
pydantic models dump them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .common import (
    REPLY_TOKEN,
    SSE_DONE,
    Reply,
    error_body,
    generated_before,
    prompt_tokens,
    reply_words,
    sse,
)

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["EOS_TOKEN", "Piece", "delta", "derender", "generate", "layout", "render"]

ARGUMENT_CHARS: Final = 6  # characters of a call's arguments per token
EOS_TOKEN: Final = 2  # the end of an answer (its text, to a detokenizer that shows it)
EOS_TEXT: Final = "<|im_end|>"
_fresh = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Piece:
    """What one generated token is to the parsers: `kind` is "reasoning", "content",
    "marker" (no delta), "name" (a call's function name: the call begins) or "arguments";
    `call` is the tool call's index."""

    kind: str
    text: str = ""
    call: int = 0


_EOS_PIECE: Final = Piece("content", EOS_TEXT)


def parses(engine: FakeEngine) -> bool:
    """The engine has a reasoning or a tool parser."""
    return engine.reasoning_tokens > 0 or bool(engine.tool_calls)


def layout(engine: FakeEngine, request: dict[str, Any]) -> list[Piece]:
    """The whole greedy answer to a chat `request`, one piece per token."""
    pieces = [Piece("reasoning", word) for word in reply_words(engine.reasoning_tokens)]
    if pieces:
        pieces.append(Piece("marker"))
    calling = engine.tool_calls and request.get("tools") and request.get("tool_choice") != "none"
    if not calling:
        start = len(pieces)
        pieces += [Piece("content", word) for word in reply_words(engine.tokens, start)]
        return pieces
    for index, (name, arguments) in enumerate(engine.tool_calls):
        pieces += [Piece("marker", call=index), Piece("name", name, index)]
        for at in range(0, len(arguments), ARGUMENT_CHARS):
            pieces.append(Piece("arguments", arguments[at : at + ARGUMENT_CHARS], index))
        pieces.append(Piece("marker", call=index))
    return pieces


def delta(pieces: list[Piece], ids: dict[int, str]) -> dict[str, Any]:
    """The chat delta of consecutive `pieces` (a stream's event, or a derender chunk);
    `ids`: each tool call's id by index."""
    out: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if piece.kind in ("reasoning", "content"):
            out[piece.kind] = out.get(piece.kind, "") + piece.text
        elif piece.kind == "name":
            begun: dict[str, Any] = {"id": ids[piece.call], "type": "function"}
            begun |= {"index": piece.call, "function": {"name": piece.text, "arguments": ""}}
            calls[piece.call] = begun
        elif piece.kind == "arguments":
            call = calls.setdefault(piece.call, {"index": piece.call, "function": {}})
            arguments = call["function"].get("arguments", "") + piece.text
            call["function"]["arguments"] = arguments
    if calls:  # as vLLM writes a tool call's delta: a null content first
        out = {"content": out.get("content"), **out, "tool_calls": list(calls.values())}
    return out


def finish(pieces: list[Piece], n: int, limited: bool) -> str:
    """The finish of an answer of the first `n` pieces (`limited`: cut by its token limit)."""
    if limited:
        return "length"
    return "tool_calls" if any(p.kind == "name" for p in pieces[:n]) else "stop"


def call_ids(engine: FakeEngine, rid: str, pieces: list[Piece]) -> dict[int, str]:
    """This engine's ids for an answer's tool calls."""
    names = (p for p in pieces if p.kind == "name")
    return {p.call: f"chatcmpl-tool-{engine.name}-{rid}-{p.call}" for p in names}


def render(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /v1/chat/completions/render: the GenerateRequest the chat amounts to."""
    keys = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop")
    params: dict[str, Any] = {"temperature": 1.0, "max_tokens": None}
    params |= {key: request[key] for key in keys if key in request}
    if "max_completion_tokens" in request:
        params["max_tokens"] = request["max_completion_tokens"]
    body: dict[str, Any] = {"request_id": f"render-{rid}", "token_ids": prompt_tokens(request)}
    body |= {"sampling_params": params, "model": model, "stream": False}
    # What the fake generate needs of the chat (whether it offers tools), where vLLM's
    # render puts what its engine-side parsers need.
    offers = bool(request.get("tools")) and request.get("tool_choice") != "none"
    body["reasoning_parser_kwargs"] = {"chat_template_kwargs": {"fake_tools": offers}}
    return Reply(200, body)


def generate(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /inference/v1/generate (streamed): the answer's tokens after those the prompt
    ends with, each an event of token ids, then the finish and [DONE]."""
    prompt = request.get("token_ids")
    params = request.get("sampling_params")
    if not isinstance(prompt, list) or not prompt or not isinstance(params, dict):
        return Reply(400, error_body(400, "`token_ids` and `sampling_params` are required"))
    done = generated_before(prompt)
    kwargs = (request.get("reasoning_parser_kwargs") or {}).get("chat_template_kwargs") or {}
    chat: dict[str, Any] = {"tools": [{}]} if kwargs.get("fake_tools") else {}
    total = len(layout(engine, chat))
    left = max(0, total - done)
    limit = params.get("max_tokens")
    n = min(left, limit) if isinstance(limit, int) else left
    engine.prompt_tokens += len(prompt)
    events = []
    for i in range(n):
        choice = {"index": 0, "token_ids": [REPLY_TOKEN + done + i], "finish_reason": None}
        events.append(sse({"request_id": rid, "choices": [choice]}))
    reason = "length" if n < left else "stop"
    events.append(sse({"request_id": rid, "choices": [_ended(reason)]}))
    return Reply(200, events=[*events, SSE_DONE])


def _ended(reason: str) -> dict[str, Any]:
    """The finish event: a stop's carries the end-of-answer token, as vLLM's does."""
    ids = [EOS_TOKEN] if reason == "stop" else []
    return {"index": 0, "token_ids": ids, "finish_reason": reason, "stop_reason": None}


def derender(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /v1/chat/completions/derender (stream=true): one generate chunk -> one chat
    chunk and the next state (see the module's docstring)."""
    state = request.get("stream_state") or {}
    chunk = request.get("generate_chunk") or {}
    chat = request.get("chat_request")
    if not isinstance(chat, dict) or not isinstance(request.get("prompt_token_ids"), list):
        return Reply(400, error_body(400, "chat_request and prompt_token_ids are required"))
    engine.derenders += 1
    choice = (chunk.get("choices") or [{}])[0]
    ids, before = list(choice.get("token_ids") or ()), list(state.get("output_token_ids") or ())
    pieces = layout(engine, chat)
    # A token not of the answer's pieces (the end-of-answer token) is decoded as its text,
    # as vLLM's derender does: a router leaves it out.
    new = [
        pieces[t - REPLY_TOKEN]
        if 0 <= t - REPLY_TOKEN < len(pieces)
        else Piece("content", EOS_TEXT)
        for t in ids
    ]
    pinned = list(state.get("last_tool_call_ids") or ())
    for piece in new:
        if piece.kind == "name" and piece.call >= len(pinned):
            pinned += [""] * (piece.call + 1 - len(pinned))
        if piece.kind == "name" and not pinned[piece.call]:
            pinned[piece.call] = f"chatcmpl-tool-{engine.name}-d{next(_fresh)}-{piece.call}"
    shown = delta(new, dict(enumerate(pinned)))
    streamed = bool(state.get("tools_streamed")) or "tool_calls" in shown
    reason = choice.get("finish_reason")
    if reason == "stop" and streamed:
        reason = "tool_calls"
    full = {"role": None, "content": None, "reasoning": None, "tool_calls": []} | shown
    out: dict[str, Any] = {"index": 0, "delta": full, "logprobs": None, "finish_reason": reason}
    out |= {"stop_reason": choice.get("stop_reason"), "token_ids": None}
    head: dict[str, Any] = {"id": f"chatcmpl-{engine.name}-{rid}"}
    head["object"] = "chat.completion.chunk"
    head |= {"created": int(time.time()), "model": model}
    lens = list(state.get("output_chunk_lens") or ())
    next_state = {
        **state,
        "output_token_ids": before + ids,
        "output_chunk_lens": lens + ([len(ids)] if ids else []),
        "role_sent": True,
        "tools_streamed": streamed,
        "last_tool_call_ids": pinned,
    }
    return Reply(200, {"chunk": {**head, "choices": [out]}, "stream_state": next_state})
