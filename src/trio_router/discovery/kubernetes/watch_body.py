"""The body of a watch response as it arrives: the one module that reads beneath urllib3.

The API server sends a watch as one chunked HTTP body, an event per chunk or a few. The watch
thread wants, from each read, everything that has arrived: then every event received whole
by then crosses to the Trio thread in one hand-off, and none waits for one that has not
fully arrived. urllib3's public reads cannot give that. `HTTPResponse.read1()` goes through
`http.client`, which removes the chunked framing and stops at the end of the current chunk, so
events that arrived together come out one read (and one hand-off) each; `read()`,
`stream()` and `read_chunked()` wait for `amt` bytes or for whole chunks. So this module
reads the socket's buffered reader beneath urllib3's response (`HTTPResponse._fp`, the
`http.client.HTTPResponse`, and its `fp`: what is left of the socket after the headers) and
decodes the chunked framing with the upstream client's codec. It only reads them: nothing of
urllib3 is replaced.

Checked against urllib3 2.3.0 (the oldest the project allows) and 2.8.0 (requirements.lock),
on CPython's `http.client` of 3.11: in both, `_fp` is the `http.client.HTTPResponse` and its
`fp` the socket's `BufferedReader` (urllib3's own `read_chunked` reads the same object).
Where that reader is not there, or the body is not plainly chunked, urllib3 yields the body
one chunk at a time instead (`stream()`): the same events, one hand-off each.
tests/test_discovery_kubernetes_watch_body.py checks that the direct path is the one taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import urllib3

from ...http.codec import ChunkedDecoder

READ_SIZE: Final = 65536  # bytes of a watch stream asked for per read


def socket_reader(response: Any) -> Any | None:
    """The buffered reader of the socket beneath urllib3's `response` (with `read1`), or
    None where it is not there. The only code that reads urllib3's internals."""
    reader = getattr(getattr(response, "_fp", None), "fp", None)
    return reader if hasattr(reader, "read1") else None


def body_pieces(response: Any) -> Iterator[bytes]:
    """Worker thread: the de-chunked body of the watch `response` in pieces as they arrive,
    each piece all that one read brought (see the module's docstring). The socket's read
    timeout applies to every read (TimeoutError, or urllib3's ReadTimeoutError on the
    fallback path); a body that ends before its last chunk raises urllib3's ProtocolError."""
    reader = socket_reader(response)
    if (
        reader is None
        or not getattr(response, "chunked", False)
        or response.headers.get("content-encoding")
    ):
        yield from response.stream(amt=None, decode_content=False)
        return
    decoder = ChunkedDecoder()
    while not decoder.done:
        data = reader.read1(READ_SIZE)
        if not data:
            raise urllib3.exceptions.ProtocolError("watch response ended prematurely")
        try:
            yield decoder.feed(data)
        except ValueError as exc:
            raise urllib3.exceptions.ProtocolError(f"bad chunked watch response: {exc}") from exc
