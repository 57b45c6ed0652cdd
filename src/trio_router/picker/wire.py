"""HTTP/2 on the server side, as much of it as the picker's gRPC calls need (RFC 9113), with
HPACK from the `hpack` library.

A gRPC call is a stream: the gateway's headers, its messages in DATA frames, its end; the
picker's head, messages and trailers back. The connection parses what the gateway sends
straight into calls of its handler (`request`, `data`, `ended`, `reset`, `window_opened`,
`goaway`), with no event object, state machine object or trace line per frame, and queues
what the picker sends (`send_headers`, `send_data`) as bytes for one write (`data_to_send`).

What it does of the protocol: the preface and SETTINGS both ways (the gateway's initial
window, frame size and header table size are followed), PING answered, flow control both
ways (inbound: the windows offered are topped up as data is read; outbound: `window` says
how much may be sent now, and `window_opened` when that grew), header blocks split over
CONTINUATION frames both ways, padding and priority fields skipped, trailers read as the end
of a call, RST_STREAM and GOAWAY passed on, unknown frame types ignored. A violation
(a frame too large, HEADERS on a used stream id, a header block interrupted, a bad HPACK
block, a DATA frame on an idle stream, a PUSH_PROMISE) is a connection error: a GOAWAY is
queued and `ProtocolError` raised, and the caller closes the connection. What the picker
does not use is not implemented: server push, priorities, streams opened by the server.
"""

from __future__ import annotations

from typing import Final, NoReturn, Protocol

import hpack

__all__ = ["ProtocolError", "ServerConnection", "StreamClosed", "WireHandler"]

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW: Final = 65535
DEFAULT_FRAME: Final = 16384  # the largest frame this side accepts (never raised)
MAX_WINDOW: Final = 2**31 - 1

# Frame types and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Settings and error codes.
HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 3, 4, 5
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0, 1, 3, 6, 9


class ProtocolError(Exception):
    """The gateway broke the protocol: the connection must be closed (a GOAWAY is queued)."""


class StreamClosed(Exception):
    """Sending on a stream that is closed (ended by this side, or reset by the gateway)."""


class WireHandler(Protocol):
    """What the connection calls as it parses."""

    def request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def data(self, stream_id: int, data: bytes) -> None: ...
    def ended(self, stream_id: int) -> None: ...
    def reset(self, stream_id: int) -> None: ...
    def window_opened(self) -> None: ...
    def goaway(self) -> None: ...


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + stream_id.to_bytes(4, "big")
        + payload
    )


class ServerConnection:
    """One connection's HTTP/2 (see the module's docstring). `window` and `max_streams` are
    offered to the gateway in this side's SETTINGS (and the connection's window raised to
    `window` at once)."""

    __slots__ = (
        "_block",
        "_decoder",
        "_encoder",
        "_handler",
        "_in",
        "_last_stream",
        "_max_frame",
        "_out",
        "_peer_window",
        "_preface",
        "_received",
        "_send_window",
        "_stream_received",
        "_streams",
        "_window",
    )

    def __init__(self, handler: WireHandler, *, window: int, max_streams: int) -> None:
        self._handler = handler
        self._window = window
        self._in = bytearray()
        self._preface = False
        self._decoder = hpack.Decoder()
        self._encoder = hpack.Encoder()
        self._send_window = DEFAULT_WINDOW  # the connection's, for what this side sends
        self._peer_window = DEFAULT_WINDOW  # the gateway's initial window for each stream
        self._max_frame = DEFAULT_FRAME  # the largest frame the gateway accepts
        self._streams: dict[int, int] = {}  # open streams: their send windows
        self._stream_received: dict[int, int] = {}  # bytes read on a stream, not topped up
        self._received = 0  # bytes read on the connection, not topped up
        self._last_stream = 0
        self._block: tuple[int, int, bytearray] | None = None  # header block in progress
        settings = INITIAL_WINDOW_SIZE.to_bytes(2, "big") + window.to_bytes(4, "big")
        settings += MAX_CONCURRENT_STREAMS.to_bytes(2, "big") + max_streams.to_bytes(4, "big")
        self._out = bytearray(_frame(SETTINGS, 0, 0, settings))
        if window > DEFAULT_WINDOW:
            self._out += _frame(WINDOW_UPDATE, 0, 0, (window - DEFAULT_WINDOW).to_bytes(4, "big"))

    # -- reading -----------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Parse `data` (what was read from the gateway), calling the handler as it goes."""
        buffer = self._in
        buffer += data
        at = 0
        if not self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._fail(PROTOCOL_ERROR, "the connection did not open with HTTP/2's preface")
                return
            if buffer[: len(PREFACE)] != PREFACE:
                self._fail(PROTOCOL_ERROR, "the connection did not open with HTTP/2's preface")
            self._preface = True
            at = len(PREFACE)
        size = len(buffer)
        try:
            while size - at >= 9:
                length = int.from_bytes(buffer[at : at + 3], "big")
                if length > DEFAULT_FRAME:
                    self._fail(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = at + 9 + length
                if end > size:
                    break
                kind, flags = buffer[at + 3], buffer[at + 4]
                stream_id = int.from_bytes(buffer[at + 5 : at + 9], "big") & MAX_WINDOW
                payload = bytes(buffer[at + 9 : end])
                at = end
                self._on_frame(kind, flags, stream_id, payload)
        finally:
            del buffer[:at]

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and kind != CONTINUATION:
            self._fail(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PING:
            self._on_ping(flags, payload)
        elif kind == RST_STREAM:
            if self._streams.pop(stream_id, None) is not None:
                self._stream_received.pop(stream_id, None)
                self._handler.reset(stream_id)
        elif kind == GOAWAY:
            self._handler.goaway()
        elif kind == PUSH_PROMISE:
            self._fail(PROTOCOL_ERROR, "a PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types: ignored.

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id > self._last_stream:
            self._fail(PROTOCOL_ERROR, "DATA on an idle stream")
        length = len(payload)
        self._received = self._top_up(0, self._received + length)
        if stream_id not in self._streams:
            return  # closed by this side (answered, failed): its data is not wanted
        received = self._stream_received.get(stream_id, 0) + length
        self._stream_received[stream_id] = self._top_up(stream_id, received)
        if flags & PADDED:
            if not payload or payload[0] >= length:
                self._fail(PROTOCOL_ERROR, "padding longer than its DATA frame")
            payload = payload[1 : length - payload[0]]
        if payload:
            self._handler.data(stream_id, payload)
        if flags & END_STREAM:
            self._handler.ended(stream_id)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._block
        if block is None or block[0] != stream_id:
            self._fail(PROTOCOL_ERROR, "a CONTINUATION frame without its HEADERS")
        block[2].extend(payload)
        if flags & END_HEADERS:
            self._block = None
            self._on_block(block[0], block[1], bytes(block[2]))

    def _on_ping(self, flags: int, payload: bytes) -> None:
        if len(payload) != 8:
            self._fail(FRAME_SIZE_ERROR, "a PING frame not of 8 bytes")
        if not flags & ACK:
            self._out += _frame(PING, ACK, 0, payload)

    def _top_up(self, stream_id: int, received: int) -> int:
        """`received` bytes read on the stream (0: the connection) and not given back: once
        half the window, a WINDOW_UPDATE gives them back. What is left not given back."""
        if received < self._window // 2:
            return received
        self._out += _frame(WINDOW_UPDATE, 0, stream_id, received.to_bytes(4, "big"))
        return 0

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            self._fail(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                self._fail(PROTOCOL_ERROR, "a padded HEADERS frame without its padding length")
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            self._fail(PROTOCOL_ERROR, "padding longer than its HEADERS frame")
        block = payload[start:end]
        if flags & END_HEADERS:
            self._on_block(stream_id, flags, block)
        else:
            self._block = (stream_id, flags, bytearray(block))

    def _on_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:  # decoded whatever the stream: the table must follow every block
            headers = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"a header block that does not decode: {exc}")
        if stream_id in self._streams:  # trailers: the call's end
            if flags & END_STREAM:
                self._handler.ended(stream_id)
            return
        if stream_id <= self._last_stream:
            return  # trailers of a stream this side has closed
        if not stream_id & 1:
            self._fail(PROTOCOL_ERROR, "a stream opened with an even id")
        self._last_stream = stream_id
        self._streams[stream_id] = self._peer_window
        self._handler.request(stream_id, headers)  # type: ignore[arg-type]
        if flags & END_STREAM:
            self._handler.ended(stream_id)

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            self._fail(FRAME_SIZE_ERROR, "a SETTINGS frame not a multiple of 6 bytes")
        opened = False
        for at in range(0, len(payload), 6):
            code = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if code == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "an initial window beyond 2^31 - 1")
                delta, self._peer_window = value - self._peer_window, value
                for stream_id in self._streams:
                    self._streams[stream_id] += delta
                opened = opened or delta > 0
            elif code == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    self._fail(PROTOCOL_ERROR, f"a maximum frame size of {value}")
                self._max_frame = value
            elif code == HEADER_TABLE_SIZE:
                self._encoder.header_table_size = value
        self._out += _frame(SETTINGS, ACK, 0)
        if opened:
            self._handler.window_opened()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame not of 4 bytes")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if not increment:
            self._fail(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "the connection's window beyond 2^31 - 1")
        elif stream_id in self._streams:
            self._streams[stream_id] += increment
        else:
            return
        self._handler.window_opened()

    def _fail(self, code: int, message: str) -> NoReturn:
        self._out += _frame(
            GOAWAY,
            0,
            0,
            self._last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + message.encode(),
        )
        raise ProtocolError(message)

    # -- writing -----------------------------------------------------------------------------

    def send_headers(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], *, end_stream: bool = False
    ) -> None:
        """Queue a header block on the stream (its head, or with `end_stream` its trailers:
        the stream is then closed on this side)."""
        if stream_id not in self._streams:
            raise StreamClosed(stream_id)
        block = self._encoder.encode(headers)
        if end_stream:
            del self._streams[stream_id]
            self._stream_received.pop(stream_id, None)
        flags = END_STREAM if end_stream else 0
        limit = self._max_frame
        out = self._out
        if len(block) <= limit:
            out += _frame(HEADERS, flags | END_HEADERS, stream_id, block)
            return
        out += _frame(HEADERS, flags, stream_id, block[:limit])
        for at in range(limit, len(block), limit):
            last = at + limit >= len(block)
            out += _frame(
                CONTINUATION, END_HEADERS if last else 0, stream_id, block[at : at + limit]
            )

    def window(self, stream_id: int) -> int:
        """How many bytes of data the stream may send now, in one `send_data`."""
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosed(stream_id)
        return max(0, min(self._send_window, stream))

    def send_data(self, stream_id: int, data: bytes) -> None:
        """Queue `data` on the stream, no more than `window(stream_id)` allows."""
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosed(stream_id)
        size = len(data)
        if size > min(self._send_window, stream):
            raise ValueError(f"{size} bytes of data beyond the flow-control window")
        self._send_window -= size
        self._streams[stream_id] = stream - size
        limit, out = self._max_frame, self._out
        for at in range(0, size, limit):
            out += _frame(DATA, 0, stream_id, data[at : at + limit])

    def data_to_send(self) -> bytes:
        """What is queued for the gateway (then nothing is)."""
        out = bytes(self._out)
        self._out.clear()
        return out
