"""Streams continued on another engine when theirs fails mid-answer (`proxy.resume`).

A streamed chat or text completion whose request a continuation can carry on (`resumable`;
`not_resumable` says why one cannot: several choices, output held to a grammar, a chat's log
probabilities, ...) is sent to its engine with `"return_token_ids": true`. Its events pass
through a `Track` on their way to the client (in the relay, one read at a time): complete
events only (a partial one waits for its end), each one's token ids noted and, unless the
client asked for them, replaced by `null` (what vLLM writes when they are not asked for); of a
chat, whether reasoning passed and the ids of the tool calls the client has. When the engine
fails before the end of the answer (the connection reset or closed, silent past its stall
bound, or the engine ending the stream itself with `finish_reason: "abort"` or an error
event, as vLLM does on SIGTERM), the request goes on at another engine (`continuation`):

- nothing generated yet (only the first event passed): the request itself, its first event
  dropped and the others written as the original's (its id, created and model);
- a chat whose reasoning or tool calls only the engine's parsers can carry on
  (`needs_parsers`): through vLLM's render, generate and derender endpoints (`parsed`);
- else: a `/v1/completions` request whose prompt is the original prompt's token ids and the
  tokens already sent, its token limits reduced by what was generated; its events are written
  in the original's shape (a chat's deltas).

Either way the client gets one id, `created` and `model` throughout, one `[DONE]` and, when it
asked for usage, one usage object counting the original prompt and every completion token.

Modules: `track` (the events as they pass), `request` (which requests, and the continuation's
request), `parsed` (a continuation through the engine's parsers).
"""

from __future__ import annotations

from .request import (
    RENDER_PATH,
    RESUMABLE_PATHS,
    RESUME_READS,
    continuation,
    needs_parsers,
    not_resumable,
    parsing_request,
    resumable,
    token_limit,
    with_token_ids,
)
from .track import MAX_EVENT_BYTES, EngineErrorAnswerError, StreamAbortedError, Track

__all__ = [
    "MAX_EVENT_BYTES",
    "RENDER_PATH",
    "RESUMABLE_PATHS",
    "RESUME_READS",
    "EngineErrorAnswerError",
    "StreamAbortedError",
    "Track",
    "continuation",
    "needs_parsers",
    "not_resumable",
    "parsing_request",
    "resumable",
    "token_limit",
    "with_token_ids",
]
