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
_PLAIN_REST: Final = b"}]}"  # what follows a plain token event's ids, to its end
_PLAIN_REST_READ: Final = _PLAIN_REST + b"\n\n"  # ... as it ends a read
_PLAIN_REST_FRAMED: Final = _PLAIN_REST_READ + b"\r\n"  # ... as it ends an HTTP chunk
_NULLED: Final = b'"finish_reason":null,"token_ids":null}]}'  # its end, ids not shown
_NULLED_EVENT_END: Final = _NULLED + b"\n\n"
_NULLED_CHUNK_END: Final = _NULLED_EVENT_END + b"\r\n"
_DONE_CHUNK: Final = b"e\r\ndata: [DONE]\n\n\r\n"  # an answer's end, one chunk
_NULLED_EVENT_LEN: Final = len(_NULLED_EVENT_END)
# HTTP chunk size lines by size ("%x\r\n", as h11 writes them), for a plain token event's.
_SIZE_LINES_COUNT: Final = 1024
_SIZE_LINES: Final = tuple(b"%x\r\n" % size for size in range(_SIZE_LINES_COUNT))
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
        "_prefixes",
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
        # What an original's plain token events begin with, once known: of content, and of
        # reasoning once one has passed (none once the events are no longer an original's).
        self._prefixes: tuple[bytes, ...] = ()
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
        if prefixes := self._prefixes:
            # The common read: one plain token event (see `framed`), without its framing.
            head, found, tail = data.rpartition(_PLAIN_IDS)
            ids, _, rest = tail.partition(b"]")
            if (
                found
                and rest == _PLAIN_REST_READ
                and head.startswith(prefixes)
                and not self._partial
                and head.find(b"\n") < 0  # one event
            ):
                self.generated.append(ids)
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
            if event.startswith(prefixes):  # a token of content or reasoning, most likely
                head, found, tail = event.rpartition(_PLAIN_IDS)
                ids, _, rest = tail.partition(b"]")
                if found and rest == _PLAIN_REST:  # not the last: no finish, nothing after
                    generated.append(ids)
                    parts.append(event if show else head + _NULLED)
                    continue
            if (out := self._event(event)) is not None:
                parts.append(out)
            prefixes = self._prefixes  # the event may have changed them
        return b"\n\n".join(parts) + b"\n\n" if parts else b""

    def framed(self, chunk: bytes) -> bytes | None:
        """The common read as it came on the wire (`chunk`: one or more whole HTTP chunks in
        h11's form, as the relay reads them): when it is one chunk of one plain token event,
        its ids noted, the chunk to write (its ids nulled unless shown, and its size line
        written anew); for any other read None (it goes through `__call__`), or the chunk as
        it is when the stream is inert. A plain token event: one that begins as the stream's
        token events of content (or of reasoning, once one has passed) do and ends as vLLM
        ends them (`"finish_reason":null,"token_ids":[IDS]}]}`). Every event of a stream
        passes here: three partitions (C calls of one argument, no scan but from the end or
        to a byte) do the work of finding and checking, and no `in` (on bytes it tries its
        operand as an int first: an exception raised and cleared each time)."""
        head, found, tail = chunk.rpartition(_PLAIN_IDS)
        ids, _, rest = tail.partition(b"]")
        line, _, data = head.rpartition(b"\n")  # the size line, if it has the only "\n"
        if (
            not found  # a finish (vLLM writes the last token with it), or no token event
            or rest != _PLAIN_REST_FRAMED
            or not data.startswith(self._prefixes)
            # One event in one chunk: the read's first line is a size line of at most three
            # digits (a longer `line` holds another "\n": another event or chunk), and no
            # chunk ends between the ids' brackets (one id: digits only).
            or len(line) > 4
            or (not ids.isdigit() and ids.find(b"\n") >= 0)
            or self._partial
        ):
            if self._partial:
                return None
            if self.inert:  # passed on untouched
                return chunk
            if chunk == _DONE_CHUNK and not self.aborted:  # the stream's end, as it came
                self.done = True
                return chunk
            return None
        self.generated.append(ids)
        if self._show_ids:
            return chunk
        size = len(data) + _NULLED_EVENT_LEN
        if size < _SIZE_LINES_COUNT:
            return _SIZE_LINES[size] + data + _NULLED_CHUNK_END
        return b"%x\r\n" % size + data + _NULLED_CHUNK_END

    def _stop_plain(self) -> None:
        """Events are no longer an original's plain tokens (aborted, or a continuation's)."""
        self._prefixes = ()

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
        # `find`, not `in`: on bytes, `in` tries its operand as an int first (an exception
        # raised and cleared each time), several times the cost of a search.
        if (start := event.find(b'"finish_reason":"')) >= 0:
            end = event.find(b'"', start + 17)
            reason = event[start + 17 : end if end >= 0 else None].decode()
            if reason == "abort":
                self.aborted = True
                self._stop_plain()
                return None
            self.finish = reason
        if event.find(b'"choices":[]') >= 0:
            self.counted = True  # the usage object
        if event.find(b'"tool_calls"') >= 0:
            self._note_calls(_decoded(event))
        if not self.reasoned and event.find(b'"reasoning') >= 0:
            self.reasoned = True
            if self._prefixes:  # its reasoning tokens take the common read too
                self._prefixes = (*self._prefixes, self._again_head + _REASONING)
        return self._noted(event, _TOKEN_IDS)

    def _first(self, event: bytes) -> bytes:
        """The stream's first event: its head and the prompt's token ids noted (an engine
        that sends none leaves the stream inert), what its token events begin with known."""
        try:
            head = _decode_head(event[6:])
        except msgspec.DecodeError:
            raise _not_an_object(event) from None
        self.head = {
            "id": head.id,
            "object": head.object,
            "created": head.created,
            "model": head.model,
        }
        event = self._noted(event, _PROMPT_IDS, first=True)
        if not self.prompt:  # an engine without token ids: nothing to carry on with
            self.inert, self.resumable = True, False
            self._stop_plain()
            return event
        choices = event.find(_CHOICES)
        if choices > 0:  # what every event of this stream begins with, to its content
            self._again_head = event[: choices + len(_CHOICES)]
            self._prefixes = (self._again_head + _CONTENT[self.kind],)
        return event

    def _as_original(self, event: bytes) -> bytes | None:
        """An event of the request sent again, as the original's (its id, created and
        model); None for its first (the role, already passed)."""
        choices = event.find(_CHOICES)
        if choices < 0 or event.find(b'"role"', choices, choices + 80) >= 0:
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
        return event[: start + len(key) - 1] + b"null" + event[end + 1 :]

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


class _Head(msgspec.Struct):
    """What a stream's first event says of the whole answer (the rest of it skipped)."""

    id: Any = None
    object: Any = None
    created: Any = None
    model: Any = None


_decode_head = msgspec.json.Decoder(_Head).decode


def _decoded(event: bytes) -> dict[str, Any]:
    """An event's JSON object; MalformedResponseError when it is not one."""
    try:
        decoded = msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise _not_an_object(event)
    return decoded


def _not_an_object(event: bytes) -> MalformedResponseError:
    return MalformedResponseError(f"an event that is not a JSON object: {event[:80]!r}")
