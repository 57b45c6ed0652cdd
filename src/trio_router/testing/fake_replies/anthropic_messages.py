"""The Anthropic Messages API as vLLM serves it: /v1/messages (a message, or its event
stream) and /v1/messages/count_tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import Reply, error_body, n_tokens, prompt_text, reply_words, sse, words

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["count_tokens", "messages"]


def _anthropic_prompt(request: dict[str, Any]) -> int:
    """Input tokens of an Anthropic Messages request: its system prompt and messages' words."""
    system = request.get("system")
    texts = [system] if isinstance(system, str) else []
    texts.append(prompt_text(request))
    return sum(len(words(t)) for t in texts if t)


def messages(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """The Anthropic Messages API, as vLLM serves it (`/v1/messages`): a message, or with
    `stream` the event stream (message_start ... message_stop, no [DONE])."""
    if not isinstance(request.get("messages"), list) or not isinstance(
        request.get("max_tokens"), int
    ):
        return Reply(400, error_body(400, "`messages` and `max_tokens` are required"))
    n, finish = n_tokens(engine, request)
    text = reply_words(n)
    prompt = _anthropic_prompt(request)
    engine.prompt_tokens += prompt
    stop = "max_tokens" if finish == "length" else "end_turn"
    ident = f"chatcmpl-{engine.name}-{rid}"
    if not request.get("stream"):
        return Reply(
            200,
            {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": "".join(text)}],
                "model": model,
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": n},
            },
        )
    start: dict[str, Any] = {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0},
    }
    events = [
        sse({"type": "message_start", "message": start}, "message_start"),
        sse(
            {
                "type": "content_block_start",
                "content_block": {"type": "text", "text": ""},
                "index": 0,
            },
            "content_block_start",
        ),
    ]
    events += [
        sse(
            {
                "type": "content_block_delta",
                "delta": {"type": "text_delta", "text": w},
                "index": 0,
            },
            "content_block_delta",
        )
        for w in text
    ]
    events += [
        sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"input_tokens": prompt, "output_tokens": n},
            },
            "message_delta",
        ),
        sse({"type": "message_stop"}, "message_stop"),
    ]
    return Reply(200, events=events)


def count_tokens(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /v1/messages/count_tokens: the request's input tokens."""
    tokens = _anthropic_prompt(request)
    return Reply(
        200, {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
    )
