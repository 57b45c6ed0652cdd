"""What a policy may know of a request: `RequestInfo`, read from the parsed body and headers by
`request_info` (the session key, and for `prefix_aware` the conversation's opening); and what
it decides: `Decision`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..config import RoutingConfig
from ..errors import BadRequestError
from ..table import Engine

__all__ = [
    "Decision",
    "RequestInfo",
    "adapter_of",
    "is_adapter",
    "render_opening",
    "request_info",
    "request_reads",
]

_ROLE_SEP, _MESSAGE_SEP = "\x1f", "\x1e"  # separators that do not occur in ordinary text
_HEADER_ROLES: Final = frozenset({"system", "developer"})  # a conversation's shared header


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know of a request."""

    model: str
    session_key: str | None = None  # routing.session_header, else body["user"], else None
    opening: str | None = None  # prefix_aware: the conversation's opening (`render_opening`)
    tokens: tuple[int, ...] | None = None  # kv_aware: the prompt's token ids, if known


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's choice: the engine, a short reason for the decision log, and for a choice
    made on the prompt's token ids (`kv_aware`) the prompt tokens it expects `engine` to hold
    cached (`cached_tokens`, None otherwise) of `prompt_tokens`, and with the time cost the
    wait for a first token it predicts there (`predicted_ttft`, seconds)."""

    engine: Engine
    reason: str
    cached_tokens: int | None = None
    prompt_tokens: int = 0
    predicted_ttft: float | None = None  # kv_aware's time cost: seconds to a first token
    # ...and where to report how far off it was (seconds late; negative: early)
    observe_ttft: Callable[[float], None] | None = None
    # called once the answer's first bytes reach the client (kv_aware: its prefill is done)
    started: Callable[[], None] | None = None


def adapter_of(model: str, engine: Engine) -> str | None:
    """The base model `model` is a LoRA adapter of on `engine` (its parent in the engine's
    `/v1/models`: vLLM lists adapters so), or None (a base model, or not served there)."""
    for entry in engine.models:
        if entry.id == model:
            return entry.parent
    return None


def is_adapter(model: str, candidates: Sequence[Engine]) -> bool:
    """Whether `model` is a LoRA adapter on `candidates`, the engines serving it (as the
    first of them lists it)."""
    return bool(candidates) and adapter_of(model, candidates[0]) is not None


def request_info(
    body: dict[str, Any],
    headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]],
    config: RoutingConfig,
) -> RequestInfo:
    """The routing facts of a parsed request body. `headers` is a mapping with lower-case
    names, or ASGI's list of (name, value) byte pairs. The opening is read for `prefix_aware`
    only, and is bounded (`render_opening`). Raises BadRequestError when the body has no
    "model" string."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError('the request body needs a "model" string')
    key = _header(headers, config.session_header)
    if not key:
        user = body.get("user")
        key = user if isinstance(user, str) and user else None
    opening = None
    if config.policy in ("prefix_aware", "kv_aware"):  # kv_aware falls back to prefix_aware
        opening = render_opening(
            body,
            limit=config.prefix_chunk_chars * config.prefix_max_chunks,
            text_limit=config.prefix_text_chars,
            header_chars=config.prefix_header_chars,
        )
    return RequestInfo(model=model, session_key=key, opening=opening)


def request_reads(config: RoutingConfig) -> frozenset[str]:
    """The members of a body that `request_info` reads under `config`."""
    if config.policy in ("prefix_aware", "kv_aware"):
        return frozenset({"model", "user", "messages", "prompt"})
    return frozenset({"model", "user"})


def _header(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    if isinstance(headers, Mapping):
        value = headers.get(name.lower(), headers.get(name))
        return value if isinstance(value, str) else None
    wanted = name.lower().encode("latin-1")
    for key, raw in headers:
        if key.lower() == wanted:
            return raw.decode("latin-1")
    return None


def render_opening(
    body: Mapping[str, Any], *, limit: int, text_limit: int, header_chars: int = 1 << 20
) -> str | None:
    """What stands for a conversation in every one of its turns: for chat, its leading
    system (or developer) messages, rendered, when they are at least `header_chars` long
    (requests that share a long system prompt, or a document in it, share the key whatever
    follows), else those and the first message after them; at most `limit` characters. For a
    text prompt, its first `text_limit` characters. Later turns only append messages, so
    every turn of a conversation has the same opening. None when the body has neither."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return _render_text_prompt(body.get("prompt"), text_limit)
    parts: list[str] = []
    size = 0
    for message in messages:
        if isinstance(message, dict):
            header = message.get("role") in _HEADER_ROLES
            if not header and size >= header_chars:
                break  # a long header is the key alone
            text = _render_message(message)
            parts.append(text)
            size += len(text)
            if size >= limit or not header:
                break
    return "".join(parts)[:limit] if parts else None


def _render_message(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str) and len(message) == 2:  # {"role", "content"}: the common case
        return f"{message.get('role', '')}{_ROLE_SEP}{content}{_MESSAGE_SEP}"
    pieces = [str(message.get("role", "")), _ROLE_SEP]
    if isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                pieces.append(text)
                continue
            kind = part.get("type")
            value = part.get(kind) if isinstance(kind, str) else None
            pieces.append(
                f"<{kind}:{value.get('url', '')}>" if isinstance(value, dict) else f"<{kind}>"
            )
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                pieces.append(f"<call {function.get('name')}:{function.get('arguments')}>")
    if isinstance(call_id := message.get("tool_call_id"), str):
        pieces.append(f"<result {call_id}>")
    pieces.append(_MESSAGE_SEP)
    return "".join(pieces)


def _render_text_prompt(prompt: Any, limit: int) -> str | None:
    """A completions `prompt` (text, texts, or token ids) as one string of at most `limit`
    characters; None when there is none."""
    if isinstance(prompt, str):
        return prompt[:limit]
    if not isinstance(prompt, list) or not prompt:
        return None
    items = prompt[:limit]
    if all(isinstance(t, int) for t in items):  # token ids
        return ",".join(map(str, items))[:limit]
    parts: list[str] = []  # a batch: texts or token-id lists, each followed by a separator
    size = 0
    for item in items:
        text = (
            item[:limit]
            if isinstance(item, str)
            else ",".join(map(str, item[:limit]))
            if isinstance(item, list)
            else ""
        )
        parts += (text, _MESSAGE_SEP)
        size += len(text) + 1
        if size >= limit:
            break
    return "".join(parts)[:limit]
