"""Request intake: what the serving path reads of a request before it routes it.

- `Incoming`: a request as it came, as data (method, path, target, headers, client): the
  proxy builds it from its ASGI scope (`Incoming.of_scope`), the endpoint picker from the
  gateway's exchange (`Incoming.of_target`); the one intake both go through
  (`prepared.take_in`, then `prepared.resolve`) and the request's record read only this.
- `read_head`: one pass over the request headers: the headers to forward (the client's
  `Authorization` replaced by the engines' key when one is configured, an `x-request-id`
  added when the client sent none), the client's own priority and first-token deadline
  (`x-trio-router-priority`, `x-trio-router-deadline-ms`, read here and not forwarded by the
  proxy; a gateway in front of the picker sends them on as they came), and
  what makes the request invalid as it stands (both `Content-Length` and
  `Transfer-Encoding`, control characters in a header value, a priority or deadline that is
  not an integer).
- `read_body`: the body, bounded by `server.max_body_bytes`, timed by
  `server.request_body_timeout_s`, and held within the router-wide body budget
  (`BodyBudget`, `server.max_buffered_body_bytes`).
- `BodyParser`: the JSON of a body; large bodies are parsed in a worker thread, and only
  the members routing reads (`Reads`): the rest stays bytes, forwarded as it came, and a
  member the router sets is replaced in those bytes (`set_members`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import trio

from ..asgi import Receive, Scope
from ..config import Config
from ..errors import (
    BadRequestError,
    BodyTooLargeError,
    OverloadedError,
    RequestError,
    RequestTimeoutError,
)
from ..http.codec import FIELD_VALUE_CHARS
from .errors import REQUEST_ID_HEADER
from .forms import FormModel, form_model

__all__ = [
    "DEADLINE_HEADER",
    "LARGE_BODY_BYTES",
    "PRIORITY_HEADER",
    "SERVING_READS",
    "BodyBudget",
    "BodyParser",
    "Held",
    "Incoming",
    "Reads",
    "RequestHead",
    "read_body",
    "read_head",
    "set_members",
]

PRIORITY_HEADER: Final = b"x-trio-router-priority"
DEADLINE_HEADER: Final = b"x-trio-router-deadline-ms"
LARGE_BODY_BYTES: Final = 1 << 20  # larger request bodies are parsed in a worker thread
LARGE_PARSES: Final = 2  # large bodies parsed at once, at most


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request as it came (see the module's docstring)."""

    method: str
    path: str
    target: bytes  # the path and query as the client sent them
    headers: Sequence[tuple[bytes, bytes]]  # as they came: lower-case names, no pseudo-headers
    client: str = ""  # the client's address (host:port for the proxy), or ""

    @classmethod
    def of_scope(cls, scope: Scope) -> Incoming:
        """The request an ASGI HTTP scope describes."""
        target = scope["raw_path"]
        if query := scope["query_string"]:
            target += b"?" + query
        client = scope.get("client")
        return cls(
            scope["method"],
            scope["path"],
            target,
            scope["headers"],
            f"{client[0]}:{client[1]}" if client else "",
        )

    @classmethod
    def of_target(
        cls, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], client: str
    ) -> Incoming:
        """The request for `target` (its path and query, as a request line has them), as a
        gateway hands it over."""
        path, _, query = target.partition("?")
        sent = path.encode() + (b"?" + query.encode() if query else b"")
        return cls(method, path, sent, headers, client)


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the serving path takes from a request's headers."""

    request_id: bytes
    authorization: bytes | None  # the client's, as sent
    content_length: bytes | None
    headers: list[tuple[bytes, bytes]]  # to forward to the engine
    invalid: RequestError | None  # why the request cannot be served as it stands
    priority: int | None = None  # the client's x-trio-router-priority
    deadline_s: float | None = None  # the client's x-trio-router-deadline-ms, in seconds


def read_head(
    raw: Iterable[tuple[bytes, bytes]],
    new_id: Callable[[], bytes],
    upstream_authorization: bytes | None,
) -> RequestHead:
    """One pass over the request's headers (see the module's docstring)."""
    request_id = authorization = content_length = bad_header = priority = deadline = None
    chunked = False
    headers: list[tuple[bytes, bytes]] = []
    for name, value in raw:
        if value.translate(None, FIELD_VALUE_CHARS):
            bad_header = name
        if name == b"authorization":
            authorization = value
            continue  # replaced below
        if name == PRIORITY_HEADER:
            priority = value
            continue
        if name == DEADLINE_HEADER:
            deadline = value
            continue
        if name == b"x-request-id":
            request_id = value
        elif name == b"content-length":
            content_length = value
        elif name == b"transfer-encoding":
            chunked = True
        headers.append((name, value))
    if request_id is None:
        request_id = new_id()
        headers.append((REQUEST_ID_HEADER, request_id))
    if (sent := upstream_authorization or authorization) is not None:
        headers.append((b"authorization", sent))
    invalid: RequestError | None = None
    if chunked and content_length is not None:
        # RFC 9112 §6.1: a request with both may be an attempt to smuggle another.
        invalid = BadRequestError(
            "a request must not have both Content-Length and Transfer-Encoding"
        )
    elif bad_header is not None:
        invalid = BadRequestError(
            f"header {bad_header.decode('latin-1')!r} has control characters in its value"
        )
    rank, wait, wrong = _urgency(priority, deadline)
    invalid = invalid or wrong
    return RequestHead(
        request_id,
        authorization,
        content_length,
        headers,
        invalid,
        priority=rank,
        deadline_s=wait,
    )


def _urgency(
    priority: bytes | None, deadline: bytes | None
) -> tuple[int | None, float | None, RequestError | None]:
    """The client's priority and deadline (seconds), or the error naming what is wrong."""
    rank = _integer(priority, PRIORITY_HEADER, minimum=-(2**31))
    wait = _integer(deadline, DEADLINE_HEADER, minimum=1)
    if isinstance(rank, RequestError):
        return None, None, rank
    if isinstance(wait, RequestError):
        return None, None, wait
    return rank, None if wait is None else wait / 1000, None


def _integer(value: bytes | None, name: bytes, *, minimum: int) -> int | RequestError | None:
    """The integer a header holds (None without it), or the error naming what is wrong."""
    if value is None:
        return None
    text = value.strip()
    digits = text[1:] if text[:1] in (b"-", b"+") else text
    if not digits.isdigit() or len(digits) > 10:
        return BadRequestError(
            f"header {name.decode()!r} must be an integer, got {value.decode('latin-1')!r}"
        )
    number = int(text)
    if not minimum <= number < 2**31:
        return BadRequestError(
            f"header {name.decode()!r} must be an integer from {minimum} to {2**31 - 1}, "
            f"got {number}"
        )
    return number


# -- the body ---------------------------------------------------------------------------------
class BodyBudget:
    """Bytes of request bodies held in memory at once, across all requests, at most
    `limit` (`server.max_buffered_body_bytes`): a request whose body would go beyond it gets
    503 instead, so many large bodies at once cannot exhaust memory."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def configure(self, config: Config) -> None:
        """Take `server.max_buffered_body_bytes` of a reloaded config (bodies held now stay)."""
        self.limit = config.server.max_buffered_body_bytes


class Held:
    """The part of the body budget one request holds; `release()` gives it back."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget, self.size = budget, 0

    def grow(self, size: int) -> None:
        budget = self._budget
        if budget.used + size > budget.limit:
            raise OverloadedError(
                f"request bodies being handled already hold {budget.used} bytes; this one "
                f"would go beyond {budget.limit} (server.max_buffered_body_bytes)"
            )
        budget.used += size
        self.size += size

    def release(self) -> None:
        self._budget.used -= self.size
        self.size = 0


def _declared_length(content_length: bytes | None, limit: int) -> int | None:
    if content_length is None:
        return None
    try:
        declared = int(content_length)
    except ValueError:
        raise BadRequestError(f"invalid Content-Length {content_length!r}") from None
    if declared > limit:
        raise BodyTooLargeError(
            f"request body of {declared} bytes exceeds the limit of {limit} bytes "
            "(server.max_body_bytes)"
        )
    if declared < 0:
        raise BadRequestError(f"invalid Content-Length {content_length!r}")
    return declared


async def read_body(
    receive: Receive, content_length: bytes | None, limit: int, *, stall_s: float, held: Held
) -> bytes | bytearray | None:
    """The whole request body, or None if the client disconnected first. Raises
    BodyTooLargeError past `limit` (declared or counted), BadRequestError for a bad
    Content-Length, RequestTimeoutError when no part of it arrives for `stall_s` seconds, and
    OverloadedError when it would take the body budget past its limit (`held` records what
    it takes: all of a declared length at once, as it arrives otherwise)."""
    declared = _declared_length(content_length, limit)
    if declared is not None:
        held.grow(declared)
    # One deadline for the whole body, moved on by every part: a budget of silence.
    with trio.move_on_after(stall_s) as waited:
        return await _read_parts(receive, limit, declared, held, waited, stall_s)
    raise RequestTimeoutError(
        f"the request body stopped arriving for {stall_s:g} s (server.request_body_timeout_s)"
    )


async def _read_parts(
    receive: Receive,
    limit: int,
    declared: int | None,
    held: Held,
    waited: trio.CancelScope,
    stall_s: float,
) -> bytes | bytearray | None:
    """The body's parts as they come (see `read_body`), `waited`'s deadline `stall_s` after
    each."""
    too_large = f"request body exceeds the limit of {limit} bytes (server.max_body_bytes)"
    message = await receive()
    if message["type"] != "http.request":
        return None
    first: bytes = message.get("body", b"")
    if len(first) > limit:
        raise BodyTooLargeError(too_large)
    if declared is None:
        held.grow(len(first))
    if not message.get("more_body", False):
        return first  # the common case: one message, no copy
    body = bytearray(first)
    while True:
        waited.deadline = trio.current_time() + stall_s
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if len(body) + len(chunk) > limit:
            raise BodyTooLargeError(too_large)
        if declared is None:
            held.grow(len(chunk))
        body += chunk  # grows in place: no second copy of a large body
        if not message.get("more_body", False):
            return body


# -- the JSON ---------------------------------------------------------------------------------
# What the serving path itself reads of every request (the model and what /v1/responses
# continues, vLLM's priority it may replace, whether the answer is streamed).
SERVING_READS: Final = frozenset(
    {"model", "previous_response_id", "request_id", "priority", "stream"}
)


@dataclass(frozen=True, slots=True)
class Reads:
    """The members of a large body that routing reads (`BodyParser.parse`): `members` of
    every request; with `streamed`, of a request with `"stream": true` also what carrying its
    stream on at another engine reads (the parser's `streamed_reads`)."""

    members: frozenset[str]
    streamed: bool = False


class BodyParser:
    """Parses request bodies: small ones at once, large ones (over LARGE_BODY_BYTES) in a
    worker thread, LARGE_PARSES at a time. `streamed_reads`: the members that carrying a
    stream on reads of a streamed request (`resume.RESUME_READS`)."""

    def __init__(self, *, streamed_reads: frozenset[str]) -> None:
        self._limiter = trio.CapacityLimiter(LARGE_PARSES)
        self._streamed_reads = streamed_reads
        self._decoders: dict[Reads, _Members] = {}

    async def parse(self, body: bytes | bytearray, *, reads: Reads | None) -> dict[str, Any]:
        """The JSON object of `body`; of a large body only the members `reads` names (all
        of them when None): msgspec skips the others without building them, so a large
        request costs little more than its bytes. BadRequestError if it is not an object
        with a string model."""
        if len(body) <= LARGE_BODY_BYTES:
            return parse_json(body)
        if reads is None:
            return await trio.to_thread.run_sync(parse_json, body, limiter=self._limiter)
        if (members := self._decoders.get(reads)) is None:
            streamed = self._streamed_reads if reads.streamed else frozenset()
            members = self._decoders[reads] = _Members(reads.members, streamed)
        return await trio.to_thread.run_sync(members.parse, body, limiter=self._limiter)

    async def form(self, body: bytes | bytearray, content_type: bytes | None) -> FormModel:
        """The `model` field of a multipart form upload (`forms.form_model`), read in a
        worker thread when the body is large."""
        if len(body) <= LARGE_BODY_BYTES:
            return form_model(body, content_type)
        return await trio.to_thread.run_sync(form_model, body, content_type, limiter=self._limiter)

    async def with_members(
        self, body: bytes | bytearray, payload: dict[str, Any], members: dict[str, Any]
    ) -> tuple[dict[str, Any], bytes]:
        """The request with `members` set (its "model", its "priority"): its payload and its
        body, the other members as they were, in their order. A small body is re-encoded
        from its payload; a large one, whose payload may hold only what routing reads, has
        its members replaced in its bytes (`set_members`), in a worker thread."""
        if len(body) <= LARGE_BODY_BYTES:
            return _with_members(payload, members)
        encoded = await trio.to_thread.run_sync(set_members, body, members, limiter=self._limiter)
        return {**payload, **members}, encoded


def _with_members(payload: dict[str, Any], members: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    payload = {**payload, **members}
    return payload, msgspec.json.encode(payload)


_decode_top_level: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def set_members(body: bytes | bytearray, members: dict[str, Any]) -> bytes:
    """`body` (a JSON object) with `members` set: every other member's value as it was,
    byte for byte, in its place (a new member goes last). Nothing but the top level is
    decoded."""
    return msgspec.json.encode({**_decode_top_level(body), **members})


class _Members:
    """What routing reads of a large body (see `BodyParser.parse`): the members `always`
    names, and `streamed` of a streamed request, each found as its raw JSON (nothing else is
    built) and decoded as `json.loads` decodes it in a small body."""

    __slots__ = ("_always", "_decode", "_names", "_streamed")

    def __init__(self, always: frozenset[str], streamed: frozenset[str]) -> None:
        self._always = always | {"model"}
        self._streamed = streamed - self._always
        self._names = tuple(sorted(self._always | self._streamed))
        fields = [(name, msgspec.Raw, msgspec.UNSET) for name in self._names]
        self._decode = msgspec.json.Decoder(msgspec.defstruct("Members", fields)).decode

    def parse(self, body: bytes | bytearray) -> dict[str, Any]:
        try:
            found = self._decode(body)
        except msgspec.ValidationError as exc:  # a DecodeError too: first
            raise BadRequestError(f"request body must be a JSON object: {exc}") from None
        except msgspec.DecodeError as exc:
            raise BadRequestError(f"request body is not valid JSON: {exc}") from None
        raw = {
            name: value
            for name in self._names
            if (value := getattr(found, name)) is not msgspec.UNSET
        }
        payload = {name: _loads(value) for name, value in raw.items() if name in self._always}
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequestError('request body has no "model" string')
        if payload.get("stream") is True:
            payload |= {
                name: _loads(value) for name, value in raw.items() if name in self._streamed
            }
        return payload


def _loads(data: bytes | bytearray | msgspec.Raw) -> Any:
    try:
        return json.loads(data if isinstance(data, bytes | bytearray) else bytes(data))
    except (ValueError, RecursionError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None


def parse_json(body: bytes | bytearray) -> dict[str, Any]:
    """The JSON object of a request; BadRequestError if it is not one or has no string
    model."""
    payload = _loads(body)
    if not isinstance(payload, dict):
        raise BadRequestError(f"request body must be a JSON object, got {type(payload).__name__}")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError('request body has no "model" string')
    return payload
