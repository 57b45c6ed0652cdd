"""What the fake engine answers: the bodies of vLLM's endpoints, as pure functions of the
engine's knobs and the request, one module per API family, and the table of which function
answers which POST path (`POST_HANDLERS`). The ASGI side, timing and observations are
`fake_engine_app.FakeEngineApp`'s.

- `common`: `Reply`, vLLM's error shape, server-sent events, generated words, token ids.
- `openai_generation`: chat and text completions; `openai_responses`: the Responses API and
  stored responses; `openai_audio`: transcriptions and translations.
- `pooling`: embeddings, pooling, rerank and score.
- `anthropic_messages`: the Anthropic Messages API.
- `vllm_extras`: /tokenize, /detokenize, /invocations and the scale-out endpoints (render,
  generate, derender: refused unless the engine is `scale_out`).
- `parsing`: the fake reasoning and tool parsers, and what render, generate and derender
  answer with them.
"""

from __future__ import annotations

from typing import Final

from .anthropic_messages import count_tokens, messages
from .common import REPLY_TOKEN, REPLY_WORDS, SSE_DONE, Handler, Reply, error_body, prompt_tokens
from .openai_audio import transcription
from .openai_generation import chat, completions
from .openai_responses import responses, stored_response
from .pooling import embeddings, pooling, rerank, score
from .vllm_extras import (
    chat_render,
    derender,
    detokenize,
    generate,
    invocations,
    render,
    tokenize,
)

__all__ = [
    "POST_HANDLERS",
    "REPLY_TOKEN",
    "REPLY_WORDS",
    "SSE_DONE",
    "Handler",
    "Reply",
    "error_body",
    "prompt_tokens",
    "stored_response",
    "transcription",
]

POST_HANDLERS: Final[dict[str, Handler]] = {
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
    "/v1/chat/completions/render": chat_render,
    "/v1/chat/completions/derender": derender,
    "/inference/v1/generate": generate,
    "/v1/completions/render": render,
    "/v1/messages/render": render,
}
