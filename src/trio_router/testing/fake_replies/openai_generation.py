"""OpenAI chat and text completions as vLLM answers them: one JSON body, or with `stream` a
role-only first event, one event per token, the finish, an optional usage event and
`[DONE]`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .common import (
    REPLY_TOKEN,
    SSE_DONE,
    Reply,
    error_body,
    generated_before,
    n_tokens,
    prompt_tokens,
    reply_words,
    sse,
    usage,
)
from .parsing import EOS_TOKEN, call_ids, delta, layout, parses
from .parsing import finish as parsed_finish

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["chat", "completions"]


def chat(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /v1/chat/completions."""
    if not isinstance(request.get("messages"), list):
        return Reply(400, error_body(400, "`messages` must be a list"))
    return _generation(engine, request, model, rid, chat=True)


def completions(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /v1/completions."""
    if "prompt" not in request:
        return Reply(400, error_body(400, "`prompt` is required"))
    return _generation(engine, request, model, rid, chat=False)


def _generation(
    engine: FakeEngine, request: dict[str, Any], model: str, rid: str, *, chat: bool
) -> Reply:
    tokens = prompt_tokens(request)
    done = generated_before(tokens)  # a continuation: greedy, it goes on from there
    n, finish = n_tokens(engine, request, done)
    words = reply_words(n, done)
    ids = [REPLY_TOKEN + done + i for i in range(n)]
    prompt_count = len(tokens)
    engine.prompt_tokens += prompt_count
    if engine.kv is not None:
        engine.kv.serve(tokens)
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{engine.name}-{rid}"
    if not request.get("stream"):
        return _whole(model, ident, created, words, prompt_count, finish, chat=chat)
    token_ids = engine.token_ids and request.get("return_token_ids") is True
    stream = _Stream(ident, created, model, chat=chat, token_ids=token_ids)
    events = [stream.first(tokens)]
    abort_at = engine.abort_streams_after
    deltas: list[Any] = [{"content": word} if chat else word for word in words]
    if chat and parses(engine):  # the parsers' answer: reasoning, tool calls
        deltas, ids, n, finish = _parsed(engine, request, rid, done)
    for i, (piece, token) in enumerate(zip(deltas, ids, strict=True)):
        if abort_at is not None and i >= abort_at:  # vLLM shutting down: its requests abort
            n, finish = i, "abort"
            break
        events.append(stream.chunk(piece, None, [token]))
    last: list[int] = []
    if chat and parses(engine) and finish in ("stop", "tool_calls"):
        last, n = [EOS_TOKEN], n + 1  # the end-of-answer token, counted as vLLM counts it
    events.append(stream.chunk({} if chat else "", finish, last))
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append(stream.usage(prompt_count, n))
    events.append(SSE_DONE)
    return Reply(200, events=events)


def _parsed(
    engine: FakeEngine, request: dict[str, Any], rid: str, done: int
) -> tuple[list[Any], list[int], int, str]:
    """A streamed chat's deltas and token ids through the engine's parsers, after the `done`
    tokens its prompt ends with; how many, and the finish."""
    pieces = layout(engine, request)
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    end = len(pieces)
    if isinstance(limit, int) and 0 < limit < end - done:
        end = done + limit
    calls = call_ids(engine, rid, pieces)
    deltas = [delta([piece], calls) for piece in pieces[done:end]]
    ids = [REPLY_TOKEN + i for i in range(done, end)]
    return deltas, ids, end - done, parsed_finish(pieces, end, end < len(pieces))


def _whole(
    model: str,
    ident: str,
    created: int,
    words: list[str],
    prompt_count: int,
    finish: str,
    *,
    chat: bool,
) -> Reply:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(words), "tool_calls": []}
    else:
        choice["text"] = "".join(words)
    obj = "chat.completion" if chat else "text_completion"
    body = {"id": ident, "object": obj, "created": created, "model": model, "choices": [choice]}
    body["usage"] = usage(prompt_count, len(words))
    return Reply(200, body)


class _Stream:
    """The events of one streamed answer, shaped as vLLM's (with `return_token_ids`: each
    chunk's token ids, and the prompt's in the first)."""

    def __init__(self, ident: str, created: int, model: str, *, chat: bool, token_ids: bool):
        self._head = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._chat, self._token_ids = chat, token_ids

    def first(self, prompt: list[int]) -> bytes:
        if self._chat:
            event = self._event({"role": "assistant", "content": ""}, None, None)
            if self._token_ids:
                event["prompt_token_ids"] = prompt
            return sse(event)
        return sse(self._event("", None, None, prompt=prompt if self._token_ids else None))

    def chunk(self, delta: dict[str, Any] | str, reason: str | None, ids: list[int]) -> bytes:
        return sse(self._event(delta, reason, ids if self._token_ids else None))

    def usage(self, prompt: int, completion: int) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage(prompt, completion)})

    def _event(
        self,
        delta: dict[str, Any] | str,
        reason: str | None,
        ids: list[int] | None,
        *,
        prompt: list[int] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        choice["delta" if self._chat else "text"] = delta
        choice["logprobs"], choice["finish_reason"] = None, reason
        if reason is not None:
            choice["stop_reason"] = None
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
        if ids is not None:
            choice["token_ids"] = ids
        return {**self._head, "choices": [choice]}
