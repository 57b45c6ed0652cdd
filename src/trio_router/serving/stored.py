"""Stored responses (the Responses API): which engine holds a response.

A response vLLM stores lives in the memory of the engine that created it: only that engine can
answer `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, or a new response with
`previous_response_id`. The router names each response it sends on itself: when the body of a
`POST /v1/responses` has no `request_id` (vLLM's id of the request, and of the response it
stores), the router adds one, `resp_tr1` + a tag of the engine it sends the request to + 32
random hex digits. Any replica can tell from the id alone which engine holds the response,
with no table shared between replicas and nothing to lose when a replica restarts; the
engine's answers pass through unchanged (no id to rewrite in a stream).

The tag is a hash of the engine's uid (the pod's UID in Kubernetes, the URL of a static
engine), the same in every replica; a pod recreated under the same name has a new UID, so its
ids no longer resolve (its memory is gone with it). A request that brings its own `request_id`
keeps it, and its response is not found by id through the router.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Final

from ..errors import NoEngineError, RequestError
from ..table import Engine, RoutingTable

__all__ = [
    "RESPONSE_PREFIX",
    "ResponseNotFoundError",
    "engine_tag",
    "holder",
    "new_response_id",
    "stored_response_id",
    "with_request_id",
]

RESPONSE_PREFIX: Final = "/v1/responses/"
_ID: Final = re.compile(r"resp_tr1([0-9a-f]{16})[0-9a-f]{32}")
_STORED_PATH: Final = re.compile(r"/v1/responses/([^/]+)(/cancel)?")


class ResponseNotFoundError(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


def engine_tag(engine: Engine) -> str:
    return hashlib.blake2b(engine.uid.encode(), digest_size=8).hexdigest()


def new_response_id(engine: Engine) -> str:
    return f"resp_tr1{engine_tag(engine)}{secrets.token_hex(16)}"


def with_request_id(body: bytes | bytearray, response_id: str) -> bytes:
    """The JSON object `body` with `"request_id"` as its first member (the body has none)."""
    start = body.index(b"{") + 1  # a JSON object: whitespace, then "{"
    rest = memoryview(body)[start:]  # one copy of a large body per attempt, not two
    return b"".join((b'{"request_id":"', response_id.encode(), b'",', rest))


def stored_response_id(method: str, path: str) -> str | None:
    """The response id of `GET /v1/responses/{id}` or `POST /v1/responses/{id}/cancel`, or
    None for any other request."""
    if not path.startswith(RESPONSE_PREFIX):
        return None
    match = _STORED_PATH.fullmatch(path)
    if match is None or method != ("POST" if match.group(2) else "GET"):
        return None
    return match.group(1)


def holder(table: RoutingTable, response_id: str) -> Engine | None:
    """The routable engine that holds `response_id`, None when the id is not one the router
    made. ResponseNotFoundError when its engine is gone; NoEngineError (503) while it is there
    but not routable."""
    match = _ID.fullmatch(response_id)
    if match is None:
        return None
    tag = match.group(1)
    for engine in table:
        if engine_tag(engine) == tag:
            if not engine.routable:
                raise NoEngineError(
                    f"engine {engine.name}, which holds response {response_id!r}, is not "
                    f"routable right now ({engine.reason or engine.state.value})"
                )
            return engine
    raise ResponseNotFoundError(
        f"response {response_id!r} is not found: the engine that created it is gone"
    )
