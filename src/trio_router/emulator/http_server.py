"""A lean HTTP/1.1 server for the emulated engines' ASGI apps: h11 over Trio streams, one task
per connection, each ASGI message written at once.

Why not Hypercorn (which the router serves on): a fleet streams a token per request per step
from one process (tens of thousands of server-sent events a second at 64 engines), and
Hypercorn's layers per message (its task group, protocol events, a send lock) cost several
times what h11's framing and the write do. This server does only what the engines need:

- HTTP/1.1 keep-alive, as uvicorn serves vLLM: a connection idle for KEEP_ALIVE_S between
  requests is closed; a client that expects `100 Continue` gets it; bodies with a length or
  chunked; one request at a time per connection (a pipelined one waits in h11's buffer).
- ASGI 3 `http` scopes: `receive()` gives the whole request body, then blocks until the
  client goes away (`http.disconnect`); `send()` writes `http.response.start` together with
  the first body message, each later body message at once: a body without a length is sent
  in chunks framed here, written straight to the socket while it takes them (a stream writes
  a chunk per token; going through Trio's socket layer costs a trip through its scheduler
  each time). Writes to a client that has gone are dropped. An app that fails before
  answering gets a 500; its connection is closed.
- An app that writes a chunk per token can skip the trip through its own task: the scope's
  extension DIRECT_WRITE is the exchange, whose `ready_now()` says whether `write_now(body)`
  may write one more chunk at once, from any task, without waiting (what the socket does not
  take is written before the next `send`'s data).
- Cancellation (`serve_asgi`'s scope) closes the listener and every connection at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final
from urllib.parse import unquote

import h11
import trio

__all__ = ["DIRECT_WRITE", "KEEP_ALIVE_S", "serve_asgi"]

logger = logging.getLogger(__name__)

DIRECT_WRITE: Final = "trio_router.emulator.direct_write"  # the scope extension (see module)
KEEP_ALIVE_S: Final = 5.0  # uvicorn's --timeout-keep-alive, which vLLM's server keeps
BACKLOG: Final = 2048
READ_BYTES: Final = 65536
Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def serve_asgi(
    app: Asgi,
    host: str,
    port: int,
    *,
    keep_alive_s: float = KEEP_ALIVE_S,
    listening: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; reports the bound URL once listening. A
    connection idle for `keep_alive_s` between requests is closed. Its listeners are added
    to `listening`, if given, so that their owner can close them at once (cancelling only
    closes them when this task next runs, and a connection made meanwhile is accepted by
    the kernel, then reset). Raises OSError if the address is taken."""
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=BACKLOG)
    if listening is not None:
        listening.extend(listeners)
    bound_host, bound_port = listeners[0].socket.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    task_status.started(f"http://{shown}:{bound_port}")
    await trio.serve_listeners(partial(_serve_connection, app, keep_alive_s), listeners)


class _Exchange:
    """One request's ASGI `receive` and `send` over its connection."""

    def __init__(self, connection: h11.Connection, stream: trio.SocketStream, body: bytes) -> None:
        self._connection, self._stream = connection, stream
        self._body: bytes | None = body
        self._head: h11.Response | None = None
        self._chunked = False  # this server frames the body's chunks itself
        self._pending = b""  # written by `write_now` but not taken by the socket yet
        self.started = self.finished = self.gone = False

    async def receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        while not self.gone:
            try:
                data = await self._stream.receive_some(READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.gone = True
            else:
                self._connection.receive_data(data)  # a pipelined request: kept for later
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            if self._connection.their_http_version == b"1.1" and not any(
                k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers
            ):
                headers.append((b"transfer-encoding", b"chunked"))
                self._chunked = True
            self._head = h11.Response(status_code=message["status"], headers=headers)
            self.started = True
            return
        if kind != "http.response.body" or self.finished:
            return
        data = b""
        if self._head is not None:
            data, self._head = self._connection.send(self._head) or b"", None
        if body := message.get("body", b""):
            # A chunk framed here: h11 would frame it the same, at several times the cost
            # (a stream is a chunk per token); h11 still writes the head and the last chunk.
            chunk = b"%x\r\n%b\r\n" % (len(body), body) if self._chunked else None
            data += chunk or self._connection.send(h11.Data(data=body)) or b""
        if not message.get("more_body", False):
            data += self._connection.send(h11.EndOfMessage()) or b""
            self.finished = True
        if self._pending:
            data, self._pending = self._pending + data, b""
        if data and not self.gone:
            await self._write(data)

    def ready_now(self) -> bool:
        """`write_now` may be used: the head is out, the body not finished, nothing waits to
        be written and the client is there."""
        return (
            self.started
            and self._head is None
            and not (self.finished or self.gone or self._pending or not self._chunked)
        )

    def write_now(self, body: bytes) -> None:
        """Write one more chunk of the body without waiting (only when `ready_now`): what the
        socket does not take at once is written before the next `send`'s data."""
        data = b"%x\r\n%b\r\n" % (len(body), body)
        try:
            written = os.write(self._stream.socket.fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError:
            self.gone = True
            return
        self._pending = data[written:]

    async def _write(self, data: bytes) -> None:
        """Write `data`: straight to the socket while it takes it (no trip through Trio's
        scheduler: a stream writes a chunk per token), else through the stream."""
        try:
            written = os.write(self._stream.socket.fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError:
            self.gone = True
            return
        if written < len(data):
            try:
                await self._stream.send_all(data[written:])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True


async def _next_event(connection: h11.Connection, stream: trio.SocketStream) -> Any:
    """The next h11 event of the request side, reading as needed (ConnectionClosed on EOF)."""
    while (event := connection.next_event()) is h11.NEED_DATA:
        try:
            data = await stream.receive_some(READ_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        connection.receive_data(data)
    return event


async def _read_request(
    connection: h11.Connection, stream: trio.SocketStream, keep_alive_s: float
) -> tuple[h11.Request, bytes] | None:
    """The next request and its body; None when the client closes, sends something that is
    not HTTP, or stays idle for `keep_alive_s`."""
    request = None
    with trio.move_on_after(keep_alive_s):
        try:
            request = await _next_event(connection, stream)
        except h11.RemoteProtocolError:
            return None
    if not isinstance(request, h11.Request):
        return None
    if connection.they_are_waiting_for_100_continue:
        await stream.send_all(
            connection.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
        )
    body = bytearray()
    try:
        while isinstance(event := await _next_event(connection, stream), h11.Data):
            body += event.data
    except h11.RemoteProtocolError:
        return None
    return (request, bytes(body)) if isinstance(event, h11.EndOfMessage) else None


def _scope(request: h11.Request, stream: trio.SocketStream, exchange: _Exchange) -> dict[str, Any]:
    path, _, query = request.target.partition(b"?")
    sock = stream.socket
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method.decode(),
        "scheme": "http",
        "path": unquote(path.decode("latin-1")),
        "raw_path": path,
        "query_string": query,
        "root_path": "",
        "headers": [(name, value) for name, value in request.headers],
        "client": sock.getpeername()[:2],
        "server": sock.getsockname()[:2],
        "extensions": {DIRECT_WRITE: exchange},
    }


async def _serve_connection(app: Asgi, keep_alive_s: float, stream: trio.SocketStream) -> None:
    """Requests on one connection, one at a time, until either side closes it. What goes
    wrong on one connection (the client went away, or spoke something else than HTTP) ends
    that connection only."""
    async with stream:
        with contextlib.suppress(
            OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError
        ):
            await _serve_requests(app, keep_alive_s, stream)


async def _serve_requests(app: Asgi, keep_alive_s: float, stream: trio.SocketStream) -> None:
    connection = h11.Connection(h11.SERVER)
    while (read := await _read_request(connection, stream, keep_alive_s)) is not None:
        request, body = read
        exchange = _Exchange(connection, stream, body)
        try:
            await app(_scope(request, stream, exchange), exchange.receive, exchange.send)
        except Exception:
            logger.exception("the engine failed on %s %r", request.method, request.target)
            if not exchange.started:
                await _answer_500(exchange)
            return
        if not exchange.finished or exchange.gone:
            return
        if h11.MUST_CLOSE in (connection.our_state, connection.their_state):
            return
        connection.start_next_cycle()


async def _answer_500(exchange: _Exchange) -> None:
    headers = [(b"content-length", b"0"), (b"connection", b"close")]
    await exchange.send({"type": "http.response.start", "status": 500, "headers": headers})
    await exchange.send({"type": "http.response.body", "body": b"", "more_body": False})
