"""The endpoint picker's gRPC side: Envoy's external processing protocol
(`envoy.service.ext_proc.v3.ExternalProcessor/Process`, the Gateway API Inference Extension's
endpoint-picker protocol) and gRPC health (`grpc.health.v1.Health/Check`), served on Trio by
a gRPC server of the router's own over HTTP/2 (`wire`, plaintext, prior knowledge), so that a
request's messages, its decision and its answers stay on one thread.

Why this shape: the picker's work per request is a handful of small messages. Served by
grpcio's asyncio server on a thread of its own, every request crossed between that thread and
the Trio thread four times and both contended for the GIL; grpcio's per-message Python cost
and those hand-overs came to several times the decision itself (docs/performance.md, "The
endpoint picker"). Here a connection's reader parses HTTP/2 (`wire.ServerConnection`, which
calls this module back per frame, with no event objects) and the gRPC messages with
protobuf, and handles each message at once, synchronously; only the decision is a task
(`choose.Picker.exchange`), whose verdict is written back in the callback that gives it.
Writes are coalesced: whatever one read of the gateway produced goes out in one write. The
socket is read and written synchronously while it is ready and awaited (`wait_readable`,
`wait_writable`) only when it would block, as the proxy's engine connections are
(`http.connection`): a Trio socket's `receive_some`/`send_all` passes through the scheduler
even when the data is there, and at the rates a gateway sends, those passes, not the
messages, were most of the picker's CPU.

One call per HTTP request, in the streaming mode the reference gateways configure (request
body FULL_DUPLEX_STREAMED): the request's headers, then its body in chunks, are read and
held, with the gateway's subset hint (`x-gateway-destination-endpoint-subset` in the
`envoy.lb.subset_hint` metadata: a list of endpoints, or one string of them separated by
commas); at the body's end (or with headers that end the request) the request is decided; the
verdict goes back as the request-headers response (the destination header,
`x-gateway-destination-endpoint`, and the same in the `envoy.lb` dynamic metadata, plus
headers the router sets) followed by the body, passed back whole (or rewritten); a refusal is
an immediate response. The answer's head (status, and the endpoint that served it,
`x-gateway-destination-endpoint-served` in the request's `envoy.lb` metadata) and the call's
end are reported to the exchange; an answer body the gateway sends is passed back (its last
bytes kept for the usage summary).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from typing import Final

import trio
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2

from .._envoy_proto.envoy.config.core.v3 import base_pb2
from .._envoy_proto.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from .._envoy_proto.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .._envoy_proto.envoy.type.v3 import http_status_pb2
from .choose import STOPPED, Chosen, Exchange, Picker, Refusal, Verdict
from .wire import ProtocolError, ServerConnection, StreamClosed

__all__ = ["DESTINATION", "SERVED", "PickerServer"]

logger = logging.getLogger(__name__)

SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH: Final = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_PATH: Final = b"/grpc.health.v1.Health/Check"
DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET: Final = "x-gateway-destination-endpoint-subset"
TAIL_BYTES: Final = 4096  # of an answer body the gateway sends: where its usage summary is
HEALTH_SERVICES: Final = ("", "liveness", "readiness", SERVICE)
READ_BYTES: Final = 65536
READ_BURST: Final = 16  # reads in a row without a checkpoint, while the gateway keeps sending
WINDOW: Final = 2**31 - 1  # the flow-control window offered: the gateway never waits for it
MAX_STREAMS: Final = 100_000  # calls at once on one connection

_FULL_DUPLEX: Final = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_SERVING: Final = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING
_PSEUDO: Final = b":"
_PREFIX: Final = struct.Struct(">BI")  # a gRPC message's flag (compressed) and length
_RESPONSE_HEAD: Final = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_OK: Final = [(b"grpc-status", b"0")]


def _message(response: ep.ProcessingResponse | health_pb2.HealthCheckResponse) -> bytes:
    data = response.SerializeToString()
    return _PREFIX.pack(0, len(data)) + data


_CONTINUE_HEADERS: Final = _message(ep.ProcessingResponse(response_headers=ep.HeadersResponse()))
_CONTINUE_BODY: Final = _message(ep.ProcessingResponse(response_body=ep.BodyResponse()))
_REQUEST_TRAILERS: Final = _message(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
_RESPONSE_TRAILERS: Final = _message(ep.ProcessingResponse(response_trailers=ep.TrailersResponse()))


class _Process:
    """One `Process` call: one HTTP request of the gateway (see the module's docstring)."""

    __slots__ = (
        "_answer_duplex",
        "_body",
        "_client",
        "_conn",
        "_ended",
        "_exchange",
        "_headers",
        "_method",
        "_streamed",
        "_subset",
        "_tail",
        "_target",
        "stream_id",
    )

    def __init__(self, conn: _Connection, stream_id: int) -> None:
        self._conn, self.stream_id = conn, stream_id
        self._exchange: Exchange | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._method, self._target, self._client = "GET", "/", ""
        self._body = bytearray()
        self._subset: tuple[str, ...] | None = None
        self._answer_duplex = False  # the answer's body comes FULL_DUPLEX_STREAMED
        self._tail = b""
        self._streamed = False  # the request has a body (its headers did not end it)
        self._ended = False

    def message(self, data: bytes) -> None:
        """One ProcessingRequest of the gateway."""
        request = ep.ProcessingRequest.FromString(data)
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            self._request_headers(request)
        elif kind == "request_body":
            body = request.request_body
            self._body += body.body
            if body.end_of_stream or len(self._body) > self._conn.server.max_body_bytes:
                self._route(trailers=False)  # too large: refused whole
        elif kind == "response_headers":
            self._response_headers(request)
            self._conn.send(self.stream_id, _CONTINUE_HEADERS)
            if request.response_headers.end_of_stream:
                self.end(gone=False)
        elif kind == "response_body":
            self._response_body(request.response_body)
        elif kind == "request_trailers":
            if self._exchange is None:
                self._route(trailers=True)
            self._conn.send(self.stream_id, _REQUEST_TRAILERS)
        elif kind == "response_trailers":
            self._conn.send(self.stream_id, _RESPONSE_TRAILERS)
            self.end(gone=False)

    def _request_headers(self, request: ep.ProcessingRequest) -> None:
        http = request.request_headers
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self._answer_duplex = config.response_body_mode == _FULL_DUPLEX
        headers = self._headers
        for header in http.headers.headers:
            name = header.key.encode()
            value = header.raw_value or header.value.encode()
            if name.startswith(_PSEUDO):
                if name == b":method":
                    self._method = value.decode()
                elif name == b":path":
                    self._target = value.decode()
            else:
                if name == b"x-forwarded-for":
                    self._client = value.decode().split(",")[-1].strip()
                headers.append((name, value))
        lb = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if lb is not None and SUBSET in lb.fields:
            self._subset = _subset_hint(lb.fields[SUBSET])
        if http.end_of_stream:
            self._route(trailers=False)
        else:
            self._streamed = True

    def _route(self, *, trailers: bool) -> None:
        """Hand the request to the picker; its verdict is written when it is given."""
        if self._exchange is not None:
            return
        body = bytes(self._body)
        conn, stream_id, streamed = self._conn, self.stream_id, self._streamed

        def answer(verdict: Verdict) -> None:
            if isinstance(verdict, Refusal):
                conn.send(stream_id, _immediate(verdict))
            else:
                for response in _chosen(verdict, body, streamed, trailers):
                    conn.send(stream_id, response)
            conn.flush()

        exchange = Exchange(
            self._method,
            self._target,
            self._headers,
            body,
            self._subset,
            answer,
            client=self._client,
        )
        self._exchange = exchange
        conn.server.start(exchange)

    def _response_headers(self, request: ep.ProcessingRequest) -> None:
        status, served = 0, ""
        for header in request.response_headers.headers.headers:
            if header.key == ":status":
                text = header.raw_value or header.value.encode()
                status = int(text) if text.isdigit() else 0
                break
        lb = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
        if lb is not None and SERVED in lb.fields:
            served = lb.fields[SERVED].string_value
        if (exchange := self._exchange) is not None:
            exchange.responded(status, served)

    def _response_body(self, body: ep.HttpBody) -> None:
        chunk = body.body
        self._tail = (self._tail + chunk)[-TAIL_BYTES:] if chunk else self._tail
        if self._answer_duplex:
            streamed = ep.StreamedBodyResponse(body=chunk, end_of_stream=body.end_of_stream)
            response = ep.ProcessingResponse(
                response_body=ep.BodyResponse(
                    response=ep.CommonResponse(
                        body_mutation=ep.BodyMutation(streamed_response=streamed)
                    )
                )
            )
            self._conn.send(self.stream_id, _message(response))
        else:
            self._conn.send(self.stream_id, _CONTINUE_BODY)
        if body.end_of_stream:
            self.end(gone=False)

    def end(self, *, gone: bool) -> None:
        """The call is over (the gateway half-closed it, or it is `gone`: reset, or its
        connection lost)."""
        if self._ended:
            return
        self._ended = True
        if (exchange := self._exchange) is not None:
            exchange.end(self._tail, gone)


def _subset_hint(value: struct_pb2.Value) -> tuple[str, ...]:
    """The endpoints (host:port each) a subset hint names: a list of strings, or one string of
    them separated by commas, as Envoy's header-to-metadata filter sets it from a header
    (entries stripped, empty ones ignored). A hint of any other kind names none."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return tuple(v.string_value for v in value.list_value.values)
    if kind == "string_value":
        return tuple(entry for part in value.string_value.split(",") if (entry := part.strip()))
    return ()


def _immediate(refusal: Refusal) -> bytes:
    """An immediate answer: the refusal's status, headers and body."""
    response = ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),  # type: ignore[arg-type]
            headers=ep.HeaderMutation(
                set_headers=[
                    _header(name, value)
                    for name, value in refusal.headers
                    if name != b"content-length"
                ]
            ),
            body=refusal.body,
            details=f"trio_router_{refusal.status}",
        )
    )
    return _message(response)


def _header(name: bytes, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name.decode(), raw_value=value), append_action=_OVERWRITE
    )


def _chosen(chosen: Chosen, body: bytes, has_body: bool, trailers: bool) -> list[bytes]:
    """The responses that route the request as `chosen` says: the request-headers response
    (destination header, metadata, headers to set), then its body passed back."""
    destination = ",".join(chosen.endpoints)
    set_headers = [_header(DESTINATION.encode(), destination.encode())]
    set_headers += [_header(name, value) for name, value in chosen.headers]
    remove: list[str] = []
    if chosen.body is not None:
        body = chosen.body
        set_headers.append(_header(b"content-length", str(len(body)).encode()))
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = destination
    responses = [
        ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(
                response=ep.CommonResponse(
                    header_mutation=ep.HeaderMutation(
                        set_headers=set_headers, remove_headers=remove
                    ),
                    # Routes may match on the destination header: route the request afresh.
                    clear_route_cache=True,
                )
            ),
            dynamic_metadata=metadata,
        )
    ]
    if has_body:
        responses.append(
            ep.ProcessingResponse(
                request_body=ep.BodyResponse(
                    response=ep.CommonResponse(
                        body_mutation=ep.BodyMutation(
                            streamed_response=ep.StreamedBodyResponse(
                                body=body, end_of_stream=not trailers
                            )
                        )
                    )
                )
            )
        )
    return [_message(response) for response in responses]


class _Connection:
    """One HTTP/2 connection of the gateway: its reader handles every frame as it comes and
    sends what that produced in one write; a verdict given by a decision's task is written at
    once by that task. The socket is read and written synchronously while it is ready, with a
    wait on Trio only when it would block (see the module's docstring)."""

    def __init__(self, server: PickerServer, stream: trio.SocketStream) -> None:
        self.server, self._stream = server, stream
        self._fd = stream.socket.fileno()
        self._wire = ServerConnection(self, window=WINDOW, max_streams=MAX_STREAMS)
        self._calls: dict[int, _Process] = {}
        self._unary: set[int] = set()  # health checks (unary calls)
        self._buffers: dict[int, bytes] = {}  # the part of a message not in yet, by stream
        self._pending: dict[int, list[bytes]] = {}  # data waiting for flow control, by stream
        self._closing: set[int] = set()  # streams to end (trailers) once their data is out
        self._unanswered: set[int] = set()  # streams whose response head is not sent yet
        self._out = bytearray()  # bytes the socket did not take yet, in order
        self._blocked = trio.Event()  # set: `_out` waits for the socket (the writer sends it)
        self._reading = False  # the reader is handling what it read (it flushes after)
        self._lost = False

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write)
                self.flush()
                await self._read()
                nursery.cancel_scope.cancel()
        except Exception:  # a failure of this connection ends it, not the picker
            logger.exception("endpoint picker: a gateway connection failed; it is closed")
        finally:
            self._lost = True
            for call in self._calls.values():
                call.end(gone=True)
            self._calls.clear()
            with trio.CancelScope(shield=True):
                await self._stream.aclose()

    async def _read(self) -> None:
        wire, fd = self._wire, self._fd
        burst = 0  # reads in a row that found data: a checkpoint every READ_BURST of them
        while not self._lost:
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:
                burst = 0
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError:  # reset by the gateway
                return
            if not data:
                return
            self._reading = True
            try:
                wire.receive(data)
            except ProtocolError as exc:
                logger.warning("endpoint picker: HTTP/2 protocol error from the gateway: %s", exc)
                return
            finally:
                self._reading = False
                self.flush()
            burst += 1
            if burst == READ_BURST:
                burst = 0
                await trio.lowlevel.checkpoint()

    # -- what the wire calls (`wire.WireHandler`) ---------------------------------------------

    def reset(self, stream_id: int) -> None:
        self._forget(stream_id, gone=True)

    def window_opened(self) -> None:
        for stream_id in list(self._pending):
            self._pump(stream_id)

    def goaway(self) -> None:
        self._lost = True

    def request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        path = next((v for k, v in headers if k == b":path"), b"")
        if path == PROCESS_PATH:
            self._calls[stream_id] = _Process(self, stream_id)
        elif path == HEALTH_CHECK_PATH:
            self._unary.add(stream_id)
        else:
            self._wire.send_headers(
                stream_id,
                [*_RESPONSE_HEAD, (b"grpc-status", b"12"), (b"grpc-message", b"unimplemented")],
                end_stream=True,
            )
            return
        self._unanswered.add(stream_id)  # its head goes out with its first message

    def data(self, stream_id: int, data: bytes) -> None:
        buffered = self._buffers.pop(stream_id, b"")
        if buffered:
            data = buffered + data
        size, at = len(data), 0
        while size - at >= 5:
            compressed, length = _PREFIX.unpack_from(data, at)
            if size - at - 5 < length:
                break
            message = data[at + 5 : at + 5 + length]
            at += 5 + length
            if compressed:
                self._fail(stream_id, b"3", b"compressed messages are not accepted")
                return
            self._dispatch(stream_id, message)
        if at < size:
            self._buffers[stream_id] = data[at:]

    def _dispatch(self, stream_id: int, message: bytes) -> None:
        if (call := self._calls.get(stream_id)) is not None:
            try:
                call.message(message)
            except Exception:  # a message that does not parse, or one the call cannot take
                logger.exception("endpoint picker: a message of the gateway failed")
                self._fail(stream_id, b"13", b"the picker could not process a message")
        elif stream_id in self._unary:
            service = health_pb2.HealthCheckRequest.FromString(message).service
            status = self.server.health.get(service)
            if status is None:
                self._fail(stream_id, b"5", b"unknown service")
                return
            self.send(stream_id, _message(health_pb2.HealthCheckResponse(status=status)))

    def ended(self, stream_id: int) -> None:
        """The gateway has sent all of the call: it is over; its end goes out once all its
        data has."""
        call = self._calls.get(stream_id)
        if call is None and stream_id not in self._unary:
            return  # answered and closed already (an unknown method, a failed call)
        if call is not None:
            call.end(gone=False)
        self._unary.discard(stream_id)
        self._closing.add(stream_id)
        self._pump(stream_id)

    def _fail(self, stream_id: int, status: bytes, message: bytes) -> None:
        head = _RESPONSE_HEAD if stream_id in self._unanswered else []
        self._forget(stream_id, gone=True)
        with contextlib.suppress(StreamClosed):
            self._wire.send_headers(
                stream_id,
                [*head, (b"grpc-status", status), (b"grpc-message", message)],
                end_stream=True,
            )

    def _forget(self, stream_id: int, *, gone: bool) -> None:
        if (call := self._calls.pop(stream_id, None)) is not None:
            call.end(gone=gone)
        self._unary.discard(stream_id)
        self._buffers.pop(stream_id, None)
        self._pending.pop(stream_id, None)
        self._closing.discard(stream_id)
        self._unanswered.discard(stream_id)

    def send(self, stream_id: int, data: bytes) -> None:
        """Queue `data` on the call (as flow control allows; the rest when it does); `flush`
        writes it."""
        if self._lost:
            return
        if stream_id in self._unanswered:
            self._unanswered.discard(stream_id)
            try:
                self._wire.send_headers(stream_id, _RESPONSE_HEAD)
            except StreamClosed:  # reset by the gateway
                self._forget(stream_id, gone=True)
                return
        self._pending.setdefault(stream_id, []).append(data)
        self._pump(stream_id)

    def _pump(self, stream_id: int) -> None:
        wire = self._wire
        pending = self._pending.get(stream_id)
        try:
            while pending:
                window = wire.window(stream_id)
                if window <= 0:
                    return
                data = pending[0]
                if len(data) > window:
                    wire.send_data(stream_id, data[:window])
                    pending[0] = data[window:]
                else:
                    wire.send_data(stream_id, data)
                    pending.pop(0)
            self._pending.pop(stream_id, None)
            if stream_id in self._closing:
                self._closing.discard(stream_id)
                self._calls.pop(stream_id, None)
                self._buffers.pop(stream_id, None)
                if stream_id in self._unanswered:  # no message: a trailers-only answer
                    self._unanswered.discard(stream_id)
                    wire.send_headers(stream_id, [*_RESPONSE_HEAD, *_OK], end_stream=True)
                else:
                    wire.send_headers(stream_id, _OK, end_stream=True)
        except StreamClosed:  # reset by the gateway
            self._forget(stream_id, gone=True)

    def flush(self) -> None:
        """Write what the wire has to send, synchronously, unless the reader is handling a read (it
        flushes once it has) or earlier bytes still wait for the socket (the writer sends
        these in order)."""
        if self._reading or self._lost:
            return
        data = self._wire.data_to_send()
        out = self._out
        if data:
            out += data
        if not out or self._blocked.is_set():
            return
        try:
            sent = os.write(self._fd, out)
        except BlockingIOError:
            sent = 0
        except OSError:  # the gateway is gone; the reader sees it too
            self._lost = True
            out.clear()
            return
        del out[:sent]
        if out:
            self._blocked.set()

    async def _write(self) -> None:
        """Send what the socket did not take at once, as it takes more."""
        while True:
            await self._blocked.wait()
            await trio.lowlevel.wait_writable(self._fd)
            self._blocked = trio.Event()
            self.flush()


class PickerServer:
    """The picker's gRPC server on Trio: calls are handed to `picker`, each decision a task
    in `nursery`."""

    def __init__(self, picker: Picker, nursery: trio.Nursery, *, max_body_bytes: int) -> None:
        self._picker, self._nursery = picker, nursery
        self.max_body_bytes = max_body_bytes
        self.health: dict[str, int] = {
            service: _SERVING if service in ("", "liveness") else _NOT_SERVING
            for service in HEALTH_SERVICES
        }

    def set_ready(self, ready: bool) -> None:
        """Readiness, as the health service answers it (`readiness` and the picker's
        service; `liveness` and "" stay serving while the process runs)."""
        status = _SERVING if ready else _NOT_SERVING
        self.health["readiness"] = self.health[SERVICE] = status

    def start(self, exchange: Exchange) -> None:
        """Decide `exchange` (a task of its own); refused when the picker has stopped."""
        try:
            self._nursery.start_soon(self._picker.exchange, exchange)
        except RuntimeError:  # the nursery is closed: the picker has stopped
            exchange.answer(STOPPED)

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        await _Connection(self, stream).run()
