"""What the fake engine answers: the bodies of vLLM's OpenAI endpoints, as pure functions of
the engine's knobs and the request (`POST_HANDLERS`), and vLLM's error shape. The ASGI side,
timing and observations are `fake_engine.FakeEngineApp`'s."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from .fake_engine import FakeEngine

__all__ = [
    "POST_HANDLERS",
    "REPLY_WORDS",
    "SSE_DONE",
    "Reply",
    "error_body",
    "stored_response",
    "transcription",
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
EMBEDDING_DIM: Final = 8
SSE_DONE: Final = b"data: [DONE]\n\n"


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


def _sse(obj: Any, event: str | None = None) -> bytes:
    data = json.dumps(obj, separators=(",", ":"))
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {data}\n\n".encode()


def _words(text: str) -> list[str]:
    return text.split() or [""]


def _token_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 50_000 for w in _words(text)]


def _embedding(text: str) -> list[float]:
    seed = zlib.crc32(text.encode())
    return [round(((seed >> (i * 3)) % 1000) / 1000.0 - 0.5, 6) for i in range(EMBEDDING_DIM)]


def _score(a: str, b: str) -> float:
    return round((zlib.crc32(f"{a}\x00{b}".encode()) % 10_000) / 10_000.0, 6)


def _prompt_text(body: dict[str, Any]) -> str:
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


def _texts(value: Any) -> list[str]:
    """An embeddings/score input as a list of texts (token-id lists count as one text)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return [" ".join(map(str, value))]
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [""]


def n_tokens(engine: FakeEngine, request: dict[str, Any]) -> tuple[int, str]:
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    n = engine.tokens
    if isinstance(limit, int) and 0 < limit < n:
        return limit, "length"
    return n, "stop"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def generation(
    engine: FakeEngine, request: dict[str, Any], model: str, rid: str, *, chat: bool
) -> Reply:
    n, finish = n_tokens(engine, request)
    words = [REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(n)]
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
        return _sse(
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
            _sse(
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


def chat(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    if not isinstance(request.get("messages"), list):
        return Reply(400, error_body(400, "`messages` must be a list"))
    return generation(engine, request, model, rid, chat=True)


def completions(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    if "prompt" not in request:
        return Reply(400, error_body(400, "`prompt` is required"))
    return generation(engine, request, model, rid, chat=False)


def _vectors(
    request: dict[str, Any], model: str, ident: str, item: Callable[[int, str], dict[str, Any]]
) -> Reply:
    """A pooling model's answer: one `item` per input text, and the prompt's usage."""
    texts = _texts(request.get("input"))
    tokens = sum(len(_words(t)) for t in texts)
    return Reply(
        200,
        {
            "id": ident,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [item(i, t) for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        },
    )


def embeddings(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    return _vectors(
        request,
        model,
        f"embd-{rid}",
        lambda i, t: {"object": "embedding", "index": i, "embedding": _embedding(t)},
    )


_ROLE_TOKENS: Final = {"system": 50_001, "user": 50_002, "assistant": 50_003, "tool": 50_004}
_GENERATION_PROMPT: Final = 50_010  # the chat template's "assistant, your turn"


def prompt_tokens(request: dict[str, Any]) -> list[int]:
    """The token ids the fake engine computes for a request's prompt: for a chat, each
    message's role token and its words, then the generation prompt (the fake chat template);
    for a text prompt, its words. /tokenize answers with the same."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        prompt = request.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return _token_ids(_prompt_text(request))
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        ids.append(_ROLE_TOKENS.get(str(message.get("role")), 50_000))
        ids += _token_ids(_prompt_text({"messages": [message]}))
    if request.get("add_generation_prompt", True):
        ids.append(_GENERATION_PROMPT)
    return ids


def tokenize(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    ids = prompt_tokens(request)
    return Reply(
        200,
        {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        },
    )


def detokenize(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    tokens = request.get("tokens")
    if not isinstance(tokens, list):
        return Reply(400, error_body(400, "`tokens` must be a list of ints"))
    return Reply(200, {"prompt": " ".join(f"tok{t}" for t in tokens)})


def rerank(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    query = str(request.get("query", ""))
    docs = _texts(request.get("documents", []))
    ranked = sorted(range(len(docs)), key=lambda i: -_score(query, docs[i]))
    results = [
        {"index": i, "document": {"text": docs[i]}, "relevance_score": _score(query, docs[i])}
        for i in ranked
    ]
    top_n = request.get("top_n")
    if isinstance(top_n, int) and top_n > 0:
        results = results[:top_n]
    tokens = len(_words(query)) + sum(len(_words(d)) for d in docs)
    return Reply(
        200,
        {
            "id": f"rerank-{rid}",
            "model": model,
            "usage": {"total_tokens": tokens},
            "results": results,
        },
    )


def score(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    first = _texts(request.get("text_1", request.get("queries", "")))
    second = _texts(request.get("text_2", request.get("documents", "")))
    if len(first) == 1:
        first = first * len(second)
    pairs = list(zip(first, second, strict=False))
    tokens = sum(len(_words(a)) + len(_words(b)) for a, b in pairs)
    return Reply(
        200,
        {
            "id": f"score-{rid}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [
                {"index": i, "object": "score", "score": _score(a, b)}
                for i, (a, b) in enumerate(pairs)
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        },
    )


def responses(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """vLLM's Responses API: the response's id is the request's `request_id` (vLLM's own
    default when there is none), stored unless `store` is false (vLLM with
    VLLM_ENABLE_RESPONSES_API_STORE=1), found again by `previous_response_id`; `background`
    answers at once with the response in progress."""
    previous = request.get("previous_response_id")
    if previous is not None and previous not in engine.stored_responses:
        return _response_not_found(previous)
    n, _ = n_tokens(engine, {"max_tokens": request.get("max_output_tokens")})
    words = [REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(n)]
    prompt_tokens = len(_words(_prompt_text(request)))
    ident = request.get("request_id") or f"resp_{engine.name}_{rid}"
    msg_id = f"msg_{rid}"
    created = int(time.time())

    def response(status: str, text: str | None) -> dict[str, Any]:
        output = (
            []
            if text is None
            else [
                {
                    "type": "message",
                    "id": msg_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        )
        return {
            "id": ident,
            "object": "response",
            "created_at": created,
            "model": model,
            "status": status,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": None
            if text is None
            else {
                "input_tokens": prompt_tokens,
                "output_tokens": n,
                "total_tokens": prompt_tokens + n,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    if request.get("background"):
        stored = engine.stored_responses[ident] = response("in_progress", None)
        return Reply(200, stored)
    if request.get("store", True):
        engine.stored_responses[ident] = response("completed", "".join(words))
    if not request.get("stream"):
        return Reply(200, response("completed", "".join(words)))
    events = [
        _sse(
            {
                "type": "response.created",
                "sequence_number": 0,
                "response": response("in_progress", None),
            },
            "response.created",
        )
    ]
    for i, w in enumerate(words):
        events.append(
            _sse(
                {
                    "type": "response.output_text.delta",
                    "sequence_number": i + 1,
                    "item_id": msg_id,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": w,
                    "logprobs": [],
                },
                "response.output_text.delta",
            )
        )
    events.append(
        _sse(
            {
                "type": "response.completed",
                "sequence_number": n + 1,
                "response": response("completed", "".join(words)),
            },
            "response.completed",
        )
    )
    return Reply(200, events=events)


def _response_not_found(response_id: str) -> Reply:
    return Reply(
        404, error_body(404, f"Response with id '{response_id}' not found.", param="response_id")
    )


def stored_response(engine: FakeEngine, response_id: str, *, cancel: bool) -> Reply:
    """GET /v1/responses/{id}, POST /v1/responses/{id}/cancel, as vLLM answers them."""
    stored = engine.stored_responses.get(response_id)
    if stored is None:
        return _response_not_found(response_id)
    if cancel:
        if stored["status"] not in ("queued", "in_progress"):
            return Reply(
                400, error_body(400, "Cannot cancel a synchronous response.", param="response_id")
            )
        stored["status"] = "cancelled"
    return Reply(200, stored)


def transcription(
    engine: FakeEngine, fields: dict[str, str], model: str, rid: str, *, translate: bool
) -> Reply:
    """/v1/audio/transcriptions and /translations: the form's fields read (the file
    ignored), the text as JSON or, with `stream`, as vLLM's transcription chunks."""
    n, _ = n_tokens(engine, {})
    words = [REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(n)]
    if fields.get("stream", "false").lower() not in ("true", "1"):
        return Reply(200, {"text": "".join(words), "usage": {"type": "duration", "seconds": 1}})
    kind = "translation" if translate else "transcription"
    events = [
        _sse(
            {
                "id": f"trsc-{rid}",
                "object": f"{kind}.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [{"delta": {"content": w}}],
            }
        )
        for w in words
    ]
    return Reply(200, events=[*events, SSE_DONE])


def _anthropic_prompt(request: dict[str, Any]) -> int:
    """Input tokens of an Anthropic Messages request: its system prompt and messages' words."""
    system = request.get("system")
    texts = [system] if isinstance(system, str) else []
    texts.append(_prompt_text(request))
    return sum(len(_words(t)) for t in texts if t)


def messages(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """The Anthropic Messages API, as vLLM serves it (`/v1/messages`): a message, or with
    `stream` the event stream (message_start ... message_stop, no [DONE])."""
    if not isinstance(request.get("messages"), list) or not isinstance(
        request.get("max_tokens"), int
    ):
        return Reply(400, error_body(400, "`messages` and `max_tokens` are required"))
    n, finish = n_tokens(engine, request)
    words = [REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(n)]
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
                "content": [{"type": "text", "text": "".join(words)}],
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
        _sse({"type": "message_start", "message": start}, "message_start"),
        _sse(
            {
                "type": "content_block_start",
                "content_block": {"type": "text", "text": ""},
                "index": 0,
            },
            "content_block_start",
        ),
    ]
    events += [
        _sse(
            {
                "type": "content_block_delta",
                "delta": {"type": "text_delta", "text": w},
                "index": 0,
            },
            "content_block_delta",
        )
        for w in words
    ]
    events += [
        _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        _sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"input_tokens": prompt, "output_tokens": n},
            },
            "message_delta",
        ),
        _sse({"type": "message_stop"}, "message_stop"),
    ]
    return Reply(200, events=events)


def count_tokens(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    tokens = _anthropic_prompt(request)
    return Reply(
        200, {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
    )


def invocations(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """SageMaker's entry point: the body says which API it is (vLLM dispatches the same)."""
    if "messages" in request:
        return chat(engine, request, model, rid)
    if "prompt" in request:
        return completions(engine, request, model, rid)
    if "input" in request:
        return embeddings(engine, request, model, rid)
    return Reply(400, error_body(400, "cannot tell the API of this /invocations request"))


def pooling(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """`/pooling` and `/classify` (pooling models): one vector, or class scores, per input."""
    return _vectors(
        request,
        model,
        f"pool-{rid}",
        lambda i, t: {"index": i, "object": "pooling", "data": _embedding(t)},
    )


def render(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """vLLM's render endpoints refuse unless the engine runs with --enable-scale-out."""
    message = (
        "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
        "enable them."
    )
    return Reply(
        403,
        {
            "error": {
                "message": message,
                "type": "PermissionDeniedError",
                "param": None,
                "code": 403,
            }
        },
    )


POST_HANDLERS: Final[dict[str, Callable[[FakeEngine, dict[str, Any], str, str], Reply]]] = {
    "/v1/chat/completions": chat,
    "/v1/completions": completions,
    "/v1/embeddings": embeddings,
    "/tokenize": tokenize,
    "/detokenize": detokenize,
    "/v1/rerank": rerank,
    "/rerank": rerank,
    "/v1/score": score,
    "/score": score,
    "/v1/responses": responses,
    "/v1/messages": messages,
    "/v1/messages/count_tokens": count_tokens,
    "/invocations": invocations,
    "/pooling": pooling,
    "/classify": pooling,
    "/v2/rerank": rerank,
    "/v1/chat/completions/render": render,
    "/v1/completions/render": render,
    "/v1/messages/render": render,
}
