"""OpenAI chat and text completions as vLLM answers them: one JSON body, or with `stream` a
role-only first event, one event per token, the finish, an optional usage event and
`[DONE]`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .common import SSE_DONE, Reply, error_body, n_tokens, prompt_tokens, reply_words, sse, usage

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
    n, finish = n_tokens(engine, request)
    words = reply_words(n)
    tokens = prompt_tokens(request)
    prompt_count = len(tokens)
    engine.prompt_tokens += prompt_count
    if engine.kv is not None:
        engine.kv.serve(tokens)
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{engine.name}-{rid}"
    obj = "chat.completion" if chat else "text_completion"
    if not request.get("stream"):
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {
                "role": "assistant",
                "content": "".join(words),
                "tool_calls": [],
            }
        else:
            choice["text"] = "".join(words)
        return Reply(
            200,
            {
                "id": ident,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage(prompt_count, n),
            },
        )
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict[str, Any] | str, reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return sse(
            {
                "id": ident,
                "object": chunk_obj,
                "created": created,
                "model": model,
                "choices": [choice],
            }
        )

    events = [chunk({"role": "assistant", "content": ""} if chat else "", None)]
    events += [chunk({"content": w} if chat else w, None) for w in words]
    events.append(chunk({} if chat else "", finish))
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append(
            sse(
                {
                    "id": ident,
                    "object": chunk_obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(prompt_count, n),
                }
            )
        )
    events.append(SSE_DONE)
    return Reply(200, events=events)
