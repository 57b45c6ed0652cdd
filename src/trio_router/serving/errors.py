"""The serving layer's one error boundary: what a client is answered when something fails.

`from_transport` turns a failed exchange with an engine (`http.errors`) into the
`RequestError` a client gets (`engine_unreachable` is its 502 for an engine that could not be
reached); `error_answer` makes any `RequestError` the OpenAI-style JSON error (status,
headers, body), which `error_response` sends over ASGI; every error answer of the router is
one. `send_json` and `http_date` are the pieces the admin endpoints share.
"""

from __future__ import annotations

import email.utils
import functools
import json
import time
from collections.abc import Sequence
from typing import Final

from ..asgi import Send
from ..errors import (
    AuthError,
    BadRequestError,
    EngineFailedError,
    OverloadedError,
    RequestError,
)
from ..http import (
    ClientGoneError,
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    LocalLimitError,
    TransportError,
)

__all__ = [
    "CLIENT_CLOSED",
    "ENGINE_HEADER",
    "MODEL_HEADER",
    "PREFILL_ENGINE_HEADER",
    "REFUSAL_HEADER",
    "REQUEST_ID_HEADER",
    "engine_unreachable",
    "error_answer",
    "error_body",
    "error_response",
    "from_transport",
    "http_date",
    "send_json",
]

CLIENT_CLOSED: Final = 499  # the status of a request whose client went away (nginx's code)
ENGINE_HEADER: Final = b"x-trio-router-engine"
MODEL_HEADER: Final = b"x-trio-router-model"  # the model that answered (aliases, fallbacks)
PREFILL_ENGINE_HEADER: Final = b"x-trio-router-prefill-engine"  # disaggregated requests
REFUSAL_HEADER: Final = b"x-trio-router-refusal"  # why the router refused a request
REQUEST_ID_HEADER: Final = b"x-request-id"
_JSON_HEADERS: Final = ((b"content-type", b"application/json"),)


def from_transport(exc: TransportError) -> RequestError:
    """What a client is told of a failed exchange with an engine: 502 `engine_unreachable`
    (the request never reached it), 504 `engine_timeout` (it fell silent), 502
    `bad_engine_response` (it broke its answer off or sent no valid HTTP), 503
    `router_overloaded` (the router's own limits), 400 (a request that cannot be written as
    HTTP/1.1). A client that left is told nothing: ValueError."""
    message = str(exc)
    if isinstance(exc, EngineUnreachableError):
        return engine_unreachable(message)
    if isinstance(exc, EngineTimeoutError):
        return EngineFailedError(message, status=504, code="engine_timeout")
    if isinstance(exc, LocalLimitError):
        return OverloadedError(message)
    if isinstance(exc, InvalidRequestError):
        return BadRequestError(message)
    if isinstance(exc, ClientGoneError):
        raise ValueError("a client that left is answered nothing") from exc
    return EngineFailedError(message, status=502, code="bad_engine_response")


def engine_unreachable(message: str) -> EngineFailedError:
    """502 `engine_unreachable`: the request reached no engine (`message` says which, and
    after how many attempts)."""
    return EngineFailedError(message, status=502, code="engine_unreachable")


def error_body(message: str, *, type: str, code: str) -> bytes:
    """The OpenAI-style JSON error body."""
    return json.dumps({"error": {"message": message, "type": type, "code": code}}).encode()


def error_answer(
    exc: RequestError, request_id: bytes | None, engine: str = "", *, close: bool = False
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """`exc` as the OpenAI-style JSON error: its status, headers and body. The headers name
    the engine when one had been chosen (`engine`), the request id, `WWW-Authenticate` for a
    401, the reason of a refusal (`x-trio-router-refusal`), the error's own headers and
    `Retry-After` for a 503; `close` tells the client that the connection ends with it (its
    request body was not read)."""
    extra: list[tuple[bytes, bytes]] = [(b"connection", b"close")] if close else []
    if request_id is not None:
        extra.append((REQUEST_ID_HEADER, request_id))
    if engine:
        extra.append((ENGINE_HEADER, engine.encode()))
    if isinstance(exc, AuthError):
        extra.append((b"www-authenticate", b"Bearer"))
    if exc.refusal:
        extra.append((REFUSAL_HEADER, exc.code.encode()))
    if exc.headers:
        extra.extend(exc.headers)
    elif exc.status == 503:
        extra.append((b"retry-after", b"1"))
    body = error_body(str(exc), type=exc.type, code=exc.code)
    return exc.status, _json_head(body, extra), body


async def error_response(
    send: Send,
    exc: RequestError,
    request_id: bytes | None,
    engine: str = "",
    *,
    close: bool = False,
) -> None:
    """Send `exc` as the OpenAI-style JSON error (`error_answer`) over ASGI `send`."""
    status, headers, body = error_answer(exc, request_id, engine, close=close)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, body: bytes, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """A whole JSON answer, dated by the router."""
    await send(
        {"type": "http.response.start", "status": status, "headers": _json_head(body, extra)}
    )
    await send({"type": "http.response.body", "body": body})


def _json_head(body: bytes, extra: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [
        *_JSON_HEADERS,
        (b"content-length", b"%d" % len(body)),
        (b"date", http_date()),
        *extra,
    ]


def http_date() -> bytes:
    """The Date header value for now (the wall clock, as HTTP wants), formatted once a
    second."""
    return _http_date_of(int(time.time()))


@functools.lru_cache(maxsize=2)
def _http_date_of(second: int) -> bytes:
    return email.utils.formatdate(second, usegmt=True).encode()
