"""HTTP/1.1 as the router's upstream client speaks it: a codec with no I/O and no Trio.

- `ResponseParser`: an incremental parser of one response to a request this client sent
  (never pipelined), validating like h11 does (tokens, field values, status line,
  Content-Length, chunk framing) with less work per response (docs/performance.md has
  the figures). Tests check it against h11 at every read split.
- `encode_request_head`: the head of a request, hop-by-hop headers dropped.
- `ChunkedDecoder`: the chunked coding of a body whose head was read elsewhere (the
  Kubernetes watch stream).
- `ResponseParser.read_body_framed`: a chunked body as the bytes to write on a chunked
  HTTP/1.1 connection, engine chunks passed as they came where they are already in that form
  (the relay of token streams).

Malformed input raises `ProtocolError`; the upstream module maps it to the router's errors.
"""

from __future__ import annotations

import re
from itertools import repeat
from typing import Final

MAX_HEAD_BYTES: Final = 64 * 1024  # largest response head (or trailer section) accepted
MAX_CHUNK_LINE: Final = 4096  # longest chunk-size line (with extensions) accepted

# Never forwarded to an engine: the pool sets Host and Content-Length itself, and hop-by-hop
# headers (RFC 9110 §7.6.1) describe the client's connection, not this one.
_REQUEST_DROP: Final = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authorization",
        b"expect",
    }
)
# Never handed back to the caller: they describe the engine's connection and framing, which
# the router's own server redoes for its client. Content-Length is end-to-end and is kept.
_RESPONSE_DROP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authenticate",
    }
)

# Character classes (RFC 9110 §5.6.2, §5.5), used as `bytes.translate(None, delete=...)`: what
# is left after deleting the allowed characters is what is wrong. Cheaper than a regex.
_TOKEN: Final = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_FIELD_VALUE: Final = bytes(range(0x21, 0x7F)) + bytes(range(0x80, 0x100)) + b" \t"
_HEAD_CHARS: Final = _FIELD_VALUE + b"\r\n"
FIELD_VALUE_CHARS: Final = _FIELD_VALUE  # what a header value may hold (bytes.translate)
TARGET_CHARS: Final = bytes(range(0x21, 0x7F))
_HEX: Final = b"0123456789abcdefABCDEF"
_DIGITS: Final = b"0123456789"
_PLAIN_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,16}\r\n")  # a chunk-size line, nothing more
# A chunk-size line as h11 (and so Hypercorn) writes one: lowercase hex, no leading zero, no
# extension. A chunk with this line is passed on by the relay exactly as it came.
_CANONICAL_CHUNK_SIZE: Final = re.compile(rb"[1-9a-f][0-9a-f]{0,15}\r\n")

# Body framing modes of ResponseParser.
_DONE: Final = 0
_LENGTH: Final = 1
_CHUNKED: Final = 2
_UNTIL_CLOSE: Final = 3
# Positions inside a chunked body.
_CHUNK_SIZE: Final = 0
_CHUNK_DATA: Final = 1
_CHUNK_DATA_END: Final = 2
_CHUNK_TRAILER: Final = 3


class ProtocolError(Exception):
    """The engine's bytes are not a valid HTTP/1.1 response."""


def is_token(value: bytes) -> bool:
    return bool(value) and not value.translate(None, _TOKEN)


class ResponseParser:
    """An incremental parser for one HTTP/1.1 response to a request this client sent.

    `feed()` bytes as they arrive, `read_head()` until it returns True (1xx heads are skipped),
    then `read_body()` for whatever body bytes the buffer holds, and `eof()` when the peer
    closes. Raises ProtocolError on anything malformed. No I/O, no Trio.
    """

    __slots__ = (
        "_buf",
        "_chunk",
        "_head_request",
        "_mode",
        "_pos",
        "_remaining",
        "_trailer_bytes",
        "done",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self, *, head_request: bool = False) -> None:
        self._buf = b""
        self._pos = 0
        self._head_request = head_request
        self._mode = _DONE
        self._chunk = _CHUNK_SIZE
        self._remaining = 0
        self._trailer_bytes = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # lowercase names, hop-by-hop dropped
        self.keep_alive = False
        self.done = False  # the whole body has been returned by read_body()

    @property
    def reusable(self) -> bool:
        """The response ended cleanly, the engine keeps the connection, nothing extra came."""
        return self.done and self.keep_alive and self._pos == len(self._buf)

    def feed(self, data: bytes) -> None:
        if self._pos >= len(self._buf):
            self._buf = data
        else:
            self._buf = self._buf[self._pos :] + data
        self._pos = 0

    # -- head ----------------------------------------------------------------------------------
    def read_head(self) -> bool:
        """Parse the response head if the buffer holds all of it; True once it has."""
        while True:
            buf, pos = self._buf, self._pos
            end = buf.find(b"\r\n\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_HEAD_BYTES:
                    raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
                return False
            if end - pos > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
            block = buf[pos:end]
            lines = block.split(b"\r\n")
            self._pos = end + 4
            # Every byte of a head is a field-value character or part of a CRLF line break.
            breaks = len(lines) - 1
            if (
                block.translate(None, _HEAD_CHARS)
                or block.count(b"\n") != breaks
                or block.count(b"\r") != breaks
            ):
                raise ProtocolError(f"invalid characters in response head {block[:200]!r}")
            line = lines[0]
            # status-line = HTTP-version SP 3DIGIT [ SP reason-phrase ]  (reason may be absent)
            if (
                len(line) < 12
                or line[:7] != b"HTTP/1."
                or line[7:8] not in b"01"
                or line[8:9] != b" "
                or line[9:12].translate(None, _DIGITS)
                or line[12:13] not in b" "
                or line[9:10] == b"0"
            ):
                raise ProtocolError(f"bad status line {line[:100]!r}")
            status = int(line[9:12])
            if status >= 200:
                self._parse_fields(lines, status, http10=line[7:8] == b"0")
                return True
            if status == 101:
                raise ProtocolError("unexpected 101 Switching Protocols")
            # 100 Continue, 103 Early Hints: informational, followed by the real response.
            for header in lines[1:]:
                name, colon, _ = header.partition(b":")
                if not colon or not is_token(name):
                    raise ProtocolError(f"bad header line {header[:100]!r}")

    def _parse_fields(self, lines: list[bytes], status: int, *, http10: bool) -> None:
        headers: list[tuple[bytes, bytes]] = []
        content_length: bytes | None = None
        chunked = False
        close = http10  # HTTP/1.0 connections are never reused (as in h11)
        for line in lines[1:]:  # the characters were checked by read_head()
            name, colon, value = line.partition(b":")
            if not colon or not name or name.translate(None, _TOKEN):
                raise ProtocolError(f"bad header line {line[:100]!r}")
            value = value.strip(b" \t")
            name = name.lower()
            if name not in _RESPONSE_DROP and name != b"content-length":
                headers.append((name, value))
            elif name == b"content-length":
                lengths = {v.strip(b" \t") for v in value.split(b",")}
                if len(lengths) != 1:
                    raise ProtocolError(f"conflicting Content-Length {value[:100]!r}")
                value = lengths.pop()
                if (
                    not value
                    or value.translate(None, _DIGITS)
                    or len(value) > 18
                    or (content_length is not None and value != content_length)
                ):
                    raise ProtocolError(f"bad Content-Length {value[:100]!r}")
                if content_length is None:
                    content_length = value
                    headers.append((name, value))
            elif name == b"transfer-encoding":
                if chunked or value.lower() != b"chunked":
                    raise ProtocolError(f"unsupported Transfer-Encoding {value[:100]!r}")
                chunked = True
            elif name == b"connection" and b"close" in (
                t.strip(b" \t") for t in value.lower().split(b",")
            ):
                close = True
        self.status = status
        self.keep_alive = not close
        if self._head_request or status in (204, 304):
            self._mode = _DONE
            self.done = True
        elif chunked:
            self._mode, self._chunk = _CHUNKED, _CHUNK_SIZE
            if content_length is not None:  # Transfer-Encoding wins; the length is not ours
                headers = [h for h in headers if h[0] != b"content-length"]
        elif content_length is not None:
            self._remaining = int(content_length)
            self._mode = _LENGTH if self._remaining else _DONE
            self.done = not self._remaining
        else:
            self._mode = _UNTIL_CLOSE
            self.keep_alive = False
        self.headers = headers

    # -- body ----------------------------------------------------------------------------------
    def read_body(self) -> bytes:
        """Every body byte the buffer holds now (b"" if none); sets `done` at the end."""
        mode = self._mode
        if mode == _LENGTH:
            buf, pos = self._buf, self._pos
            take = min(len(buf) - pos, self._remaining)
            if not take:
                return b""
            self._pos = pos + take
            self._remaining -= take
            if not self._remaining:
                self._mode = _DONE
                self.done = True
            return buf[pos : pos + take]
        if mode == _CHUNKED:
            return self._read_chunked()
        if mode == _UNTIL_CLOSE:
            data = self._buf[self._pos :]
            self._pos = len(self._buf)
            return data
        return b""

    @property
    def chunked(self) -> bool:
        """The rest of the body is in the chunked transfer coding (the head was read, the
        body is not over)."""
        return self._mode == _CHUNKED

    def read_body_framed(self) -> bytes:
        """For a chunked body: every body byte the buffer holds now, as the bytes that carry
        it on another chunked HTTP/1.1 connection (b"" if none). Complete chunks already in
        the form h11 writes (lowercase hex size, no leading zero, no extension) come back as
        they came, one slice of the input with no re-framing; any other data (a chunk cut by
        the end of the buffer, extensions, another spelling of the size) is decoded and framed
        anew as one chunk. The last chunk and trailers are consumed but not returned: the
        connection that carries the body ends it itself. Sets `done` at the end."""
        if self._mode != _CHUNKED:
            raise ProtocolError("read_body_framed() needs a chunked body")
        parts: list[bytes] = []
        if self._chunk == _CHUNK_SIZE:
            buf = self._buf
            start = pos = self._pos
            end = len(buf)
            canonical = _CANONICAL_CHUNK_SIZE.match
            while (size_line := canonical(buf, pos)) is not None:
                data = size_line.end()
                stop = data + int(buf[pos : data - 2], 16)
                if stop + 2 > end or buf[stop : stop + 2] != b"\r\n":
                    break
                pos = stop + 2
            if pos > start:
                self._pos = pos
                if pos == end:  # the common case: whole chunks and nothing else
                    return buf[start:pos]
                parts.append(buf[start:pos])
        rest = self._read_chunked()
        if rest:
            parts.append(b"%x\r\n%s\r\n" % (len(rest), rest))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_chunked(self) -> bytes:
        buf, pos = self._buf, self._pos
        end = len(buf)
        parts: list[bytes] = []
        if self._chunk == _CHUNK_SIZE:
            run, pos = _plain_chunk_run(buf, pos)
            if run:
                parts.append(run)
        plain_size_line = _PLAIN_CHUNK_SIZE.match
        while pos < end:
            state = self._chunk
            if state == _CHUNK_SIZE and (plain := plain_size_line(buf, pos)) is not None:
                # The common case in one step: a size line without extensions or whitespace,
                # then the whole chunk and its CRLF. Anything else takes the steps below.
                start = plain.end()
                stop = start + int(buf[pos : start - 2], 16)
                if stop > start and stop + 2 <= end and buf.startswith(b"\r\n", stop):
                    parts.append(buf[start:stop])
                    pos = stop + 2
                    continue
            if state == _CHUNK_DATA:
                take = min(end - pos, self._remaining)
                parts.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._chunk = _CHUNK_DATA_END
                continue
            if state == _CHUNK_DATA_END:
                after = self._data_end(buf, pos, end)
            elif state == _CHUNK_SIZE:
                after = self._size_line(buf, pos, end)
            else:
                after = self._trailer_line(buf, pos, end)
            if after is None:  # the rest of the line has not arrived
                break
            pos = after
            if self.done:
                break
        self._pos = pos
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def _data_end(self, buf: bytes, pos: int, end: int) -> int | None:
        """The CRLF after a chunk's data: where the next size line starts."""
        if buf[pos : pos + 2] != b"\r\n"[: end - pos]:
            raise ProtocolError("chunk data not followed by CRLF")
        if end - pos < 2:
            return None
        self._chunk = _CHUNK_SIZE
        return pos + 2

    def _size_line(self, buf: bytes, pos: int, end: int) -> int | None:
        """A chunk-size line (extensions ignored): where the chunk's data starts."""
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if end - pos > MAX_CHUNK_LINE:
                raise ProtocolError("chunk-size line too long")
            return None
        line = buf[pos:eol]
        size, semicolon, _ = line.partition(b";")
        if not semicolon:  # whitespace may trail the size, not precede the ';'
            size = size.rstrip(b" \t")
        if (
            not size
            or len(size) > 16
            or size.translate(None, _HEX)
            or line.translate(None, _FIELD_VALUE)
        ):
            raise ProtocolError(f"bad chunk size line {line[:100]!r}")
        self._remaining = int(size, 16)
        self._chunk = _CHUNK_DATA if self._remaining else _CHUNK_TRAILER
        return eol + 2

    def _trailer_line(self, buf: bytes, pos: int, end: int) -> int | None:
        """One line of the trailer section (trailers are dropped); the empty one ends the
        body."""
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if self._trailer_bytes + end - pos > MAX_HEAD_BYTES:
                raise ProtocolError("trailer section too large")
            return None
        if eol == pos:
            self._mode = _DONE
            self.done = True
            return pos + 2
        line = buf[pos:eol]
        name, colon, _ = line.partition(b":")
        if not colon or not is_token(name) or line.translate(None, _FIELD_VALUE):
            raise ProtocolError(f"bad trailer line {line[:100]!r}")
        self._trailer_bytes += eol + 2 - pos
        return eol + 2

    @classmethod
    def in_chunked_body(cls) -> ResponseParser:
        """A parser positioned at the start of a chunked body whose head was read elsewhere."""
        parser = cls()
        parser._mode = _CHUNKED
        return parser

    def eof(self) -> None:
        """The engine closed the connection: the end of an until-close body, else an error."""
        self.keep_alive = False
        if self._mode == _UNTIL_CLOSE:
            self._mode = _DONE
            self.done = True
        elif not self.done:
            raise ProtocolError("connection closed before the end of the response body")


class ChunkedDecoder:
    """The chunked transfer coding (RFC 9112 §7.1) of a body whose head was read elsewhere,
    decoded by this module's response codec: `feed()` the raw body bytes as they arrive and
    get back the data they complete; `done` once the last chunk and trailers have come. No
    I/O; raises ValueError on malformed framing."""

    __slots__ = ("_parser",)

    def __init__(self) -> None:
        self._parser = ResponseParser.in_chunked_body()

    @property
    def done(self) -> bool:
        return self._parser.done

    def feed(self, data: bytes) -> bytes:
        """The body data in `data` and what came before it (b"" if none yet)."""
        parser = self._parser
        parser.feed(data)
        try:
            return parser.read_body()
        except ProtocolError as exc:
            raise ValueError(str(exc)) from exc


def _plain_chunk_run(buf: bytes, pos: int) -> tuple[bytes, int]:
    """The data of the complete chunks from `pos` (at a chunk-size line) up to the last chunk,
    and the position after them, when they have the shape of an event stream: plain size
    lines and no CRLF inside the data. Found with a few passes over the buffer in C rather
    than a Python step per chunk. (b"", pos) if there
    are fewer than two such chunks or the shape does not hold; the step-by-step parser then
    does the same work.

    Splitting at CRLF gives size, data, size, data, ...; a CRLF inside some chunk's data cuts
    that chunk's piece shorter than its declared size, so nothing is taken then."""
    pieces = buf[pos:].split(b"\r\n")
    pairs = (len(pieces) - 1) // 2  # pairs of pieces with a CRLF after both: complete
    sizes = pieces[0 : 2 * pairs : 2]
    if b"0" in sizes:  # the last chunk (in its usual spelling): stop before it
        pairs = sizes.index(b"0")
        del sizes[pairs:]
    if pairs < 2:
        return b"", pos
    widths = list(map(len, sizes))
    if min(widths) == 0 or max(widths) > 16 or b"".join(sizes).translate(None, _HEX):
        return b"", pos
    values = list(map(int, sizes, repeat(16, pairs)))
    data = pieces[1 : 2 * pairs : 2]
    if 0 in values or values != list(map(len, data)):
        return b"", pos
    return b"".join(data), pos + sum(widths) + sum(values) + 4 * pairs


def encode_request_head(
    method: bytes, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]], body_length: int
) -> bytes:
    """The request head, with our Host and Content-Length and the caller's end-to-end headers
    (hop-by-hop ones, including those named by Connection, dropped). ValueError if invalid."""
    if not is_token(method) or not target or target.translate(None, TARGET_CHARS):
        raise ValueError(f"invalid request line {method[:20]!r} {target[:100]!r}")
    parts = [
        method,
        b" ",
        target,
        b" HTTP/1.1\r\nhost: ",
        host,
        b"\r\ncontent-length: ",
        b"%d" % body_length,
    ]
    connection: list[bytes] | None = None
    for name, value in headers:
        lname = name.lower()
        if lname in _REQUEST_DROP:
            if lname == b"connection":
                connection = (connection or []) + [
                    t.strip(b" \t") for t in value.lower().split(b",")
                ]
            continue
        if not name or name.translate(None, _TOKEN):
            raise ValueError(f"invalid header name {name[:100]!r}")
        parts += (b"\r\n", name, b": ", value)
    if connection:  # rare: drop the headers the client's Connection header names
        named = frozenset(connection) | {b"connection"}
        return encode_request_head(
            method, target, host, [h for h in headers if h[0].lower() not in named], body_length
        )
    parts.append(b"\r\n\r\n")
    head = b"".join(parts)
    # Values may hold only field-value characters: a CR or LF in one would split the head.
    breaks = (len(parts) - 8) // 4 + 4  # 7 parts, 4 per header, 1 end: 4 CRLFs + 1 each
    if (
        head.translate(None, _HEAD_CHARS)
        or head.count(b"\n") != breaks
        or head.count(b"\r") != breaks
    ):
        raise ValueError("invalid characters in a header value")
    return head
