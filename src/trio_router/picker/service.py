"""The endpoint picker's gRPC side: Envoy's external processing protocol
(`envoy.service.ext_proc.v3.ExternalProcessor/Process`, the Gateway API Inference Extension's
endpoint-picker protocol) and gRPC health, served by grpcio's asyncio server on one thread of
its own, bridged to the Trio thread where every decision is made.

Why this shape: grpcio does HTTP/2 and the gRPC framing in its C core, and its asyncio server
runs every call as a coroutine of one event loop, so there is no thread per call; the loop's
thread only parses, buffers and writes messages. A call crosses to Trio twice when it is
routed (its request handed over with `TrioToken.run_sync_soon`, the verdict handed back with
`loop.call_soon_threadsafe`) and once more for each thing the gateway reports (the answer's
head, the stream's end); body chunks never cross.

One call per HTTP request, in the streaming mode the reference gateways configure (request
body FULL_DUPLEX_STREAMED): the request's headers, then its body in chunks, are read and
held; at the body's end (or with headers that end the request) the request is handed to the
Trio side (`choose.Picker.exchange`); its verdict goes back as the request-headers response
(the destination header, `x-gateway-destination-endpoint`, and the same in the `envoy.lb`
dynamic metadata, plus headers the router sets) followed by the body, passed back whole (or
rewritten); a refusal is an immediate response. The answer's head (status, and the endpoint
that served it, `x-gateway-destination-endpoint-served` in the request's `envoy.lb`
metadata) and the stream's end are reported to the Trio side; an answer body the gateway
sends is passed back (its last bytes kept for the usage summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc
import trio
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .._envoy_proto.envoy.config.core.v3 import base_pb2
from .._envoy_proto.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from .._envoy_proto.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .._envoy_proto.envoy.type.v3 import http_status_pb2
from .choose import STOPPED, Chosen, Exchange, Picker, Refusal, Verdict

__all__ = ["DESTINATION", "SERVED", "PickerServer"]

logger = logging.getLogger(__name__)

SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET: Final = "x-gateway-destination-endpoint-subset"
TAIL_BYTES: Final = 4096  # of an answer body the gateway sends: where its usage summary is
HEALTH_SERVICES: Final = ("", "liveness", "readiness", SERVICE)

_FULL_DUPLEX: Final = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_SERVING: Final = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING
_CONTINUE_HEADERS: Final = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
_CONTINUE_BODY: Final = ep.ProcessingResponse(response_body=ep.BodyResponse())
_PSEUDO: Final = b":"


class _Call:
    """One `Process` call: one HTTP request of the gateway (see the module's docstring)."""

    def __init__(self, server: PickerServer, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._server, self._context = server, context
        self._loop = asyncio.get_running_loop()
        self._exchange: Exchange | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._method, self._target, self._client = "GET", "/", ""
        self._body = bytearray()
        self._subset: tuple[str, ...] | None = None
        self._answer_duplex = False  # the answer's body comes FULL_DUPLEX_STREAMED
        self._tail = b""
        self._streamed = False  # the request has a body (its headers did not end it)
        self._ended = False

    async def run(self, requests: AsyncIterator[ep.ProcessingRequest]) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    await self._request_headers(request)
                elif kind == "request_body":
                    body = request.request_body
                    self._body += body.body
                    if body.end_of_stream:
                        await self._route(trailers=False)
                    elif len(self._body) > self._server.max_body_bytes:
                        await self._route(trailers=False)  # refused whole: too large
                elif kind == "response_headers":
                    self._response_headers(request)
                    await self._context.write(_CONTINUE_HEADERS)
                    if request.response_headers.end_of_stream:
                        self._end(gone=False)
                elif kind == "response_body":
                    await self._response_body(request.response_body)
                elif kind == "request_trailers":
                    if self._exchange is None:
                        await self._route(trailers=True)
                    await self._context.write(
                        ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                    )
                elif kind == "response_trailers":
                    await self._context.write(
                        ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
                    )
                    self._end(gone=False)
            self._end(gone=False)
        finally:
            self._end(gone=True)  # cancelled, failed: the request is gone (no-op if ended)

    async def _request_headers(self, request: ep.ProcessingRequest) -> None:
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
            listed = lb.fields[SUBSET].list_value.values
            self._subset = tuple(v.string_value for v in listed)
        if http.end_of_stream:
            await self._route(trailers=False)
        else:
            self._streamed = True

    async def _route(self, *, trailers: bool) -> None:
        """Hand the request to the Trio side, then answer with its verdict."""
        if self._exchange is not None:
            return
        future: asyncio.Future[Verdict] = self._loop.create_future()
        loop = self._loop

        def answer(verdict: Verdict) -> None:  # the Trio thread
            loop.call_soon_threadsafe(_settle, future, verdict)

        exchange = Exchange(
            self._method,
            self._target,
            self._headers,
            bytes(self._body),
            self._subset,
            answer,
            client=self._client,
        )
        self._exchange = exchange
        if not self._server.hand_over(exchange):
            await self._context.write(_immediate(STOPPED))
            return
        verdict = await future
        if isinstance(verdict, Refusal):
            await self._context.write(_immediate(verdict))
            return
        for response in _chosen(verdict, bytes(self._body), self._streamed, trailers):
            await self._context.write(response)

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
            self._server.report(exchange.responded, status, served)

    async def _response_body(self, body: ep.HttpBody) -> None:
        chunk = body.body
        self._tail = (self._tail + chunk)[-TAIL_BYTES:] if chunk else self._tail
        if self._answer_duplex:
            await self._context.write(
                ep.ProcessingResponse(
                    response_body=ep.BodyResponse(
                        response=ep.CommonResponse(
                            body_mutation=ep.BodyMutation(
                                streamed_response=ep.StreamedBodyResponse(
                                    body=chunk, end_of_stream=body.end_of_stream
                                )
                            )
                        )
                    )
                )
            )
        else:
            await self._context.write(_CONTINUE_BODY)
        if body.end_of_stream:
            self._end(gone=False)

    def _end(self, *, gone: bool) -> None:
        if self._ended:
            return
        self._ended = True
        if (exchange := self._exchange) is not None:
            self._server.report(exchange.end, self._tail, gone)


def _settle(future: asyncio.Future[Verdict], verdict: Verdict) -> None:
    if not future.done():
        future.set_result(verdict)


def _immediate(refusal: Refusal) -> ep.ProcessingResponse:
    """An immediate answer: the refusal's status, headers and body."""
    return ep.ProcessingResponse(
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


def _header(name: bytes, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name.decode(), raw_value=value), append_action=_OVERWRITE
    )


def _chosen(
    chosen: Chosen, body: bytes, has_body: bool, trailers: bool
) -> list[ep.ProcessingResponse]:
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
    return responses


class PickerServer:
    """grpcio's asyncio server for the picker and gRPC health, run by `run` on the calling
    (worker) thread until `stop`; calls are handed to `picker` on the Trio thread of
    `token`, in `nursery`."""

    def __init__(
        self,
        bind: str,
        picker: Picker,
        token: trio.lowlevel.TrioToken,
        nursery: trio.Nursery,
        *,
        max_body_bytes: int,
        grace_s: float,
    ) -> None:
        self._bind, self._picker, self._token, self._nursery = bind, picker, token, nursery
        self.max_body_bytes, self._grace_s = max_body_bytes, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._health = health.aio.HealthServicer()
        self.port = 0

    # -- the Trio thread ------------------------------------------------------------------
    def stop(self) -> None:
        """End the server: no new calls, calls in flight get `grace_s` (idempotent)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)

    def set_ready(self, ready: bool) -> None:
        """Readiness, as the health service answers it (`readiness` and the picker's
        service; `liveness` and "" stay serving while the process runs)."""
        if (loop := self._loop) is not None:
            status = _SERVING if ready else _NOT_SERVING
            for service in ("readiness", SERVICE):
                asyncio.run_coroutine_threadsafe(self._health.set(service, status), loop)

    # -- the server's thread --------------------------------------------------------------
    def run(self, started: Callable[[int], None]) -> None:
        """Serve until `stop` (on this thread's own event loop); `started(port)` once
        listening."""
        asyncio.run(self._serve(started))

    async def _serve(self, started: Callable[[int], None]) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", -1)]
        )
        handler = grpc.stream_stream_rpc_method_handler(
            self._process,
            request_deserializer=ep.ProcessingRequest.FromString,
            response_serializer=ep.ProcessingResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Process": handler}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for service in HEALTH_SERVICES:
            await self._health.set(
                service, _SERVING if service in ("", "liveness") else _NOT_SERVING
            )
        self.port = server.add_insecure_port(self._bind)
        await server.start()
        started(self.port)
        try:
            await self._stop.wait()
        finally:
            await self._health.enter_graceful_shutdown()
            await server.stop(self._grace_s)

    async def _process(
        self,
        requests: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        await _Call(self, context).run(requests)

    def hand_over(self, exchange: Exchange) -> bool:
        """Start `exchange` on the Trio side; False when the Trio run has ended."""
        try:
            self._token.run_sync_soon(self._start, exchange)
        except trio.RunFinishedError:
            return False
        return True

    def _start(self, exchange: Exchange) -> None:
        """The Trio thread: `exchange` started, or refused when the picker has stopped."""
        try:
            self._nursery.start_soon(self._picker.exchange, exchange)
        except RuntimeError:  # the nursery is closed: the picker has stopped
            exchange.answer(STOPPED)

    def report(self, what: Callable[..., None], *args: Any) -> None:
        """Tell the Trio side `what(*args)` (ignored once the Trio run has ended)."""
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(what, *args)
