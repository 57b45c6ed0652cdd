"""Whole answers on the pool: `fetch` (the router's own small requests to an engine) and
`read_whole` (the rest of a body, bounded)."""

from __future__ import annotations

from .errors import MalformedResponseError
from .pool import UpstreamPool, UpstreamResponse

__all__ = ["fetch", "read_whole"]


async def fetch(
    pool: UpstreamPool,
    base_url: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    max_bytes: int,
    method: bytes = b"GET",
    body: bytes = b"",
) -> tuple[int, bytes]:
    """`method` (GET by default, with `body`) `target` of the engine at `base_url` on `pool`:
    the status and the whole body.

    For the router's own small requests to an engine (health probes, metrics scrapes,
    /tokenize): the connection is kept alive for the next one when the body was read to its
    end. Raises this module's errors, and `MalformedResponseError` for a body larger than
    `max_bytes` (its connection is closed). Bound it with a deadline: cancellation closes the
    connection.
    """
    async with pool.request(base_url, method, target, headers, body) as response:
        what = f"engine {base_url} answered {target.decode()!r}"
        return response.status, await read_whole(response, max_bytes, what)


async def read_whole(response: UpstreamResponse, max_bytes: int, what: str) -> bytes:
    """The rest of `response`'s body; `MalformedResponseError` ("`what` with more than ...
    bytes") past `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response:
        size += len(chunk)
        if size > max_bytes:
            raise MalformedResponseError(f"{what} with more than {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)
