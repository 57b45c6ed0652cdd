"""The token ids an engine will compute for a request: what KV-aware routing matches blocks on.

The engines are asked (`POST /tokenize`, which vLLM answers with its own tokenizer and chat
template: exactly the tokens it will prefill), under a short deadline
(`routing.tokenize_timeout_s`). A request that already gives token ids (a completions prompt
of integers) needs no question. The engine asked is the least busy of the next few
candidates in turn. When the answer does not come in time, or the request cannot
be tokenized this way, routing falls back to the policy that needs no tokens (`prefix_aware`);
a request is never delayed past the deadline.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio

from ..config import Config
from ..http import MalformedResponseError, TransportError, UpstreamPool, fetch
from ..table import Engine

__all__ = ["TOKENIZE_READS", "Tokenizer"]

logger = logging.getLogger(__name__)

MAX_TOKENIZE_BYTES: Final = 16 * 1024 * 1024  # a larger /tokenize answer is not read
# The chat fields the chat template reads, passed on to /tokenize as the request has them.
_CHAT_FIELDS: Final = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)
# What the prompt's token ids are made of (here, and by the router's own tokenizer).
TOKENIZE_READS: Final = frozenset({"prompt", *_CHAT_FIELDS})
_JSON: Final = [(b"content-type", b"application/json")]
_TOKENIZE_WINDOW: Final = 8  # candidates compared for the least busy one


def _in_flight(engine: Engine) -> int:
    return engine.in_flight


class Tokenizer:
    """Asks engines for a request's token ids (see the module's docstring)."""

    def __init__(
        self,
        *,
        timeout: float,
        on_answer: Callable[[float], None] = lambda seconds: None,
        on_fallback: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.timeout = timeout  # seconds
        self._turn = itertools.count()
        self._on_answer, self._on_fallback = on_answer, on_fallback

    def configure(self, config: Config) -> None:
        """Take `routing.tokenize_timeout_s` of a reloaded config."""
        self.timeout = config.routing.tokenize_timeout_s

    async def tokens(
        self,
        pool: UpstreamPool,
        payload: dict[str, Any],
        candidates: Sequence[Engine],
        headers: list[tuple[bytes, bytes]],
    ) -> list[int] | None:
        """The prompt's token ids for `payload` (a chat or completions request), asked of one
        of `candidates` in turn; None if there is no answer within the deadline or the
        request is not one /tokenize can read."""
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)  # already token ids
        body = _tokenize_body(payload)
        if body is None or not candidates:
            self._failed("untokenizable")
            return None
        engine = self._least_busy(candidates)
        started = trio.current_time()
        with trio.move_on_after(self.timeout) as waited:
            try:
                status, answer = await fetch(
                    pool,
                    engine.url,
                    b"/tokenize",
                    [*_JSON, *headers],
                    max_bytes=MAX_TOKENIZE_BYTES,
                    method=b"POST",
                    body=body,
                )
            except MalformedResponseError:  # an answer too large to be token ids
                self._failed("bad_answer")
                return None
            except TransportError as exc:
                logger.debug("tokenize on engine %s failed: %s", engine.name, exc)
                self._failed("error")
                return None
        if waited.cancelled_caught:
            self._failed("timeout")
            return None
        self._on_answer(trio.current_time() - started)
        if status != 200:
            self._failed(f"status_{status}")
            return None
        try:
            tokens = json.loads(answer)["tokens"]
        except (ValueError, KeyError, TypeError):
            self._failed("bad_answer")
            return None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            self._failed("bad_answer")
            return None
        return tokens

    def _least_busy(self, candidates: Sequence[Engine]) -> Engine:
        """The candidate with the fewest of this router's requests in flight among the next
        few in turn: a busy engine's API server answers /tokenize late."""
        count = len(candidates)
        start = next(self._turn) % count
        window = (candidates[(start + i) % count] for i in range(min(count, _TOKENIZE_WINDOW)))
        return min(window, key=_in_flight)

    def _failed(self, reason: str) -> None:
        self._on_fallback(reason)


def _tokenize_body(payload: dict[str, Any]) -> bytes | None:
    """The /tokenize request of a chat (messages, template fields) or text prompt."""
    model = payload.get("model")
    body: dict[str, Any]
    if isinstance(payload.get("messages"), list):
        body = {key: payload[key] for key in _CHAT_FIELDS if key in payload}
    elif isinstance(payload.get("prompt"), str):
        body = {"prompt": payload["prompt"]}
    else:
        return None
    body["model"] = model
    return json.dumps(body).encode()
