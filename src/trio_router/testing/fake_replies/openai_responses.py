"""vLLM's Responses API: POST /v1/responses (JSON, SSE or in the background), and the stored
responses behind GET /v1/responses/{id} and POST /v1/responses/{id}/cancel."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .common import Reply, error_body, n_tokens, prompt_text, reply_words, sse, words

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["responses", "stored_response"]


@dataclass(frozen=True, slots=True)
class _Response:
    """One response as it is answered: what its bodies and stream events are made of."""

    ident: str
    msg_id: str
    model: str
    created: int
    input_tokens: int
    words: list[str]

    def body(self, status: str, text: str | None) -> dict[str, Any]:
        """The response object with `status`; without `text` it has no output or usage yet."""
        output = (
            []
            if text is None
            else [
                {
                    "type": "message",
                    "id": self.msg_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        )
        n = len(self.words)
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": None
            if text is None
            else {
                "input_tokens": self.input_tokens,
                "output_tokens": n,
                "total_tokens": self.input_tokens + n,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    def events(self) -> list[bytes]:
        """The stream: response.created, a text delta per token, response.completed."""
        created = {
            "type": "response.created",
            "sequence_number": 0,
            "response": self.body("in_progress", None),
        }
        deltas = [
            sse(
                {
                    "type": "response.output_text.delta",
                    "sequence_number": i + 1,
                    "item_id": self.msg_id,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": w,
                    "logprobs": [],
                },
                "response.output_text.delta",
            )
            for i, w in enumerate(self.words)
        ]
        completed = {
            "type": "response.completed",
            "sequence_number": len(self.words) + 1,
            "response": self.body("completed", "".join(self.words)),
        }
        return [
            sse(created, "response.created"),
            *deltas,
            sse(completed, "response.completed"),
        ]


def responses(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """vLLM's Responses API: the response's id is the request's `request_id` (vLLM's own
    default when there is none), stored unless `store` is false (vLLM with
    VLLM_ENABLE_RESPONSES_API_STORE=1), found again by `previous_response_id`; `background`
    answers at once with the response in progress."""
    previous = request.get("previous_response_id")
    if previous is not None and previous not in engine.stored_responses:
        return _response_not_found(previous)
    n, _ = n_tokens(engine, {"max_tokens": request.get("max_output_tokens")})
    response = _Response(
        ident=request.get("request_id") or f"resp_{engine.name}_{rid}",
        msg_id=f"msg_{rid}",
        model=model,
        created=int(time.time()),
        input_tokens=len(words(prompt_text(request))),
        words=reply_words(n),
    )
    text = "".join(response.words)
    if request.get("background"):
        stored = engine.stored_responses[response.ident] = response.body("in_progress", None)
        return Reply(200, stored)
    if request.get("store", True):
        engine.stored_responses[response.ident] = response.body("completed", text)
    if not request.get("stream"):
        return Reply(200, response.body("completed", text))
    return Reply(200, events=response.events())


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
