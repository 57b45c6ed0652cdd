"""Streams continued on another engine when theirs fails mid-answer (`proxy.resume`).

A streamed chat or text completion whose request a continuation can carry on (`resumable`:
one choice, no log probabilities, no tools or structured output) is sent to its engine with
`"return_token_ids": true`. Its events pass through a `Track` on their way to the client (in
the relay, one read at a time): complete events only (a partial one waits for its end), each
one's token ids noted and, unless the client asked for them, replaced by `null` (what vLLM
writes when they are not asked for). When the engine fails before the end of the answer (the
connection reset or closed, silent for `proxy.stall_timeout_s`, or the engine ending the
stream itself with `finish_reason: "abort"` or an error event, as vLLM does on SIGTERM), the
request goes on at another engine as a `/v1/completions` request whose prompt is the original
prompt's token ids and the tokens already sent (`continuation_body`), its token limits
reduced by what was generated; the continuation's events are written in the original's shape
(its `id`, `created`, `model`, a chat's deltas), with one `[DONE]` and, when the client asked
for usage, one usage object counting the original prompt and every completion token.

What is kept per stream: the prompt's token ids and the generated ones, as the bytes of their
JSON lists (about 6 bytes a token: at most 6 x the model's context length), and at most one
partial event (`MAX_EVENT_BYTES`; a longer one is a malformed answer).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

import msgspec

from ..http import EngineBrokeOffError, MalformedResponseError
from .intake import set_members
from .prepared import Prepared

__all__ = [
    "RESUMABLE_PATHS",
    "RESUME_READS",
    "StreamAbortedError",
    "Track",
    "continuation",
    "resumable",
    "token_limit",
    "with_token_ids",
]

RESUMABLE_PATHS: Final = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# Request members a continuation cannot carry on: several choices, log probabilities, tool
# calls and structured output (their state lives in the engine), an echoed prompt.
_NOT_RESUMABLE: Final = (
    "tools",
    "functions",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "best_of",
    "return_tokens_as_token_ids",
    "continue_final_message",
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
        *_NOT_RESUMABLE,
        *_SAMPLING,
    }
)
_TOKEN_IDS: Final = b'"token_ids":['
_PROMPT_IDS: Final = b'"prompt_token_ids":['
# A token of content, no reasoning or tool call: a chat's delta, a completion's text, after
# the event's `"choices":[{"index":0,`; vLLM writes such an event's end as
# `"finish_reason":null,"token_ids":[ID]}]}` (`null` in place of [ID] when not asked for).
_CHOICES: Final = b'"choices":[{"index":0,'
_CONTENT: Final = {"chat": b'"delta":{"content"', "completion": b'"text":'}
_PLAIN_IDS: Final = b'"finish_reason":null,"token_ids":['
_PLAIN_END: Final = b"]}]}\n\n"
_PLAIN_END_FRAMED: Final = _PLAIN_END + b"\r\n"  # as it ends an HTTP chunk
_NULLED_EVENT_END: Final = b'"finish_reason":null,"token_ids":null}]}\n\n'
_NEVER: Final = b"\x00"  # a prefix no event begins with
_encode = msgspec.json.encode
_ASKED: Final = b'{"return_token_ids":true'  # what `with_token_ids` puts first
_OPENING: Final = re.compile(rb"[ \t\r\n]*\{[ \t\r\n]*")  # a JSON object's, to its first member
MAX_EVENT_BYTES: Final = 1 << 20  # one event of a followed stream, held until its end


class StreamAbortedError(EngineBrokeOffError):
    """The engine ended a stream itself before its answer was complete (`finish_reason:
    "abort"`, or an error event): what vLLM does to its running requests on SIGTERM."""


def resumable(prepared: Prepared) -> str | None:
    """ "chat" or "completion" when a continuation can carry the request on, else None."""
    kind = RESUMABLE_PATHS.get(prepared.path)
    payload = prepared.payload
    if kind is None or payload.get("stream") is not True or payload.get("n", 1) != 1:
        return None
    if any(payload.get(key) not in (None, False, [], {}) for key in _NOT_RESUMABLE):
        return None
    if kind == "chat":
        return kind if isinstance(payload.get("messages"), list) else None
    prompt = payload.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
    ):
        return kind
    return None


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


def _ids(raw: bytes) -> list[int]:
    return list(msgspec.json.decode(b"[" + raw + b"]", type=list[int])) if raw else []


class Track:
    """One resumable stream's events as they pass (the rewriting of its body, `__call__`
    and `framed` as a `Rewrite`'s two ways: see the module's docstring). `kind`: "chat" or
    "completion"; `show_ids`: the client asked for token ids; `usage`: it asked for the usage
    object."""

    __slots__ = (
        "_partial",
        "_plain",
        "_show_ids",
        "aborted",
        "continuing",
        "counted",
        "done",
        "finish",
        "generated",
        "head",
        "inert",
        "kind",
        "prompt",
        "resumable",
        "usage",
    )

    def __init__(self, kind: str, *, show_ids: bool, usage: bool) -> None:
        self.kind, self._show_ids, self.usage = kind, show_ids, usage
        self._partial = b""
        self._plain = _NEVER  # what an original's plain token event begins with, once known
        self.head: dict[str, Any] | None = None  # id, created, model of the first event
        self.prompt = b""  # the prompt's token ids, as their JSON list's bytes
        self.generated: list[bytes] = []  # each event's token ids, the same way
        self.finish: str | None = None  # the answer's finish reason (not "abort")
        self.aborted = False  # the engine ended the stream itself (abort, error event)
        self.done = False  # [DONE] passed
        self.counted = False  # the usage object passed
        self.resumable = True  # nothing seen that a continuation could not carry on
        self.continuing = False  # the events are a continuation's (/v1/completions)
        self.inert = False  # the engine sends no token ids: passed on untouched, not followed

    def restart(self) -> None:
        """The engine is gone: a partial event of its is dropped (the next part's bytes
        begin with an event of their own)."""
        self._partial = b""

    def carry_on(self) -> None:
        """A continuation's events come next (a new part: see `restart`)."""
        self.continuing, self.aborted = True, False
        self.restart()
        self._stop_plain()

    @property
    def generated_count(self) -> int:
        return sum(part.count(b",") + 1 for part in self.generated if part)

    def __call__(self, data: bytes, final: bool) -> bytes:
        if data[-6:] == _PLAIN_END and not self._partial:
            # The common read: one event with one token of content, as vLLM writes it.
            head, found, tail = data.rpartition(_PLAIN_IDS)
            if found and head[: len(self._plain)] == self._plain and b"\n\n" not in head:
                self.generated.append(tail[:-6])
                return data if self._show_ids else head + _NULLED_EVENT_END
        if self._partial:
            data, self._partial = self._partial + data, b""
        if self.inert:
            return data
        *events, self._partial = data.split(b"\n\n")
        if len(self._partial) > MAX_EVENT_BYTES:
            raise MalformedResponseError(f"an event longer than {MAX_EVENT_BYTES} bytes")
        parts = []
        generated, show = self.generated, self._show_ids
        for event in events:
            plain = self._plain  # known once the first event has passed
            if event[: len(plain)] == plain:  # a token of content, most likely
                head, found, tail = event.rpartition(_PLAIN_IDS)
                if found and tail[-4:] == b"]}]}":
                    generated.append(tail[:-4])
                    parts.append(event if show else head + _NULLED_EVENT_END[:-2])
                    continue
            if (out := self._event(event)) is not None:
                parts.append(out)
        return b"\n\n".join(parts) + b"\n\n" if parts else b""

    def framed(self, chunk: bytes) -> bytes | None:
        """The common read as it came on the wire, one HTTP chunk of one plain token event
        (see `__call__`): the chunk to write, its token id noted (and nulled unless shown);
        None for any other read (it goes through `__call__`). Slices, compares and
        partitions only: on this path, str methods that take positions cost more."""
        if self.inert and not self._partial:
            return chunk
        if chunk[-10:] != _PLAIN_END_FRAMED or self._partial:
            return None
        _, _, data = chunk.partition(b"\r\n")  # the chunk's size line
        head, found, tail = data.rpartition(_PLAIN_IDS)
        if (
            not found
            or head[: len(self._plain)] != self._plain
            or b"\n\n" in head  # more than one event
            or b"\r\n" in head  # more than one chunk
        ):
            return None
        self.generated.append(tail[:-10])
        if self._show_ids:
            return chunk
        out = head + _NULLED_EVENT_END
        return b"%x\r\n%s\r\n" % (len(out), out)

    def _stop_plain(self) -> None:
        """Events are no longer an original's plain tokens (aborted, or a continuation's)."""
        self._plain = _NEVER

    def _event(self, event: bytes) -> bytes | None:
        if self.aborted or not event.startswith(b"data: "):
            return None if self.aborted else event
        if event == b"data: [DONE]":
            self.done = True
            return event
        if self.continuing:
            return self._continued(event)
        if event.startswith(b'data: {"error"'):
            self.aborted = True
            self._stop_plain()
            return None
        if self.head is None:
            decoded = _decoded(event)
            self.head = {k: decoded.get(k) for k in ("id", "object", "created", "model")}
            event = self._noted(event, _PROMPT_IDS, first=True)
            if not self.prompt:  # an engine without token ids: nothing to carry on with
                self.inert, self.resumable = True, False
                self._stop_plain()
                return event
            choices = event.find(_CHOICES)
            if choices > 0:  # what every event of this stream begins with, to its content
                self._plain = event[: choices + len(_CHOICES)] + _CONTENT[self.kind]
        if b'"finish_reason":"' in event:
            reason = event.split(b'"finish_reason":"', 1)[1].split(b'"', 1)[0].decode()
            if reason == "abort":
                self.aborted = True
                self._stop_plain()
                return None
            self.finish = reason
        if b'"choices":[]' in event:
            self.counted = True  # the usage object
        if b'"reasoning' in event or b'"tool_calls"' in event:
            self.resumable = False  # the engine's parsers hold state a continuation lacks
        return self._noted(event, _TOKEN_IDS)

    def _noted(self, event: bytes, key: bytes, *, first: bool = False) -> bytes:
        """`event` with its `key` list noted (and replaced by null unless shown)."""
        start = event.find(key)
        if start < 0:
            return event
        end = event.index(b"]", start)
        ids = event[start + len(key) : end]
        if first:
            self.prompt = ids
        elif ids:
            self.generated.append(ids)
        if self._show_ids:
            return event
        return event[:start] + key[:-1] + b"null" + event[end + 1 :]

    def _continued(self, event: bytes) -> bytes | None:
        """A continuation's event (a text completion's) in the original's shape."""
        decoded = _decoded(event)
        head = self.head or {}
        if "error" in decoded:
            self.aborted = True
            return None
        choices = decoded.get("choices") or []
        if not choices:  # the usage object: the original prompt, every completion token
            if not self.usage or not isinstance(decoded.get("usage"), dict):
                return None
            return self._usage()
        choice = choices[0]
        reason, ids = choice.get("finish_reason"), choice.get("token_ids") or []
        if reason == "abort":
            self.aborted = True
            return None
        if ids:
            self.generated.append(_encode(ids)[1:-1])
        text = choice.get("text") or ""
        if not text and not ids and reason is None:
            return None  # nothing for the client
        if reason is not None:
            self.finish = reason
        shown = ids if self._show_ids else None
        if self.kind == "chat":
            out: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}}
            out |= {"logprobs": None, "finish_reason": reason}
            if reason is not None:
                out["stop_reason"] = choice.get("stop_reason")
            out["token_ids"] = shown
        else:
            out = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            out |= {"stop_reason": choice.get("stop_reason"), "prompt_token_ids": None}
            out["token_ids"] = shown
        return b"data: " + _encode({**head, "choices": [out]})

    def spent(self, limit: int | None) -> bool:
        """Every token the request allows (`limit`) has been generated."""
        return limit is not None and self.generated_count >= limit

    def carriable(self, limit: int | None) -> bool:
        """Another engine could carry the answer on: nothing seen that it could not, the
        answer not over (its finish, [DONE], every token `limit` allows), and the prompt's
        token ids known, or no event passed yet (the request itself goes again, whole)."""
        return (
            self.resumable
            and self.finish is None
            and not self.done
            and not self.spent(limit)
            and (bool(self.prompt) or self.head is None)
        )

    def ending(self) -> bytes:
        """The end of an answer whose engine failed after its last token (its finish seen,
        or every token the request allows generated: then a finish of "length"): the usage
        object if asked for and not yet passed, and [DONE]."""
        out = b""
        if self.finish is None:
            if self.kind == "chat":
                choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
            else:
                choice = {"index": 0, "text": "", "logprobs": None}
            choice |= {"finish_reason": "length", "stop_reason": None}
            out = b"data: " + _encode({**(self.head or {}), "choices": [choice]}) + b"\n\n"
        if self.usage and not self.counted:
            out += self._usage() + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def _usage(self) -> bytes:
        """The answer's one usage event: the original prompt, every completion token."""
        prompt = self.prompt.count(b",") + 1 if self.prompt else 0
        completion = self.generated_count
        usage = {"prompt_tokens": prompt, "completion_tokens": completion}
        usage["total_tokens"] = prompt + completion
        self.counted = True
        return b"data: " + _encode({**(self.head or {}), "choices": [], "usage": usage})


def _decoded(event: bytes) -> dict[str, Any]:
    """An event's JSON object; MalformedResponseError when it is not one."""
    try:
        decoded = msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise MalformedResponseError(f"an event that is not a JSON object: {event[:80]!r}")
    return decoded


def token_limit(payload: dict[str, Any]) -> int | None:
    """The most completion tokens a request allows, when it says."""
    limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return limit if type(limit) is int else None


def continuation(prepared: Prepared, track: Track) -> Prepared | None:
    """The request that goes on where `track`'s engine stopped (see `Track.carriable`), or
    None: the request itself when no event had passed (its engine failed during its time to
    first token: nothing of the body reached the client, another engine answers it all)."""
    payload = prepared.payload
    limit = token_limit(payload)
    if not track.carriable(limit):
        return None
    if track.head is None:
        track.restart()
        return prepared
    generated = [token for part in track.generated for token in _ids(part)]
    body: dict[str, Any] = {"model": prepared.model}
    body["prompt"] = _ids(track.prompt) + generated
    body |= {"stream": True, "return_token_ids": True}
    body |= {key: payload[key] for key in _SAMPLING if key in payload}
    if limit is not None:  # more than generated: the track is not spent
        body["max_tokens"] = limit - len(generated)
    if isinstance(least := payload.get("min_tokens"), int):
        body["min_tokens"] = max(0, least - len(generated))
    body["stream_options"] = {"include_usage": track.usage}
    info = prepared.info
    if info.tokens is not None:
        info = dataclasses.replace(info, tokens=tuple(body["prompt"]))
    track.carry_on()
    return dataclasses.replace(
        prepared,
        path="/v1/completions",
        target=b"/v1/completions",
        body=_encode(body),
        payload=body,
        info=info,
        refusable=False,
    )
