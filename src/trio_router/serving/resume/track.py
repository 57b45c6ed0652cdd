"""A followed stream's events as they pass: `Track` (see the package's docstring).

What is kept per stream: the prompt's token ids and the generated ones, as the bytes of their
JSON lists (about 6 bytes a token: at most 6 x the model's context length), the ids of the
tool calls passed, and at most one partial event (`MAX_EVENT_BYTES`; a longer one is a
malformed answer).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from ...http import EngineBrokeOffError, MalformedResponseError

__all__ = [
    "MAX_EVENT_BYTES",
    "EngineErrorAnswerError",
    "StreamAbortedError",
    "Track",
    "decoded_ids",
]

_TOKEN_IDS: Final = b'"token_ids":['
_PROMPT_IDS: Final = b'"prompt_token_ids":['
# A token of content, no reasoning or tool call: a chat's delta, a completion's text, after
# the event's `"choices":[{"index":0,`; vLLM writes such an event's end as
# `"finish_reason":null,"token_ids":[ID]}]}` (`null` in place of [ID] when not asked for).
_CHOICES: Final = b'"choices":[{"index":0,'
# (A chat's content string: vLLM writes a tool call's delta `{"content":null,"tool_calls":`.)
_CONTENT: Final = {"chat": b'"delta":{"content":"', "completion": b'"text":'}
_REASONING: Final = b'"delta":{"reasoning"'  # a chat's reasoning token, the same way
_PLAIN_IDS: Final = b'"finish_reason":null,"token_ids":['
_PLAIN_END: Final = b"]}]}\n\n"
_PLAIN_END_FRAMED: Final = _PLAIN_END + b"\r\n"  # as it ends an HTTP chunk
_NULLED_EVENT_END: Final = b'"finish_reason":null,"token_ids":null}]}\n\n'
_NEVER: Final = b"\x00"  # a prefix no event begins with
_encode = msgspec.json.encode
MAX_EVENT_BYTES: Final = 1 << 20  # one event of a followed stream, held until its end


class StreamAbortedError(EngineBrokeOffError):
    """The engine ended a stream itself before its answer was complete (`finish_reason:
    "abort"`, or an error event): what vLLM does to its running requests on SIGTERM."""


class EngineErrorAnswerError(EngineBrokeOffError):
    """The engine answered 500 (a whole answer, held: nothing reached the client): what vLLM
    answers while it shuts down or when its engine core has died."""


def decoded_ids(raw: bytes) -> list[int]:
    """Token ids from the bytes of their JSON list (without its brackets)."""
    return list(msgspec.json.decode(b"[" + raw + b"]", type=list[int])) if raw else []


class Track:
    """One resumable stream's events as they pass (the rewriting of its body, `__call__`
    and `framed` as a `Rewrite`'s two ways: see the module's docstring). `kind`: "chat" or
    "completion"; `show_ids`: the client asked for token ids; `usage`: it asked for the usage
    object."""

    __slots__ = (
        "_again_head",
        "_partial",
        "_plain",
        "_show_ids",
        "_thinking",
        "aborted",
        "continuing",
        "counted",
        "done",
        "finish",
        "generated",
        "head",
        "inert",
        "kind",
        "mode",
        "prompt",
        "reasoned",
        "resumable",
        "tool_ids",
        "usage",
    )

    def __init__(self, kind: str, *, show_ids: bool, usage: bool) -> None:
        self.kind, self._show_ids, self.usage = kind, show_ids, usage
        self._partial = b""
        self._plain = _NEVER  # what an original's plain token event begins with, once known
        self._thinking = _NEVER  # ... and its reasoning token event, once one has passed
        self._again_head = b""  # a whole request's again: what its events begin with, to go
        self.head: dict[str, Any] | None = None  # id, created, model of the first event
        self.prompt = b""  # the prompt's token ids, as their JSON list's bytes
        self.generated: list[bytes] = []  # each event's token ids, the same way
        self.finish: str | None = None  # the answer's finish reason (not "abort")
        self.aborted = False  # the engine ended the stream itself (abort, error event)
        self.done = False  # [DONE] passed
        self.counted = False  # the usage object passed
        self.resumable = True  # nothing seen that a continuation could not carry on
        self.continuing = False  # the events are a continuation's (see `mode`)
        # How the answer is carried on: "" (not yet), "completion" (a text completion of the
        # prompt's and the answer's token ids), "again" (the request itself again, nothing
        # generated yet), "parsed" (the engine's parsers: `parsed.Derendering`).
        self.mode = ""
        self.reasoned = False  # a reasoning delta passed
        self.tool_ids: list[str] = []  # the ids of the tool calls passed, by their index
        self.inert = False  # the engine sends no token ids: passed on untouched, not followed

    def restart(self) -> None:
        """The engine is gone: a partial event of its is dropped (the next part's bytes
        begin with an event of their own)."""
        self._partial = b""

    def carry_on(self, mode: str) -> None:
        """A continuation's events come next (a new part: see `restart`), carried on as
        `mode` says (see `mode`)."""
        self.continuing, self.aborted, self.mode = True, False, mode
        self.restart()
        self._stop_plain()

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids."""
        return decoded_ids(self.prompt)

    def generated_parts(self) -> list[list[int]]:
        """The answer's token ids so far, as the events that carried them had them."""
        return [decoded_ids(part) for part in self.generated]

    def generated_ids(self) -> list[int]:
        """The answer's token ids so far."""
        return [token for part in self.generated for token in decoded_ids(part)]

    def parsed_chunk(self, chunk: dict[str, Any], ids: list[int], reason: str | None) -> bytes:
        """The event of a derendered chunk of `ids` (see `parsed`), in the original's shape
        (b"" when it has nothing for the client); `reason`: the answer's finish, when the
        chunk is its last."""
        if ids:
            self.generated.append(_encode(ids)[1:-1])
        self._note_calls(chunk)
        choices = chunk.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        finish = choice.get("finish_reason") or reason
        delta = _pruned(choice.get("delta") or {})
        if reason is not None:
            self.finish = finish
        elif not delta:
            return b""
        out: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        out["finish_reason"] = finish if reason is not None else None
        if reason is not None:
            out["stop_reason"] = choice.get("stop_reason")
        out["token_ids"] = ids if self._show_ids else None
        return b"data: " + _encode({**(self.head or {}), "choices": [out]}) + b"\n\n"

    @property
    def generated_count(self) -> int:
        return sum(part.count(b",") + 1 for part in self.generated if part)

    def __call__(self, data: bytes, final: bool) -> bytes:
        if data[-6:] == _PLAIN_END and not self._partial:
            # The common read: one event with one token of content, as vLLM writes it.
            head, found, tail = data.rpartition(_PLAIN_IDS)
            plain, thinking = self._plain, self._thinking
            if (
                found
                and (head[: len(plain)] == plain or head[: len(thinking)] == thinking)
                and b"\n\n" not in head
                and b"\n" not in tail[:-6]  # no event after this one
            ):
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
            if self._common(event):  # a token of content or reasoning, most likely
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
        plain, thinking = self._plain, self._thinking
        if (
            not found
            or (head[: len(plain)] != plain and head[: len(thinking)] != thinking)
            or b"\n\n" in head  # more than one event
            or b"\r\n" in head  # more than one chunk
            or b"\n" in tail[:-10]  # an event after this one
        ):
            return None
        self.generated.append(tail[:-10])
        if self._show_ids:
            return chunk
        out = head + _NULLED_EVENT_END
        return b"%x\r\n%s\r\n" % (len(out), out)

    def _common(self, head: bytes) -> bool:
        """`head` begins as this stream's token events do (of content, or of reasoning once
        one has passed)."""
        plain = self._plain
        if head[: len(plain)] == plain:
            return True
        thinking = self._thinking
        return head[: len(thinking)] == thinking

    def _stop_plain(self) -> None:
        """Events are no longer an original's plain tokens (aborted, or a continuation's)."""
        self._plain = self._thinking = _NEVER

    def _event(self, event: bytes) -> bytes | None:
        if self.aborted or not event.startswith(b"data: "):
            return None if self.aborted else event
        if event == b"data: [DONE]":
            self.done = True
            return event
        if self.continuing and self.mode != "again":
            return self._continued(event)
        if event.startswith(b'data: {"error"'):
            self.aborted = True
            self._stop_plain()
            return None
        if self.mode == "again":  # the request itself again: its events as the original's
            if (again := self._as_original(event)) is None:
                return None
            event = again
        elif self.head is None:
            event = self._first(event)
            if self.inert:
                return event
        if b'"finish_reason":"' in event:
            reason = event.split(b'"finish_reason":"', 1)[1].split(b'"', 1)[0].decode()
            if reason == "abort":
                self.aborted = True
                self._stop_plain()
                return None
            self.finish = reason
        if b'"choices":[]' in event:
            self.counted = True  # the usage object
        if b'"tool_calls"' in event:
            self._note_calls(_decoded(event))
        if not self.reasoned and b'"reasoning' in event:
            self.reasoned = True
            if self._plain is not _NEVER:  # its reasoning tokens take the common read too
                self._thinking = self._again_head + _REASONING
        return self._noted(event, _TOKEN_IDS)

    def _first(self, event: bytes) -> bytes:
        """The stream's first event: its head and the prompt's token ids noted (an engine
        that sends none leaves the stream inert), what its token events begin with known."""
        decoded = _decoded(event)
        self.head = {k: decoded.get(k) for k in ("id", "object", "created", "model")}
        event = self._noted(event, _PROMPT_IDS, first=True)
        if not self.prompt:  # an engine without token ids: nothing to carry on with
            self.inert, self.resumable = True, False
            self._stop_plain()
            return event
        choices = event.find(_CHOICES)
        if choices > 0:  # what every event of this stream begins with, to its content
            self._again_head = event[: choices + len(_CHOICES)]
            self._plain = self._again_head + _CONTENT[self.kind]
        return event

    def _as_original(self, event: bytes) -> bytes | None:
        """An event of the request sent again, as the original's (its id, created and
        model); None for its first (the role, already passed)."""
        choices = event.find(_CHOICES)
        if choices < 0 or b'"role"' in event[choices : choices + 80]:
            return None if choices >= 0 else event
        return self._again_head + event[choices + len(_CHOICES) :]

    def _note_calls(self, decoded: dict[str, Any]) -> None:
        """The ids of the tool calls an event begins (`tool_ids`: what a continuation
        keeps)."""
        for choice in decoded.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            for call in (delta.get("tool_calls") if isinstance(delta, dict) else None) or ():
                index, ident = call.get("index"), call.get("id")
                if type(index) is int and 0 <= index < 1024 and isinstance(ident, str):
                    self.tool_ids += [""] * (index + 1 - len(self.tool_ids))
                    self.tool_ids[index] = ident

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
            out = {"index": 0, "text": text, "logprobs": choice.get("logprobs")}
            out["finish_reason"] = reason
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
        self.done = True
        return out + b"data: [DONE]\n\n"

    def _usage(self) -> bytes:
        """The answer's one usage event: the original prompt, every completion token."""
        prompt = self.prompt.count(b",") + 1 if self.prompt else 0
        completion = self.generated_count
        usage = {"prompt_tokens": prompt, "completion_tokens": completion}
        usage["total_tokens"] = prompt + completion
        self.counted = True
        return b"data: " + _encode({**(self.head or {}), "choices": [], "usage": usage})


def _pruned(value: Any) -> Any:
    """`value` without its members that are null or empty lists, at every depth (what vLLM
    leaves out of a streamed delta)."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None and v != []}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _decoded(event: bytes) -> dict[str, Any]:
    """An event's JSON object; MalformedResponseError when it is not one."""
    try:
        decoded = msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise MalformedResponseError(f"an event that is not a JSON object: {event[:80]!r}")
    return decoded
