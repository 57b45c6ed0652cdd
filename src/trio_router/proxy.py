"""The upstream half of the serving path: a lean keep-alive HTTP/1.1 client for engines.

`UpstreamPool` speaks HTTP/1.1 over non-blocking TCP sockets driven by Trio, and keeps idle
connections per origin (`http://host:port`). One exchange is
`async with pool.request(...) as response:`; the block is entered once the response head has
arrived, and `async for chunk in response` yields the body as it arrives from the socket:
everything already received, de-chunked, in one piece. Nothing is buffered whole, so a slow
reader slows the engine down through TCP backpressure.

The wire format is handled by `_ResponseParser`, a small HTTP/1.1 response codec written for
this one job (responses to our own requests, never pipelined). It validates like h11 does
(tokens, field values, status line, Content-Length, chunk framing) at a fraction of h11's CPU
cost per request, which dominated this client's profile; the tests check it against h11.

Failures are translated into trio_router's errors here, and only here:

- `EngineUnreachableError` (502): the request was not delivered -- connect refused or timed out,
  or the connection was closed or reset before any byte of a response. A stale pooled
  keep-alive connection is retried once on a fresh connection before this is raised. This is
  the one error after which the request may be sent to another engine.
- `UpstreamTimeoutError` (504): the engine was silent for longer than `read_timeout` while the
  request was being sent, while the head was awaited, or between two body chunks.
- `UpstreamError` (502): anything else after the request was delivered (reset mid-body, a
  malformed response).

The caller may pass a `client_gone` check: it is asked before every wait for the engine and
every CLIENT_CHECK_S while waiting, and when it reports that the client left, the exchange
stops with `ClientGoneError` and its connection is closed (the engine sees the close). That
needs no extra task per request.

Timeouts are Trio cancel scopes, so a test clock and outer scopes see them.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, suppress
from itertools import repeat
from types import TracebackType
from typing import Final
from urllib.parse import urlsplit

import trio

from .errors import UpstreamError, UpstreamTimeoutError

__all__ = ["ChunkedDecoder", "ClientGoneError", "EngineUnreachableError", "UpstreamPool",
           "UpstreamResponse", "fetch"]

READ_SIZE: Final = 65536  # bytes asked of the socket per receive
CHECKPOINT_EVERY: Final = 16  # body chunks returned at once, at most, between two checkpoints
CLIENT_CHECK_S: Final = 0.25  # how often a long wait for the engine asks `client_gone`
MAX_HEAD_BYTES: Final = 64 * 1024  # largest response head (or trailer section) accepted
MAX_CHUNK_LINE: Final = 4096  # longest chunk-size line (with extensions) accepted
INLINE_BODY_BYTES: Final = 64 * 1024  # smaller bodies go out in the same write as the head
MAX_ORIGINS: Final = 1024  # origins remembered before those without idle connections are dropped

# Never forwarded to an engine: the pool sets Host and Content-Length itself, and hop-by-hop
# headers (RFC 9110 §7.6.1) describe the client's connection, not this one.
_REQUEST_DROP: Final = frozenset({
    b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"te",
    b"trailer", b"upgrade", b"proxy-connection", b"proxy-authorization", b"expect",
})
# Never handed back to the caller: they describe the engine's connection and framing, which
# the router's own server redoes for its client. Content-Length is end-to-end and is kept.
_RESPONSE_DROP: Final = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
    b"proxy-connection", b"proxy-authenticate",
})

# Character classes (RFC 9110 §5.6.2, §5.5), used as `bytes.translate(None, delete=...)`: what
# is left after deleting the allowed characters is what is wrong. Cheaper than a regex.
_TOKEN: Final = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_FIELD_VALUE: Final = bytes(range(0x21, 0x7F)) + bytes(range(0x80, 0x100)) + b" \t"
_HEAD_CHARS: Final = _FIELD_VALUE + b"\r\n"
_TARGET: Final = bytes(range(0x21, 0x7F))
_HEX: Final = b"0123456789abcdefABCDEF"
_DIGITS: Final = b"0123456789"
_PLAIN_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,16}\r\n")  # a chunk-size line, nothing more

# Body framing modes of _ResponseParser.
_DONE: Final = 0
_LENGTH: Final = 1
_CHUNKED: Final = 2
_UNTIL_CLOSE: Final = 3
# Positions inside a chunked body.
_CHUNK_SIZE: Final = 0
_CHUNK_DATA: Final = 1
_CHUNK_DATA_END: Final = 2
_CHUNK_TRAILER: Final = 3


class EngineUnreachableError(UpstreamError):
    """The request never reached the engine (connect failed, or the connection closed before
    any response byte); safe to send it to another engine. `connect_failed`: no connection
    could be opened at all (refused, unreachable, unresolvable)."""

    def __init__(self, message: str, *, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class ClientGoneError(Exception):
    """The caller's `client_gone` check said the client left: the exchange was dropped and
    its connection closed."""


# Opens a connected stream socket to (host, port); raises OSError.
Connector = Callable[[str, int], Awaitable[socket.socket]]


class _StaleConnectionError(Exception):
    """A connection closed or reset before any response byte: retried once, then unreachable."""


class _ProtocolError(Exception):
    """The engine's bytes are not a valid HTTP/1.1 response."""


def _is_token(value: bytes) -> bool:
    return bool(value) and not value.translate(None, _TOKEN)


class _ResponseParser:
    """An incremental parser for one HTTP/1.1 response to a request this client sent.

    `feed()` bytes as they arrive, `read_head()` until it returns True (1xx heads are skipped),
    then `read_body()` for whatever body bytes the buffer holds, and `eof()` when the peer
    closes. Raises _ProtocolError on anything malformed. No I/O, no Trio.
    """

    __slots__ = ("_buf", "_chunk", "_head_request", "_mode", "_pos", "_remaining",
                 "_trailer_bytes", "done", "headers", "keep_alive", "status")

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
            self._buf = self._buf[self._pos:] + data
        self._pos = 0

    # -- head ----------------------------------------------------------------------------------
    def read_head(self) -> bool:
        """Parse the response head if the buffer holds all of it; True once it has."""
        while True:
            buf, pos = self._buf, self._pos
            end = buf.find(b"\r\n\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_HEAD_BYTES:
                    raise _ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
                return False
            if end - pos > MAX_HEAD_BYTES:
                raise _ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
            block = buf[pos:end]
            lines = block.split(b"\r\n")
            self._pos = end + 4
            # Every byte of a head is a field-value character or part of a CRLF line break.
            breaks = len(lines) - 1
            if (block.translate(None, _HEAD_CHARS) or block.count(b"\n") != breaks
                    or block.count(b"\r") != breaks):
                raise _ProtocolError(f"invalid characters in response head {block[:200]!r}")
            line = lines[0]
            # status-line = HTTP-version SP 3DIGIT [ SP reason-phrase ]  (reason may be absent)
            if (len(line) < 12 or line[:7] != b"HTTP/1." or line[7:8] not in b"01"
                    or line[8:9] != b" " or line[9:12].translate(None, _DIGITS)
                    or line[12:13] not in b" " or line[9:10] == b"0"):
                raise _ProtocolError(f"bad status line {line[:100]!r}")
            status = int(line[9:12])
            if status >= 200:
                self._parse_fields(lines, status, http10=line[7:8] == b"0")
                return True
            if status == 101:
                raise _ProtocolError("unexpected 101 Switching Protocols")
            # 100 Continue, 103 Early Hints: informational, followed by the real response.
            for header in lines[1:]:
                name, colon, _ = header.partition(b":")
                if not colon or not _is_token(name):
                    raise _ProtocolError(f"bad header line {header[:100]!r}")

    def _parse_fields(self, lines: list[bytes], status: int, *, http10: bool) -> None:
        headers: list[tuple[bytes, bytes]] = []
        content_length: bytes | None = None
        chunked = False
        close = http10  # HTTP/1.0 connections are never reused (as in h11)
        for line in lines[1:]:  # the characters were checked by read_head()
            name, colon, value = line.partition(b":")
            if not colon or not name or name.translate(None, _TOKEN):
                raise _ProtocolError(f"bad header line {line[:100]!r}")
            value = value.strip(b" \t")
            name = name.lower()
            if name not in _RESPONSE_DROP and name != b"content-length":
                headers.append((name, value))
            elif name == b"content-length":
                lengths = {v.strip(b" \t") for v in value.split(b",")}
                if len(lengths) != 1:
                    raise _ProtocolError(f"conflicting Content-Length {value[:100]!r}")
                value = lengths.pop()
                if (not value or value.translate(None, _DIGITS) or len(value) > 18
                        or (content_length is not None and value != content_length)):
                    raise _ProtocolError(f"bad Content-Length {value[:100]!r}")
                if content_length is None:
                    content_length = value
                    headers.append((name, value))
            elif name == b"transfer-encoding":
                if chunked or value.lower() != b"chunked":
                    raise _ProtocolError(f"unsupported Transfer-Encoding {value[:100]!r}")
                chunked = True
            elif name == b"connection" and b"close" in (
                    t.strip(b" \t") for t in value.lower().split(b",")):
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
            return buf[pos:pos + take]
        if mode == _CHUNKED:
            return self._read_chunked()
        if mode == _UNTIL_CLOSE:
            data = self._buf[self._pos:]
            self._pos = len(self._buf)
            return data
        return b""

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
                stop = start + int(buf[pos:start - 2], 16)
                if stop > start and stop + 2 <= end and buf.startswith(b"\r\n", stop):
                    parts.append(buf[start:stop])
                    pos = stop + 2
                    continue
            if state == _CHUNK_DATA:
                take = min(end - pos, self._remaining)
                parts.append(buf[pos:pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._chunk = _CHUNK_DATA_END
            elif state == _CHUNK_DATA_END:
                if buf[pos:pos + 2] != b"\r\n"[:end - pos]:
                    raise _ProtocolError("chunk data not followed by CRLF")
                if end - pos < 2:
                    break
                pos += 2
                self._chunk = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        raise _ProtocolError("chunk-size line too long")
                    break
                line = buf[pos:eol]
                size, semicolon, _ = line.partition(b";")  # extensions are ignored
                if not semicolon:  # whitespace may trail the size, not precede the ';'
                    size = size.rstrip(b" \t")
                if (not size or len(size) > 16 or size.translate(None, _HEX)
                        or line.translate(None, _FIELD_VALUE)):
                    raise _ProtocolError(f"bad chunk size line {line[:100]!r}")
                pos = eol + 2
                self._remaining = int(size, 16)
                self._chunk = _CHUNK_DATA if self._remaining else _CHUNK_TRAILER
            else:  # trailer section, ended by an empty line; trailers are dropped
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if self._trailer_bytes + end - pos > MAX_HEAD_BYTES:
                        raise _ProtocolError("trailer section too large")
                    break
                if eol == pos:
                    pos += 2
                    self._mode = _DONE
                    self.done = True
                    break
                line = buf[pos:eol]
                name, colon, _ = line.partition(b":")
                if not colon or not _is_token(name) or line.translate(None, _FIELD_VALUE):
                    raise _ProtocolError(f"bad trailer line {line[:100]!r}")
                self._trailer_bytes += eol + 2 - pos
                pos = eol + 2
        self._pos = pos
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def eof(self) -> None:
        """The engine closed the connection: the end of an until-close body, else an error."""
        self.keep_alive = False
        if self._mode == _UNTIL_CLOSE:
            self._mode = _DONE
            self.done = True
        elif not self.done:
            raise _ProtocolError("connection closed before the end of the response body")


class ChunkedDecoder:
    """The chunked transfer coding (RFC 9112 §7.1) of a body whose head was read elsewhere,
    decoded by this module's response codec: `feed()` the raw body bytes as they arrive and
    get back the data they complete; `done` once the last chunk and trailers have come. No
    I/O; raises ValueError on malformed framing."""

    __slots__ = ("_parser",)

    def __init__(self) -> None:
        self._parser = _ResponseParser()
        self._parser._mode = _CHUNKED

    @property
    def done(self) -> bool:
        return self._parser.done

    def feed(self, data: bytes) -> bytes:
        """The body data in `data` and what came before it (b"" if none yet)."""
        parser = self._parser
        parser.feed(data)
        try:
            return parser.read_body()
        except _ProtocolError as exc:
            raise ValueError(str(exc)) from exc


def _plain_chunk_run(buf: bytes, pos: int) -> tuple[bytes, int]:
    """The data of the complete chunks from `pos` (at a chunk-size line) up to the last chunk,
    and the position after them, when they have the shape of an event stream: plain size
    lines and no CRLF inside the data. Found with a few passes over the buffer in C rather
    than a Python step per chunk (27 against 48 µs for 64 SSE events). (b"", pos) if there
    are fewer than two such chunks or the shape does not hold; the step-by-step parser then
    does the same work.

    Splitting at CRLF gives size, data, size, data, ...; a CRLF inside some chunk's data cuts
    that chunk's piece shorter than its declared size, so nothing is taken then."""
    pieces = buf[pos:].split(b"\r\n")
    pairs = (len(pieces) - 1) // 2  # pairs of pieces with a CRLF after both: complete
    sizes = pieces[0:2 * pairs:2]
    if b"0" in sizes:  # the last chunk (in its usual spelling): stop before it
        pairs = sizes.index(b"0")
        del sizes[pairs:]
    if pairs < 2:
        return b"", pos
    widths = list(map(len, sizes))
    if min(widths) == 0 or max(widths) > 16 or b"".join(sizes).translate(None, _HEX):
        return b"", pos
    values = list(map(int, sizes, repeat(16, pairs)))
    data = pieces[1:2 * pairs:2]
    if 0 in values or values != list(map(len, data)):
        return b"", pos
    return b"".join(data), pos + sum(widths) + sum(values) + 4 * pairs


def _encode_head(method: bytes, target: bytes, host: bytes,
                 headers: list[tuple[bytes, bytes]], body_length: int) -> bytes:
    """The request head, with our Host and Content-Length and the caller's end-to-end headers
    (hop-by-hop ones, including those named by Connection, dropped). ValueError if invalid."""
    if not _is_token(method) or not target or target.translate(None, _TARGET):
        raise ValueError(f"invalid request line {method[:20]!r} {target[:100]!r}")
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host,
             b"\r\ncontent-length: ", b"%d" % body_length]
    connection: list[bytes] | None = None
    for name, value in headers:
        lname = name.lower()
        if lname in _REQUEST_DROP:
            if lname == b"connection":
                connection = (connection or []) + [
                    t.strip(b" \t") for t in value.lower().split(b",")]
            continue
        if not name or name.translate(None, _TOKEN):
            raise ValueError(f"invalid header name {name[:100]!r}")
        parts += (b"\r\n", name, b": ", value)
    if connection:  # rare: drop the headers the client's Connection header names
        named = frozenset(connection) | {b"connection"}
        return _encode_head(method, target, host,
                            [h for h in headers if h[0].lower() not in named], body_length)
    parts.append(b"\r\n\r\n")
    head = b"".join(parts)
    # Values may hold only field-value characters: a CR or LF in one would split the head.
    breaks = (len(parts) - 8) // 4 + 4  # 7 parts, 4 per header, 1 end: 4 CRLFs + 1 each
    if (head.translate(None, _HEAD_CHARS) or head.count(b"\n") != breaks
            or head.count(b"\r") != breaks):
        raise ValueError("invalid characters in a header value")
    return head


class _Connection:
    """One TCP connection with exactly one user at a time.

    I/O is tried synchronously on the non-blocking socket first and waits on Trio
    (`wait_readable`/`wait_writable`) only when it would block: a receive that finds data
    already there costs no trip through the scheduler, which is most of the CPU of a small
    exchange. The waits are checkpoints, so cancellation and deadlines apply to them.
    """

    __slots__ = ("idle_since", "raw", "sock")

    def __init__(self, sock: trio.socket.SocketType, raw: socket.socket) -> None:
        self.sock = sock  # the Trio socket: closing it wakes any task waiting on it
        self.raw = raw  # the same socket, for synchronous non-blocking calls
        self.idle_since = 0.0

    async def send_all(self, data: bytes, stall_s: float) -> bool:
        """Send all of `data`, waiting at most `stall_s` at a time for the socket to take more
        (a budget of silence, not of the whole send); False if it stalled that long. OSError
        if the connection is broken."""
        raw = self.raw
        try:
            sent = raw.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            with trio.move_on_after(stall_s) as scope, memoryview(data) as view:
                while sent < len(data):
                    await trio.lowlevel.wait_writable(raw)
                    with suppress(BlockingIOError):
                        sent += raw.send(view[sent:])
                    scope.deadline = trio.current_time() + stall_s
            return not scope.cancelled_caught
        return True

    def recv_nowait(self) -> bytes | None:
        """What the socket holds now (b"" at EOF), or None if nothing is there yet."""
        try:
            return self.raw.recv(READ_SIZE)
        except BlockingIOError:
            return None

    async def recv(self) -> bytes:
        """Wait for data (b"" at EOF); OSError if the connection is broken."""
        while True:
            await trio.lowlevel.wait_readable(self.raw)
            try:
                return self.raw.recv(READ_SIZE)
            except BlockingIOError:
                pass

    def readable(self) -> bool:
        """Data, EOF or an error is waiting: for an idle connection, that means it cannot be
        reused. A peek (one system call) rather than a poll object per check."""
        try:
            self.raw.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def close_now(self) -> None:
        """Close the socket. Synchronous, so it also completes in a cancelled task, at once,
        with nothing to shield or bound; the engine sees the connection end (FIN, or RST if
        unread data was pending)."""
        self.sock.close()


class _Origin:
    """One engine address: how to reach it and its idle connections (newest last)."""

    __slots__ = ("host", "host_header", "idle", "port", "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        host = parts.hostname
        try:
            if parts.scheme != "http" or not host:
                raise ValueError("expected http://host:port")
            port = parts.port  # ValueError if out of range or not a number
            authority = f"[{host}]" if ":" in host else host
            if port is not None:
                authority += f":{port}"
            host_header = authority.encode("ascii")
            if host_header.translate(None, _TARGET):
                raise ValueError("bad characters in the host")
        except ValueError as exc:  # UnicodeEncodeError is one too
            raise EngineUnreachableError(f"engine URL {url!r} is not usable: {exc}") from exc
        self.url = url
        self.host = host
        self.port = port or 80
        self.host_header = host_header
        self.idle: list[_Connection] = []


async def open_tcp_socket(host: str, port: int) -> socket.socket:
    """A TCP connection to `host`:`port` (each resolved address tried in turn), as a
    non-blocking socket with TCP_NODELAY. Raises OSError (socket.gaierror if `host` does not
    resolve). Cancellation closes the socket being connected."""
    addresses = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in addresses:
        raw = socket.socket(family, kind, proto)
        sock = trio.socket.from_stdlib_socket(raw)  # makes it non-blocking
        connected = False
        try:
            await sock.connect(address)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connected = True
        except OSError as exc:
            error = exc
        finally:
            if not connected:
                sock.close()
        if connected:
            return raw
    raise error or OSError(f"no address for {host}")


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to engines, pooled per origin.

    Runs no background task: an idle connection is checked (age, and whether the engine has
    closed it) when it is taken, and `aclose()` closes those still idle. Use it from the Trio
    thread only; its bookkeeping is synchronous, so it needs no lock.

    Args:
        connect_timeout: seconds allowed to open a TCP connection.
        read_timeout: longest silence tolerated from an engine, while sending the request,
            waiting for the head, or between two body chunks.
        max_idle_per_origin: idle connections kept per engine; more are closed on release.
        max_idle_s: an idle connection older than this is closed rather than reused. Keep it
            below the engines' keep-alive timeout (5 s for vLLM/uvicorn and Hypercorn).
        connect: opens a connected stream socket to (host, port), raising OSError; the
            default is TCP (`open_tcp_socket`). Tests pass one end of a socket pair.
    """

    def __init__(self, *, connect_timeout: float, read_timeout: float,
                 max_idle_per_origin: int = 64, max_idle_s: float = 4.0,
                 connect: Connector = open_tcp_socket) -> None:
        if connect_timeout <= 0 or read_timeout <= 0 or max_idle_s < 0:
            raise ValueError("connect_timeout and read_timeout must be > 0, max_idle_s >= 0")
        if max_idle_per_origin < 0:
            raise ValueError(f"max_idle_per_origin must be >= 0, got {max_idle_per_origin}")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._max_idle = max_idle_per_origin
        self._max_idle_s = max_idle_s
        self._open = connect
        self._origins: dict[str, _Origin] = {}
        self._closed = False
        self.connections_opened = 0  # total TCP connections opened; for metrics and tests

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (see `close`), with a checkpoint."""
        self.close()
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """Close every idle connection. Exchanges still running keep their connection and
        close it when they end; nothing is pooled after this. Synchronous: it completes in
        a cancelled task too."""
        self._closed = True
        for origin in self._origins.values():
            idle, origin.idle = origin.idle, []
            for conn in idle:
                conn.close_now()
        self._origins.clear()

    def idle_count(self, base_url: str | None = None) -> int:
        """Idle connections for one origin, or for all."""
        if base_url is not None:
            origin = self._origins.get(base_url)
            return 0 if origin is None else len(origin.idle)
        return sum(len(o.idle) for o in self._origins.values())

    def request(self, base_url: str, method: bytes, target: bytes,
                headers: list[tuple[bytes, bytes]], body: bytes, *,
                client_gone: Callable[[], bool] | None = None
                ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """One exchange with the engine at `base_url` (like "http://10.0.0.7:8000").

        `target` is the path with its query string. `headers` are the end-to-end headers to
        forward; Host, Content-Length and hop-by-hop headers in it are dropped and the pool
        sets Host and Content-Length itself. Entering the returned context sends the request
        and returns the `UpstreamResponse` once its head has arrived (raising the errors of
        this module's docstring). Leaving it returns the connection to the pool if the body
        was read to the end, and closes it otherwise -- also when the task is cancelled, so a
        client that goes away closes the engine's connection at once. `client_gone`, if
        given, is polled while waiting for the engine (ClientGoneError when it says so).
        """
        return UpstreamResponse(self, base_url, method, target, headers, body, client_gone)

    # -- internals (synchronous bookkeeping; no await between read and write) --------------
    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            if len(self._origins) >= MAX_ORIGINS:  # engines come and go: forget unused ones
                self._origins = {k: o for k, o in self._origins.items() if o.idle}
            origin = self._origins[base_url] = _Origin(base_url)
        return origin

    def _checkout(self, origin: _Origin) -> _Connection | None:
        """Take the most recently used idle connection that still looks alive."""
        idle = origin.idle
        if not idle:
            return None
        oldest_allowed = trio.current_time() - self._max_idle_s
        while idle:
            conn = idle.pop()
            if conn.idle_since < oldest_allowed:
                # The newest idle connection is too old, so all are: the engine may be about
                # to close them (keep-alive timeout), which would cost a retry each.
                conn.close_now()
                self._discard_idle(origin)
                return None
            # Readable while idle means EOF (the engine closed it) or stray bytes: unusable.
            if conn.readable():
                conn.close_now()
                continue
            return conn
        return None

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        """Pool `conn` (its exchange ended cleanly), unless the pool is closed or full."""
        if not self._closed and len(origin.idle) < self._max_idle:
            conn.idle_since = trio.current_time()
            origin.idle.append(conn)
        else:
            conn.close_now()

    def _discard_idle(self, origin: _Origin) -> None:
        idle, origin.idle = origin.idle, []
        for conn in idle:
            conn.close_now()

    async def _connect(self, origin: _Origin) -> _Connection:
        """A new connection to `origin`; EngineUnreachableError on refusal or timeout."""
        with trio.move_on_after(self._connect_timeout):
            try:
                raw = await self._open(origin.host, origin.port)
            except socket.gaierror as exc:
                raise EngineUnreachableError(
                    f"cannot resolve engine {origin.url}: {exc}", connect_failed=True) from exc
            except OSError as exc:
                raise EngineUnreachableError(
                    f"cannot connect to engine {origin.url}: {exc}", connect_failed=True
                ) from exc
            self.connections_opened += 1
            return _Connection(trio.socket.from_stdlib_socket(raw), raw)
        raise EngineUnreachableError(
            f"cannot connect to engine {origin.url}: no answer within "
            f"{self._connect_timeout:g} s (proxy.connect_timeout_s)")


class UpstreamResponse:
    """The engine's answer: `status`, `headers` (names lowercase, hop-by-hop ones dropped,
    Content-Length kept), and the body as an async iterator of non-empty byte chunks, each
    holding what had arrived from the socket when it was asked for.

    Iterating raises `UpstreamTimeoutError` after `read_timeout` of silence and `UpstreamError`
    if the connection breaks before the body is complete. A chunk that is already in the
    socket buffer is returned without a trip through the scheduler (no checkpoint); waiting
    for one is a checkpoint, and so is every CHECKPOINT_EVERY-th chunk returned without one, so
    that a body that is always there at once (a fast engine, a fast client) neither starves
    other tasks nor delays a cancellation. Cancelling the iterating task makes the enclosing
    `async with` close the connection.
    """

    __slots__ = ("_base_url", "_body", "_client_gone", "_conn", "_done", "_method", "_origin",
                 "_parser", "_pool", "_req_headers", "_target", "_unchecked", "headers",
                 "status")

    def __init__(self, pool: UpstreamPool, base_url: str, method: bytes, target: bytes,
                 headers: list[tuple[bytes, bytes]], body: bytes,
                 client_gone: Callable[[], bool] | None = None) -> None:
        self._pool = pool
        self._client_gone = client_gone
        self._base_url = base_url
        self._method = method
        self._target = target
        self._req_headers = headers
        self._body = body
        self._conn: _Connection | None = None
        self._origin: _Origin | None = None
        self._parser: _ResponseParser | None = None
        self._done = False
        self._unchecked = 0  # chunks returned since the last checkpoint
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    # -- the exchange ------------------------------------------------------------------------
    async def __aenter__(self) -> UpstreamResponse:
        pool = self._pool
        origin = self._origin = pool._origin(self._base_url)
        try:
            head = _encode_head(self._method, self._target, origin.host_header,
                                self._req_headers, len(self._body))
        except ValueError as exc:
            raise UpstreamError(f"cannot send request to engine {origin.url}: {exc}") from exc
        conn = pool._checkout(origin)
        if conn is not None:
            try:
                await self._exchange(conn, head)
                return self
            except _StaleConnectionError:
                # The engine closed this kept-alive connection before our request reached it
                # (keep-alive timeout, restart). Nothing was processed: retry on a fresh one.
                pool._discard_idle(origin)
        conn = await pool._connect(origin)
        try:
            await self._exchange(conn, head)
        except _StaleConnectionError as exc:
            raise EngineUnreachableError(
                f"engine {origin.url} closed the connection before answering: "
                f"{exc.__cause__ or 'EOF'}") from exc.__cause__
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        conn, parser = self._conn, self._parser
        if conn is None or parser is None:
            return
        self._conn = None
        if not parser.done and exc_type is None:
            try:  # an unread body may already be here whole (or be empty): then it can end
                while parser.read_body():
                    pass
            except _ProtocolError:
                pass
        if parser.reusable:
            assert self._origin is not None
            self._pool._release(self._origin, conn)
        else:  # partially read, failed, cancelled or not kept alive: close now
            conn.close_now()

    async def _exchange(self, conn: _Connection, head: bytes) -> None:
        """Send the request on `conn` and read up to the response head. Owns `conn` until it
        returns: on any failure (or cancellation) `conn` is closed before the error leaves."""
        assert self._origin is not None
        url = self._origin.url
        parser = _ResponseParser(head_request=self._method == b"HEAD")
        read_timeout = self._pool._read_timeout
        ok = False
        try:
            body = self._body
            try:
                if len(body) <= INLINE_BODY_BYTES:
                    sent = await conn.send_all(head + body if body else head, read_timeout)
                else:
                    sent = (await conn.send_all(head, read_timeout)
                            and await conn.send_all(body, read_timeout))
            except OSError as exc:
                raise _StaleConnectionError from exc
            if not sent:
                raise UpstreamTimeoutError(
                    f"engine {url} stopped taking the request for {read_timeout:g} s "
                    "(proxy.read_timeout_s)")
            received = False
            while True:
                try:
                    data = await self._recv(conn, read_timeout)
                except OSError as exc:
                    if not received:
                        raise _StaleConnectionError from exc
                    raise UpstreamError(
                        f"engine {url} reset the connection while sending the response "
                        f"head: {exc}") from exc
                if data is None:
                    raise UpstreamTimeoutError(
                        f"engine {url} sent no response within {read_timeout:g} s "
                        "(proxy.read_timeout_s)")
                if not data:
                    if not received:
                        raise _StaleConnectionError
                    raise UpstreamError(
                        f"engine {url} closed the connection in the response head")
                received = True
                parser.feed(data)
                if parser.read_head():
                    break
            self.status = parser.status
            self.headers = parser.headers
            self._parser = parser
            self._conn = conn
            ok = True
        except _ProtocolError as exc:
            raise UpstreamError(f"engine {url} sent a malformed response: {exc}") from exc
        finally:
            if not ok:
                conn.close_now()

    async def _recv(self, conn: _Connection, silence_s: float) -> bytes | None:
        """Wait for `conn`'s next bytes (b"" at EOF) through at most `silence_s` of silence;
        None if none came. The `client_gone` check, if any, is asked before waiting and every
        CLIENT_CHECK_S while waiting: ClientGoneError when it says so."""
        gone = self._client_gone
        deadline = trio.current_time() + silence_s
        while gone is None or not gone():
            with trio.move_on_at(deadline if gone is None
                                 else min(deadline, trio.current_time() + CLIENT_CHECK_S)):
                return await conn.recv()
            if trio.current_time() >= deadline:
                return None
        raise ClientGoneError

    # -- the body ----------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """The whole body has been handed out: the chunk just returned was the last one (so
        the caller can end its own response with it)."""
        return self._parser is not None and self._parser.done

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        parser = self._parser
        if self._conn is None or parser is None:
            if self._done:
                raise StopAsyncIteration
            raise trio.ClosedResourceError("the upstream response was already closed")
        try:
            while True:
                data = parser.read_body()
                if data:
                    self._unchecked += 1
                    if self._unchecked >= CHECKPOINT_EVERY:
                        self._unchecked = 0
                        if self._client_gone is not None and self._client_gone():
                            raise ClientGoneError
                        await trio.lowlevel.checkpoint()
                    return data
                if parser.done:
                    self._done = True
                    raise StopAsyncIteration
                if await self._receive(parser):
                    self._unchecked = 0
        except _ProtocolError as exc:
            raise UpstreamError(
                f"engine {self._base_url} broke off the response body: {exc}") from exc

    async def _receive(self, parser: _ResponseParser) -> bool:
        """Feed the parser what the socket holds, waiting for it if need be; True if it
        waited (a checkpoint)."""
        assert self._conn is not None
        conn = self._conn
        waited = False
        try:
            data = conn.recv_nowait()
            if data is None:  # nothing there yet: wait, within the silence budget
                waited = True
                read_timeout = self._pool._read_timeout
                data = await self._recv(conn, read_timeout)
                if data is None:
                    raise UpstreamTimeoutError(
                        f"engine {self._base_url} was silent for {read_timeout:g} s "
                        "mid-response (proxy.read_timeout_s)")
        except OSError as exc:
            raise UpstreamError(
                f"engine {self._base_url} reset the connection mid-response: {exc}") from exc
        if data:
            parser.feed(data)
        else:
            parser.eof()
        return waited


async def fetch(pool: UpstreamPool, base_url: str, target: bytes,
                headers: list[tuple[bytes, bytes]], *, max_bytes: int) -> tuple[int, bytes]:
    """GET `target` from the engine at `base_url` on `pool`: the status and the whole body.

    For the router's own small requests to an engine (health probes, metrics scrapes): the
    connection is kept alive for the next one when the body was read to its end. Raises this
    module's errors, and `UpstreamError` for a body larger than `max_bytes` (its connection
    is closed). Bound it with a deadline: cancellation closes the connection.
    """
    async with pool.request(base_url, b"GET", target, headers, b"") as response:
        parts: list[bytes] = []
        size = 0
        async for chunk in response:
            size += len(chunk)
            if size > max_bytes:
                raise UpstreamError(f"engine {base_url} answered {target.decode()!r} with "
                                    f"more than {max_bytes} bytes")
            parts.append(chunk)
        return response.status, b"".join(parts)
