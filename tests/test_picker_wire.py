"""The picker's HTTP/2 (`picker.wire`) against h2's client state machine: what one side
writes the other must parse, frame by frame, with flow control, CONTINUATION, padding,
priority fields, PING, SETTINGS, resets and protocol errors. (Through a real Envoy and
grpcio's client: tests/test_picker.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from trio_router.picker.wire import ProtocolError, ServerConnection, StreamClosed

HEAD = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
    (b":authority", b"picker"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]


@dataclass
class Calls:
    """What the connection called, in order."""

    seen: list[tuple[str, int, object]] = field(default_factory=list)
    opened: int = 0

    def request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.seen.append(("request", stream_id, headers))

    def data(self, stream_id: int, data: bytes) -> None:
        self.seen.append(("data", stream_id, data))

    def ended(self, stream_id: int) -> None:
        self.seen.append(("ended", stream_id, None))

    def reset(self, stream_id: int) -> None:
        self.seen.append(("reset", stream_id, None))

    def window_opened(self) -> None:
        self.opened += 1

    def goaway(self) -> None:
        self.seen.append(("goaway", 0, None))

    def body(self, stream_id: int) -> bytes:
        return b"".join(d for kind, s, d in self.seen if kind == "data" and s == stream_id)  # type: ignore[misc]


def pair(
    window: int = 2**31 - 1, **client_settings: int
) -> tuple[h2.connection.H2Connection, ServerConnection, Calls]:
    """An h2 client and the picker's server side, past the preface and both SETTINGS."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    if client_settings:
        client.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                getattr(h2.settings.SettingCodes, k): v for k, v in client_settings.items()
            },
        )
    client.initiate_connection()
    calls = Calls()
    server = ServerConnection(calls, window=window, max_streams=100)
    exchange(client, server)
    return client, server, calls


def exchange(client: h2.connection.H2Connection, server: ServerConnection) -> list[h2.events.Event]:
    """Deliver what each side has queued to the other (the client's bytes one at a time,
    so every frame boundary is split); the client's events."""
    for byte in client.data_to_send():
        server.receive(bytes([byte]))
    events = client.receive_data(server.data_to_send())
    for byte in client.data_to_send():  # its SETTINGS ACK, WINDOW_UPDATEs
        server.receive(bytes([byte]))
    return events


def test_a_call_goes_both_ways_split_at_every_byte() -> None:
    client, server, calls = pair()
    client.send_headers(1, HEAD)
    client.send_data(1, b"\0\0\0\0\x03abc")
    client.send_data(1, b"\0\0\0\0\x02de", end_stream=True)
    exchange(client, server)
    assert calls.seen[0] == ("request", 1, HEAD)
    assert calls.body(1) == b"\0\0\0\0\x03abc\0\0\0\0\x02de" and calls.seen[-1] == (
        "ended",
        1,
        None,
    )
    server.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    server.send_data(1, b"\0\0\0\0\x01z")
    server.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    events = exchange(client, server)
    kinds = [type(e) for e in events]
    assert kinds == [
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.TrailersReceived,
        h2.events.StreamEnded,
    ]
    assert events[1].data == b"\0\0\0\0\x01z"  # type: ignore[attr-defined]
    assert events[2].headers == [(b"grpc-status", b"0")]  # type: ignore[attr-defined]
    with pytest.raises(StreamClosed):  # ended by this side
        server.send_data(1, b"more")


def test_trailers_from_the_client_end_its_call_and_priority_and_padding_are_skipped() -> None:
    client, server, calls = pair()
    client.send_headers(1, HEAD, priority_weight=200, priority_depends_on=0)
    client.send_data(1, b"padded", pad_length=7)
    client.send_headers(1, [(b"x-trailer", b"1")], end_stream=True)
    exchange(client, server)
    assert [kind for kind, _, _ in calls.seen] == ["request", "data", "ended"]
    assert calls.seen[0][2] == HEAD and calls.body(1) == b"padded"


def test_header_blocks_larger_than_a_frame_use_continuation_both_ways() -> None:
    client, server, calls = pair()
    big = (b"x-big", b"v" * 40_000)  # beyond the 16,384-byte frames each side accepts
    client.send_headers(1, [*HEAD, big])
    exchange(client, server)
    assert calls.seen == [("request", 1, [*HEAD, big])]
    server.send_headers(1, [(b":status", b"200"), big])
    (event,) = exchange(client, server)
    assert isinstance(event, h2.events.ResponseReceived)
    assert event.headers == [(b":status", b"200"), big]


def test_flow_control_both_ways() -> None:
    """The client offers a window of 100 bytes a stream: the server may send that much, then
    more once the client opens it. The server offers 1,000: the client's data is topped up
    once half of it was read."""
    client, server, calls = pair(window=1000, INITIAL_WINDOW_SIZE=100)
    client.send_headers(1, HEAD)
    exchange(client, server)
    assert server.window(1) == 100
    server.send_headers(1, [(b":status", b"200")])
    with pytest.raises(ValueError, match="beyond the flow-control window"):
        server.send_data(1, b"x" * 101)
    server.send_data(1, b"x" * 100)
    assert server.window(1) == 0
    events = exchange(client, server)
    assert sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived)) == 100
    client.acknowledge_received_data(100, 1)
    opened = calls.opened
    exchange(client, server)
    assert server.window(1) == 100 and calls.opened > opened
    # Inbound: 600 of the 1,000 bytes offered read, the server gives them back.
    assert client.local_flow_control_window(1) == 1000
    client.send_data(1, b"y" * 600)
    exchange(client, server)
    assert client.local_flow_control_window(1) == 1000  # the stream's window given back...
    assert client.outbound_flow_control_window == 65535  # ...and the connection's


def test_ping_and_settings_are_answered_and_followed() -> None:
    client, server, _ = pair()
    client.ping(b"12345678")
    client.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 20_000})
    events = exchange(client, server)
    assert any(isinstance(e, h2.events.PingAckReceived) for e in events)
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)
    client.send_headers(1, HEAD)
    exchange(client, server)
    server.send_headers(1, [(b":status", b"200")])
    server.send_data(1, b"z" * 20_000)  # one frame now
    out = server.data_to_send()
    assert int.from_bytes(out[-20_009:-20_006], "big") == 20_000
    client.receive_data(out)


def test_a_reset_stream_is_passed_on_and_closed() -> None:
    client, server, calls = pair()
    client.send_headers(1, HEAD)
    client.reset_stream(1)
    exchange(client, server)
    assert calls.seen[-1] == ("reset", 1, None)
    with pytest.raises(StreamClosed):
        server.send_headers(1, [(b":status", b"200")])
    with pytest.raises(StreamClosed):
        server.window(1)


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "preface"),
        (b"\0\0\x04\0\0\0\0\0\x07abcd", "idle stream"),  # DATA on stream 7, never opened
        (b"\0\x50\0\0\0\0\0\0\x01", "a frame of 20480 bytes"),
        (b"\0\0\x01\x01\x04\0\0\0\x02\x82", "even id"),
        (b"\0\0\x04\x01\x04\0\0\0\x01\xff\xff\xff\xff", "does not decode"),
        (b"\0\0\x01\x01\0\0\0\0\x01\x82\0\0\0\x08\0\0\0\0\0", "interrupted"),
    ],
)
def test_protocol_errors_end_the_connection_with_a_goaway(wire: bytes, message: str) -> None:
    calls = Calls()
    server = ServerConnection(calls, window=2**31 - 1, max_streams=100)
    server.data_to_send()
    preface = b"" if message == "preface" else b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    with pytest.raises(ProtocolError, match=message):
        server.receive(preface + wire)
    out = server.data_to_send()
    assert out[3] == 0x7  # GOAWAY
