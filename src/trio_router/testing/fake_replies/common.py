"""What every fake reply is made of: `Reply`, vLLM's error shape, server-sent events, the
words a fake engine generates and the token ids it computes for a prompt."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = [
    "REPLY_TOKEN",
    "REPLY_WORDS",
    "SSE_DONE",
    "Handler",
    "Reply",
    "error_body",
    "generated_before",
    "n_tokens",
    "prompt_text",
    "prompt_tokens",
    "reply_words",
    "sse",
    "usage",
    "words",
]

REPLY_WORDS: Final = (
    "Hello",
    " from",
    " a",
    " fake",
    " OpenAI-compatible",
    " engine",
    " behind",
    " trio_router",
    ".",
    " This",
    " reply",
    " is",
    " streamed",
    " one",
    " token",
    " at",
    " a",
    " time",
    ".",
)
SSE_DONE: Final = b"data: [DONE]\n\n"
_ROLE_TOKENS: Final = {"system": 50_001, "user": 50_002, "assistant": 50_003, "tool": 50_004}
_GENERATION_PROMPT: Final = 50_010  # the chat template's "assistant, your turn"


def error_body(status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM's OpenAI server answers it."""
    kind = {
        400: "BadRequestError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        429: "RateLimitError",
    }.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class Reply:
    """A reply being built: status, body, and for streams the SSE events."""

    __slots__ = ("events", "payload", "status")

    def __init__(self, status: int, payload: Any = None, events: list[bytes] | None = None) -> None:
        self.status, self.payload, self.events = status, payload, events


# What answers one POST endpoint: (engine, request body, model, the engine's request id).
Handler: TypeAlias = "Callable[[FakeEngine, dict[str, Any], str, str], Reply]"


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event carrying `obj` as compact JSON, named `event` if given."""
    data = json.dumps(obj, separators=(",", ":"))
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {data}\n\n".encode()


def words(text: str) -> list[str]:
    """The whitespace-separated words of `text` (at least one, maybe empty)."""
    return text.split() or [""]


def _token_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 50_000 for w in words(text)]


def prompt_text(body: dict[str, Any]) -> str:
    """The text of a request's prompt or messages, for token counts."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                ]
        return " ".join(parts)
    for key in ("prompt", "input", "query", "text"):
        value = body.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return " ".join(str(v) for v in value)
    return ""


def prompt_tokens(request: dict[str, Any]) -> list[int]:
    """The token ids the fake engine computes for a request's prompt: for a chat, each
    message's role token and its words, then the generation prompt (the fake chat template);
    for a text prompt, its words. /tokenize answers with the same."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        prompt = request.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return _token_ids(prompt_text(request))
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        ids.append(_ROLE_TOKENS.get(str(message.get("role")), 50_000))
        ids += _token_ids(prompt_text({"messages": [message]}))
    if request.get("add_generation_prompt", True):
        ids.append(_GENERATION_PROMPT)
    return ids


def n_tokens(engine: FakeEngine, request: dict[str, Any], done: int = 0) -> tuple[int, str]:
    """How many tokens the engine generates for `request`, and the finish reason: its
    `tokens` knob (less the `done` ones its prompt already ends with), or the request's
    lower token limit ("length")."""
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    n = max(0, engine.tokens - done)
    if isinstance(limit, int) and 0 < limit < n:
        return limit, "length"
    return n, "stop"


def reply_words(n: int, start: int = 0) -> list[str]:
    """`n` generated tokens from position `start`: REPLY_WORDS, over and over."""
    return [REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(start, start + n)]


REPLY_TOKEN: Final = 70_000  # the id of the generated token at position i is REPLY_TOKEN + i


def generated_before(prompt: list[int]) -> int:
    """How many of its own generated tokens a prompt ends with (a continuation's prompt is
    the original's and the tokens generated so far: greedy, the engine goes on from there)."""
    done = 0
    for token in reversed(prompt):
        if token < REPLY_TOKEN:
            break
        done += 1
    for i, token in enumerate(prompt[len(prompt) - done :]):
        if token != REPLY_TOKEN + i:
            return 0
    return done


def usage(prompt: int, completion: int) -> dict[str, int]:
    """An OpenAI `usage` object."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
