"""The HTTP/1.1 side of the fake API server: h11's state machine over one Trio socket
stream, with the few ways the API server answers (a JSON body, a Status, a chunked stream of
JSON lines, a cut connection)."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import h11
import trio

from ..pods import COMPACT, RawObject, status_json

CHUNK_BYTES: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class Exchange:
    """One connection: its stream, and h11's view of it (the server's side). The stream is
    the caller's to close."""

    stream: trio.SocketStream
    conn: h11.Connection

    async def next_request(self) -> h11.Request | None:
        """The next request, once its body has been read (and ignored); None once the client
        has closed the connection."""
        request: h11.Request | None = None
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(CHUNK_BYTES))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def send_json(
        self, status: int, body: RawObject, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        """A whole answer: `status`, `body` as JSON, and `headers` besides."""
        data = json.dumps(body, separators=COMPACT).encode()
        head = h11.Response(
            status_code=status,
            headers=[
                ("content-type", "application/json"),
                ("content-length", str(len(data))),
                *headers,
            ],
        )
        await self.stream.send_all(
            self.conn.send(head)
            + self.conn.send(h11.Data(data=data))
            + self.conn.send(h11.EndOfMessage())
        )

    async def send_status(
        self,
        status: int,
        reason: str,
        message: str,
        headers: Iterable[tuple[str, str]] = (),
        **extra: Any,
    ) -> None:
        """A whole answer whose body is a Status (`extra`: its further fields)."""
        await self.send_json(status, status_json(status, reason, message, **extra), headers)

    async def start_stream(self) -> None:
        """The head of a 200 answer whose JSON body follows in chunks."""
        head = h11.Response(
            status_code=200,
            headers=[("content-type", "application/json"), ("transfer-encoding", "chunked")],
        )
        await self.stream.send_all(self.conn.send(head))

    async def send_lines(self, lines: Sequence[bytes]) -> None:
        """`lines` in one write, each its own chunk (as the API server sends watch events)."""
        await self.stream.send_all(b"".join(self._chunk(line) for line in lines))

    async def end_stream(self, last: Sequence[bytes] = ()) -> None:
        """`last` (each its own chunk), then the end of the chunked body."""
        data = b"".join(self._chunk(line) for line in last)
        await self.stream.send_all(data + self.conn.send(h11.EndOfMessage()))

    async def end_with_error(self, code: int, reason: str, message: str) -> None:
        """End the stream with one ERROR event carrying a Status."""
        line = json.dumps(
            {"type": "ERROR", "object": status_json(code, reason, message)}, separators=COMPACT
        )
        await self.end_stream([line.encode() + b"\n"])

    def reset_on_close(self) -> None:
        """Make closing the stream reset the connection (TCP RST) instead of closing it."""
        self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def _chunk(self, data: bytes) -> bytes:
        return self.conn.send(h11.Data(data=data)) if data else b""
