"""OpenAI's audio endpoints as vLLM serves them: /v1/audio/transcriptions and
/v1/audio/translations, answered from the upload's form fields."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .common import SSE_DONE, Reply, n_tokens, reply_words, sse

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["transcription"]


def transcription(
    engine: FakeEngine, fields: dict[str, str], model: str, rid: str, *, translate: bool
) -> Reply:
    """/v1/audio/transcriptions and /translations: the form's fields read (the file
    ignored), the text as JSON or, with `stream`, as vLLM's transcription chunks."""
    n, _ = n_tokens(engine, {})
    words = reply_words(n)
    if fields.get("stream", "false").lower() not in ("true", "1"):
        return Reply(200, {"text": "".join(words), "usage": {"type": "duration", "seconds": 1}})
    kind = "translation" if translate else "transcription"
    events = [
        sse(
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
