"""Prefill/decode disaggregation: what the two-phase exchange needs besides the exchange itself.

vLLM's KV connectors (NixlConnector and the others that follow its protocol) split one
request across two engines:

1. the prefill engine gets the client's request with `"max_tokens": 1` (and
   `max_completion_tokens` when the client set it), `"stream": false`, no `stream_options`
   and no `min_tokens`, plus `"kv_transfer_params": {"do_remote_decode": true, ...}`; it
   computes the prompt's KV cache, keeps the blocks and answers a one-token completion whose
   JSON carries a top-level `kv_transfer_params` (where the blocks are, whose they are);
2. the decode engine gets the client's own request plus those parameters, verbatim (their
   fields change between vLLM versions), pulls the blocks and generates; its answer (SSE or
   JSON) is the client's.

A prefill that ended on its own before the cap returns no parameters: the decode engine then
prefills itself. This module holds the pure parts: who may take which step (`Roles`), whether
a request takes the prefill step at all (`Disaggregation.skip_reason`), the two bodies, and
the parameters found in a prefill answer. The serving path runs the steps
(`serving/disaggregated.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from ..config import DisaggregationConfig
from ..table import Engine
from .kv_aware import KvAwarePolicy
from .policy import Policy

__all__ = [
    "PD_PATHS",
    "Disaggregation",
    "Roles",
    "decode_body",
    "prefill_body",
    "prompt_chars",
    "transfer_params",
]

PD_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_PREFILL_ANSWER_BYTES: Final = 4 * 1024 * 1024  # a one-token answer is far smaller
PREFILL_ROLES: Final = frozenset({"prefill", "prefill-decode"})
DECODE_ROLES: Final = frozenset({"decode", "prefill-decode"})
# What the prefill engine is asked to do: compute the prompt's KV cache and keep it for a
# remote decode. The remote_* fields are filled in by the engine's answer.
_PREFILL_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_STRIPPED: Final = ("stream_options", "min_tokens")
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Roles:
    """The routable engines of one model split by the step each may take."""

    prefill: tuple[Engine, ...]  # role prefill or prefill-decode
    decode: tuple[Engine, ...]  # role decode or prefill-decode
    whole: tuple[Engine, ...]  # those that serve a request in one step (every role but prefill)

    @classmethod
    def of(cls, engines: Sequence[Engine]) -> Roles:
        whole = tuple(e for e in engines if e.role != "prefill")
        return cls(
            prefill=tuple(e for e in engines if e.role in PREFILL_ROLES),
            decode=tuple(e for e in engines if e.role in DECODE_ROLES),
            # Only prefill engines left: they can still serve a request whole.
            whole=whole or tuple(engines),
        )

    @staticmethod
    def others(engines: Sequence[Engine], chosen: Sequence[Engine]) -> list[str]:
        """The uids of `engines` not in `chosen`: what a policy must leave out."""
        keep = {e.uid for e in chosen}
        return [e.uid for e in engines if e.uid not in keep]


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """The `[disaggregation]` settings of one runtime: its config and its two policies."""

    config: DisaggregationConfig
    prefill_policy: Policy
    decode_policy: Policy

    @property
    def needs_tokens(self) -> bool:
        return self.prefill_policy.needs_tokens or self.decode_policy.needs_tokens

    def holds_most(self, engine: Engine, tokens: Sequence[int], model: str) -> bool:
        """Whether `engine` already holds at least `skip_cached_fraction` of the blocks of
        the prompt for `model`, as the KV-aware policy's index says (False without one)."""
        fraction = self.config.skip_cached_fraction
        for policy in (self.prefill_policy, self.decode_policy):
            if fraction and isinstance(policy, KvAwarePolicy):
                return policy.cached_share(engine, tokens, model) >= fraction
        return False

    def skip_reason(self, path: str, payload: dict[str, Any], roles: Roles) -> str | None:
        """Why this request goes to one engine whole ("short_prompt", "no_prefill_engine",
        "no_decode_engine", "not_generation"), or None: it takes the prefill step."""
        if path not in PD_PATHS:
            return "not_generation"
        if not roles.prefill:
            return "no_prefill_engine"
        if not roles.decode:
            return "no_decode_engine"
        limit = self.config.min_prompt_chars
        if limit and prompt_chars(payload, limit) < limit:
            return "short_prompt"
        return None


def prompt_chars(payload: dict[str, Any], enough: int) -> int:
    """The characters of the request's prompt (chat messages' text, or the prompt), counted
    up to `enough`: a long conversation is not walked to its end."""
    total = 0
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    total += len(text) if isinstance(text, str) else 0
            if total >= enough:
                break
        return total
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):  # token ids, or several prompts: count what is there
        return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)
    return 0


def prefill_body(payload: dict[str, Any]) -> bytes:
    """The prefill engine's request: the client's, capped at one token, not streamed, asked
    to keep its KV cache for a remote decode."""
    body = {k: v for k, v in payload.items() if k not in _STRIPPED}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = dict(_PREFILL_PARAMS)
    return _encode(body)


def decode_body(payload: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode engine's request: the client's own, with the prefill engine's
    `kv_transfer_params` as it sent them."""
    return _encode({**payload, "kv_transfer_params": params})


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` object of a prefill engine's JSON answer, or None when it has
    none (the prefill ended before the cap, or the engine has no KV connector) or the answer
    is not JSON."""
    try:
        decoded = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        return None
    params = decoded.get("kv_transfer_params") if isinstance(decoded, dict) else None
    return params if isinstance(params, dict) and params else None
