"""One TCP connection to an engine, driven without a trip through Trio's scheduler when the
socket is ready, and an engine's address with its idle connections (`Origin`): the connection
layer under the pool and the relay (`http.pool`, `http.relay`), above the codec
(`http.codec`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, Final
from urllib.parse import urlsplit

import trio

from .codec import TARGET_CHARS
from .errors import EngineUnreachableError

__all__ = ["READ_SIZE", "Connection", "Connector", "Origin", "open_tcp_socket"]

READ_SIZE: Final = 65536  # bytes asked of the socket per receive
_NUMERIC: Final = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV  # getaddrinfo: no lookup

# Opens a connected stream socket to (host, port); raises OSError.
Connector = Callable[[str, int], Awaitable[socket.socket]]


class Connection:
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

    async def send_all(self, data: bytes | bytearray, stall_s: float) -> bool:
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


class Origin:
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
            if host_header.translate(None, TARGET_CHARS):
                raise ValueError("bad characters in the host")
        except ValueError as exc:  # UnicodeEncodeError is one too
            raise EngineUnreachableError(f"engine URL {url!r} is not usable: {exc}") from exc
        self.url = url
        self.host = host
        self.port = port or 80
        self.host_header = host_header
        self.idle: list[Connection] = []


async def open_tcp_socket(host: str, port: int) -> socket.socket:
    """A TCP connection to `host`:`port` (each resolved address tried in turn), as a
    non-blocking socket with TCP_NODELAY. Raises OSError (socket.gaierror if `host` does not
    resolve). Cancellation closes the socket being connected.

    Neither step passes through the scheduler when it need not wait: an IP address (a
    pod's) is not looked up, and a connection already made when `connect` returns (the
    handshake with a local engine completes within the call) is not waited for."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=_NUMERIC)
    except socket.gaierror:  # a name: looked up in a worker thread
        addresses = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in addresses:
        raw = socket.socket(family, kind | socket.SOCK_NONBLOCK, proto)
        connected = False
        try:
            await _connect(raw, address)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connected = True
        except OSError as exc:
            error = exc
        finally:
            if not connected:  # as a Trio socket closes: no task waits on it any more
                trio.lowlevel.notify_closing(raw)
                raw.close()
        if connected:
            return raw
    raise error or OSError(f"no address for {host}")


async def _connect(raw: socket.socket, address: Any) -> None:
    """Connect the non-blocking `raw` to `address` as Trio's `connect` does (the same errors),
    waiting for the socket only while the connection is still being made."""
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        raw.connect(address)
        return
    except BlockingIOError:  # in progress
        pass
    try:
        raw.getpeername()  # made already (ENOTCONN while in progress, or if it failed)
        return
    except OSError:
        pass
    await trio.lowlevel.wait_writable(raw)
    if err := raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        raise OSError(err, f"Error connecting to {address!r}: {os.strerror(err)}")
