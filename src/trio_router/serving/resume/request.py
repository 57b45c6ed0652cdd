"""Which streamed requests a continuation can carry on, and the request that carries one on
(see the package's docstring)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

import msgspec

from ..intake import set_members
from ..prepared import Prepared
from .track import Track

__all__ = [
    "RENDER_PATH",
    "RESUMABLE_PATHS",
    "RESUME_READS",
    "continuation",
    "needs_parsers",
    "not_resumable",
    "parsing_request",
    "resumable",
    "token_limit",
    "with_token_ids",
]

RENDER_PATH: Final = "/v1/chat/completions/render"  # a parsed continuation's first request
RESUMABLE_PATHS: Final = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# Request members a continuation cannot carry on, and why (see docs/serving.md's table):
# output held to a grammar (it would restart at the continuation's first token), log
# probabilities of a chat (a continuation's come in a text completion's shape), an echoed
# prompt, several candidates, token ids as text, a final message continued.
_NOT_RESUMABLE: Final = {
    "functions": "legacy function calling",
    "response_format": "structured output (a grammar)",
    "structured_outputs": "structured output (a grammar)",
    "guided_json": "structured output (a grammar)",
    "guided_regex": "structured output (a grammar)",
    "guided_choice": "structured output (a grammar)",
    "guided_grammar": "structured output (a grammar)",
    "logprobs": "log probabilities of a chat",
    "top_logprobs": "log probabilities of a chat",
    "prompt_logprobs": "prompt log probabilities",
    "echo": "an echoed prompt",
    "best_of": "best_of",
    "return_tokens_as_token_ids": "tokens as token ids",
    "continue_final_message": "a final message continued",
}
# What the engine's parsers read of a chat request (a parsed continuation's derender).
_PARSING: Final = (
    "model",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
# Sampling parameters passed on to a continuation as the client gave them.
_SAMPLING: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "priority",
    "user",
)
# What `resumable`, `with_token_ids`, `continuation` and the deliverer read of a streamed
# request (of a large body, only these are decoded: `intake.BodyParser`).
RESUME_READS: Final = frozenset(
    {
        "stream",
        "n",
        "messages",
        "prompt",
        "return_token_ids",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "include_reasoning",
        *_PARSING,
        *_NOT_RESUMABLE,
        *_SAMPLING,
    }
)
_ASKED: Final = b'{"return_token_ids":true'  # what `with_token_ids` puts first
_OPENING: Final = re.compile(rb"[ \t\r\n]*\{[ \t\r\n]*")  # a JSON object's, to its 1st member
_encode = msgspec.json.encode


def resumable(prepared: Prepared) -> str | None:
    """ "chat" or "completion" when a continuation can carry the request on, else None."""
    kind = RESUMABLE_PATHS.get(prepared.path)
    if kind is None or prepared.payload.get("stream") is not True:
        return None
    return kind if not_resumable(prepared.payload, kind) is None else None


def not_resumable(payload: dict[str, Any], kind: str) -> str | None:
    """Why a streamed request of `kind` cannot be carried on, or None."""
    if payload.get("n", 1) != 1:
        return "several choices (n > 1)"
    for key, why in () if _NOT_RESUMABLE.keys().isdisjoint(payload) else _NOT_RESUMABLE.items():
        if payload.get(key) not in (None, False, [], {}):
            if key == "logprobs" and kind == "completion" and type(payload[key]) is int:
                continue  # a continuation's text completion gives them as the original
            return why
    if payload.get("include_reasoning") is False:
        return "reasoning left out (include_reasoning: false)"
    choice = payload.get("tool_choice")
    if choice not in (None, "auto", "none") and payload.get("tools"):
        return "a tool call required (a grammar)"
    if _strict(payload.get("tools")):
        return "strict tools (a grammar)"
    if kind == "chat":
        return None if isinstance(payload.get("messages"), list) else "no messages"
    prompt = payload.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
    ):
        return None
    return "several prompts"


def _strict(tools: Any) -> bool:
    """A tool whose arguments must follow its schema (`strict`: a grammar)."""
    if not isinstance(tools, list):
        return False
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("strict") is True:
            return True
    return False


def with_token_ids(prepared: Prepared) -> bytes | bytearray:
    """The request's body asking the engine for the token ids of its answer: the member
    put first (one copy of the body), or set in place when the client sent one."""
    payload, body = prepared.payload, prepared.body
    if payload.get("return_token_ids") is True or body[: len(_ASKED)] == _ASKED:
        return body  # asked by the client, or here for a model before (`for_model` kept it)
    if "return_token_ids" not in payload and (opening := _OPENING.match(body)):
        end = opening.end()
        joint = b"" if body[end : end + 1] == b"}" else b","
        return b"".join((_ASKED, joint, memoryview(body)[end:]))
    return set_members(body, {"return_token_ids": True})


def token_limit(payload: dict[str, Any]) -> int | None:
    """The most completion tokens a request allows, when it says."""
    limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return limit if type(limit) is int else None


def parsing_request(payload: dict[str, Any]) -> dict[str, Any]:
    """The chat request a parsed continuation's derender parses with: what the parsers read
    of the original (its tools, tool choice, template arguments, special-token handling),
    without its conversation (the prompt's token ids stand for it)."""
    kept: dict[str, Any] = {key: payload[key] for key in _PARSING if key in payload}
    return {**kept, "messages": [], "stream": True}


def needs_parsers(payload: dict[str, Any], track: Track) -> bool:
    """A chat answer that only the engine's parsers can carry on (`parsed`): reasoning has
    passed, or a tool call has, or the request offers tools the model may still call."""
    if track.reasoned or track.tool_ids:
        return True
    tools = payload.get("tools")
    return bool(tools) and payload.get("tool_choice", "auto") != "none"


def continuation(prepared: Prepared, track: Track) -> Prepared | None:
    """The request that goes on where `track`'s engine stopped (see `Track.carriable`), or
    None: the request itself when no event had passed (its engine failed during its time to
    first token: nothing of the body reached the client, another engine answers it all), or
    when nothing was generated yet (its events after the first pass as the original's); the
    chat render request of a parsed continuation (`parsed`) when the engine's parsers must
    carry the answer on; else a text completion of the prompt's and the answer's token ids."""
    payload = prepared.payload
    limit = token_limit(payload)
    if not track.carriable(limit):
        return None
    if track.head is None:
        track.restart()
        return prepared
    if track.kind == "chat" and not track.generated:
        track.carry_on("again")
        return dataclasses.replace(prepared, refusable=False)
    generated = track.generated_ids()
    info = prepared.info
    if info.tokens is not None:  # what a cache-aware policy routes the continuation on
        info = dataclasses.replace(info, tokens=(*track.prompt_ids(), *generated))
    if track.kind == "chat" and needs_parsers(payload, track):
        track.carry_on("parsed")
        target = RENDER_PATH.encode()
        return dataclasses.replace(
            prepared, path=RENDER_PATH, target=target, info=info, refusable=False
        )
    body: dict[str, Any] = {"model": prepared.model}
    body["prompt"] = track.prompt_ids() + generated
    body |= {"stream": True, "return_token_ids": True}
    body |= {key: payload[key] for key in _SAMPLING if key in payload}
    if track.kind == "completion" and type(payload.get("logprobs")) is int:
        body["logprobs"] = payload["logprobs"]
    if limit is not None:  # more than generated: the track is not spent
        body["max_tokens"] = limit - len(generated)
    if isinstance(least := payload.get("min_tokens"), int):
        body["min_tokens"] = max(0, least - len(generated))
    body["stream_options"] = {"include_usage": track.usage}
    track.carry_on("completion")
    return dataclasses.replace(
        prepared,
        path="/v1/completions",
        target=b"/v1/completions",
        body=_encode(body),
        payload=body,
        info=info,
        refusable=False,
    )
