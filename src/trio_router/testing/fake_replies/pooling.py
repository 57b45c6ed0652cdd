"""What pooling models answer, as vLLM serves them: embeddings (`/v1/embeddings`, and
`/pooling` and `/classify`), rerank (`/rerank`, `/v1/rerank`, `/v2/rerank`) and score
(`/score`, `/v1/score`). Vectors and scores are checksums of the texts: the same input gets the
same answer from every fake engine."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .common import Reply, words

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["embeddings", "pooling", "rerank", "score"]

EMBEDDING_DIM: Final = 8


def _embedding(text: str) -> list[float]:
    seed = zlib.crc32(text.encode())
    return [round(((seed >> (i * 3)) % 1000) / 1000.0 - 0.5, 6) for i in range(EMBEDDING_DIM)]


def _score(a: str, b: str) -> float:
    return round((zlib.crc32(f"{a}\x00{b}".encode()) % 10_000) / 10_000.0, 6)


def _texts(value: Any) -> list[str]:
    """An embeddings/score input as a list of texts (token-id lists count as one text)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return [" ".join(map(str, value))]
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [""]


def _vectors(
    request: dict[str, Any], model: str, ident: str, item: Callable[[int, str], dict[str, Any]]
) -> Reply:
    """A pooling model's answer: one `item` per input text, and the prompt's usage."""
    texts = _texts(request.get("input"))
    tokens = sum(len(words(t)) for t in texts)
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
    """POST /v1/embeddings: one vector per input text."""
    return _vectors(
        request,
        model,
        f"embd-{rid}",
        lambda i, t: {"object": "embedding", "index": i, "embedding": _embedding(t)},
    )


def pooling(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """`/pooling` and `/classify` (pooling models): one vector, or class scores, per input."""
    return _vectors(
        request,
        model,
        f"pool-{rid}",
        lambda i, t: {"index": i, "object": "pooling", "data": _embedding(t)},
    )


def rerank(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """The documents ranked by their score against the query, best first (`top_n` of them)."""
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
    tokens = len(words(query)) + sum(len(words(d)) for d in docs)
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
    """One score per pair of texts (one first text is paired with every second one)."""
    first = _texts(request.get("text_1", request.get("queries", "")))
    second = _texts(request.get("text_2", request.get("documents", "")))
    if len(first) == 1:
        first = first * len(second)
    pairs = list(zip(first, second, strict=False))
    tokens = sum(len(words(a)) + len(words(b)) for a, b in pairs)
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
