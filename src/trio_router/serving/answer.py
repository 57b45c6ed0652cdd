"""The answer writer: how one request's answer reaches its client.

The exchange decides what the answer is (a head, body bytes, an engine's body, the end);
`Answer` decides how those go on the wire. The server side builds one writer per request and
hands it to the app in the ASGI scope's extensions (`answer_of`); a server that gives none is
served by `AsgiAnswer`, over plain ASGI `send`, with a watcher task that sees the client leave
(`open_asgi_answer`). Trio_router's own connection driver gives a writer of its own that joins
writes and relays chunked engine bodies around the ASGI layer (`connection.ConnectionAnswer`);
the exchange cannot tell the two apart.

The order of calls is the exchange's whole protocol: `start` once, then any number of `body`
and `relay` calls, then `end`. An answer that is never ended is cut: the server closes the
connection without the end of the response (an engine that broke off mid-answer). A `relay`
that fails (the engine broke off, fell silent, the client left) leaves the answer open and at
a clean point: it may be followed by more body from elsewhere, with no seam the client can see.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final, Protocol

import trio

from ..asgi import Message, Receive, Scope, Send
from ..http import UpstreamResponse
from ..http.relay import Rewrite

__all__ = [
    "ANSWER_EXTENSION",
    "Answer",
    "AsgiAnswer",
    "Disconnect",
    "Rewrite",
    "answer_of",
    "open_asgi_answer",
    "tail_of",
]

ANSWER_EXTENSION: Final = "trio_router.answer"  # where a request's writer is in its scope
TAIL_BYTES: Final = 4096  # of an engine body's last two pieces, kept: its usage summary


class Answer(Protocol):
    """One request's answer to its client (see the module's docstring)."""

    @property
    def sent(self) -> int:
        """Body bytes handed on so far (a relayed body's as the engine framed them)."""
        ...

    def arm(self, scope: trio.CancelScope) -> None:
        """The client leaving cancels `scope` from now until the end of the answer goes out
        (at once if it has left already)."""
        ...

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The answer's head. It goes out with what follows (the next call), not before."""
        ...

    async def body(self, data: bytes) -> None:
        """Body bytes (with the head, if it is still to go)."""
        ...

    async def relay(
        self,
        response: UpstreamResponse,
        *,
        rewrite: Rewrite | None = None,
        on_first: Callable[[float], None] | None = None,
    ) -> bytes:
        """The rest of `response`'s body, passed on as it comes (through `rewrite`, if given);
        returns the end of it (`tail_of` its last two pieces: where a usage summary is).
        `on_first(now)` is called when the first bytes pass. Raises the upstream's
        TransportError (the engine broke off or fell silent, ClientGoneError: the client
        left), the answer still open. Cancellation leaves it open too."""
        ...

    async def end(self, data: bytes = b"") -> None:
        """The last body bytes and the end of the answer (the client's leaving no longer
        cancels the request from here: the server reports every end as a disconnect)."""
        ...


class Disconnect:
    """One request's disconnect hook: `arm(scope)` makes the client's leaving cancel `scope`,
    at once if it has left already; `disarm()` ends that. `fire()` is the server side's
    report that the client went away (synchronous)."""

    __slots__ = ("_gone", "_scope")

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self._gone = False

    def arm(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        if self._gone:
            self.fire()

    def disarm(self) -> None:
        self._scope = None

    def fire(self) -> None:
        self._gone = True
        if (scope := self._scope) is not None:
            self._scope = None
            scope.cancel(reason="the client went away")


def answer_of(scope: Scope) -> Answer | None:
    """The writer the server built for this request, or None (a server that builds none)."""
    extensions = scope.get("extensions")
    return extensions.get(ANSWER_EXTENSION) if extensions else None


def tail_of(before: bytes, last: bytes) -> bytes:
    """The end of a body whose last two pieces were `before` and `last`."""
    return before[-TAIL_BYTES:] + last[-TAIL_BYTES:]


class AsgiAnswer:
    """An `Answer` over plain ASGI `send`: every piece is one ASGI message. The head goes out
    with the first body message after it; an engine body's last piece waits for `end`, so
    that it goes out in the message that ends the answer."""

    __slots__ = ("_head", "_held", "_hook", "_send", "sent")

    def __init__(self, send: Send, hook: Disconnect | None = None) -> None:
        self._send, self._hook = send, hook
        self._head: Message | None = None
        self._held = b""  # an engine body's last piece, for the end
        self.sent = 0

    def arm(self, scope: trio.CancelScope) -> None:
        if self._hook is not None:
            self._hook.arm(scope)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._head = {"type": "http.response.start", "status": status, "headers": headers}

    async def _flush_head(self, *, hold: bool = True) -> None:
        """Send the head if it is still to go (`hold`: a writer that can may join it to the
        next message's bytes)."""
        if (head := self._head) is not None:
            self._head = None
            await self._send(head)

    async def body(self, data: bytes) -> None:
        self.sent += len(data)
        if self._held:
            data, self._held = self._held + data, b""
        if not data:
            return
        await self._flush_head()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def relay(
        self,
        response: UpstreamResponse,
        *,
        rewrite: Rewrite | None = None,
        on_first: Callable[[float], None] | None = None,
    ) -> bytes:
        await self._flush_head(hold=False)  # a stream's head goes out before its first event
        return await self._pass_on(response, rewrite, on_first)

    async def _pass_on(
        self,
        response: UpstreamResponse,
        rewrite: Rewrite | None,
        on_first: Callable[[float], None] | None,
        *,
        until_relayable: Callable[[], bool] | None = None,
    ) -> bytes:
        """The general path: `response`'s body chunk by chunk, each as an ASGI message (the
        last held for `end`). With `until_relayable`, returns after a chunk when it says the
        rest can go another way (`response.complete` tells the two apart)."""
        before = last = b""
        async for chunk in response:
            if on_first is not None:
                on_first(trio.current_time())
                on_first = None
            final = response.complete
            piece = rewrite.data(chunk, final) if rewrite is not None else chunk
            before, last = last, chunk
            if final:
                self._held += piece
                self.sent += len(piece)
                break
            await self.body(piece)
            if until_relayable is not None and until_relayable():
                break
        else:
            if rewrite is not None:  # what the rewriting held back for a match
                piece = rewrite.data(b"", True)
                self._held += piece
                self.sent += len(piece)
        return tail_of(before, last)

    async def end(self, data: bytes = b"") -> None:
        if self._hook is not None:
            self._hook.disarm()
        self.sent += len(data)
        await self._flush_head()
        held, self._held = self._held, b""
        await self._send({"type": "http.response.body", "body": held + data, "more_body": False})


@asynccontextmanager
async def open_asgi_answer(receive: Receive, send: Send) -> AsyncIterator[tuple[Answer, Receive]]:
    """An `AsgiAnswer` for a server that builds no writer, and the `receive` to read the
    request's body with. Once the body has been read, a task waits for the server's
    `http.disconnect` and reports the client gone to the writer's hook (plain ASGI gives no
    other way to see it while the app waits on an engine). Leaving the block ends that task."""
    hook = Disconnect()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        hook.fire()

    async with trio.open_nursery() as nursery:

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                hook.fire()
            elif not message.get("more_body", False):
                nursery.start_soon(watch)  # the body is in: from now on, only its leaving
            return message

        yield AsgiAnswer(send, hook), receive_body
        nursery.cancel_scope.cancel(reason="the exchange is over")
