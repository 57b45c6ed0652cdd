"""The Redis client of the shared limit store (`shared`): commands pipelined on one TCP
connection on Trio, replies parsed by hiredis (Redis's own C parser).

Why not an existing Redis client library: called from Trio, the official `redis` client
needs a worker thread per call and `coredis` runs through anyio; both cost the router several
times the CPU of this connection per request at load (docs/performance.md, "Shared limits").
What is left to write is the transport (the connection, pipelining, deadlines), which a Trio
program owns anyway; the protocol's parsing is hiredis's.

One connection per replica. A caller takes its place in the line of replies and hands its
command to the writer in one synchronous step (Redis answers in the order it was asked, so a
place taken is a command that will be sent); the writer task sends every command handed to it
since its last send in one write, and the reader task hands each reply to its caller, as many
as one read brings. A caller that gives up (its deadline) leaves its place; the reply is read
and dropped. A broken connection fails every waiting caller with `RedisError`; the next call
opens a new one.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import hiredis
import trio

__all__ = ["RedisConnection", "RedisError", "RedisURL", "encode_command"]

_READ_BYTES = 64 * 1024


class RedisError(Exception):
    """The Redis server cannot answer: not reachable, the connection broke, or it answered
    an error."""


@dataclass(frozen=True, slots=True)
class RedisURL:
    """Where the Redis server is, and how to log in to it."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def parse(cls, url: str) -> RedisURL:
        """`redis://[[user]:password@]host[:port][/db]`; ValueError naming what is wrong."""
        parts = urlsplit(url)
        if parts.scheme != "redis":
            raise ValueError(
                f"the store URL must be redis://HOST[:PORT][/DB], got {parts.scheme!r}"
            )
        if not parts.hostname:
            raise ValueError("the store URL has no host")
        db_text = parts.path.strip("/") or "0"
        if not db_text.isdigit():
            raise ValueError(f"the store URL's database must be a number, got {db_text!r}")
        return cls(
            host=parts.hostname,
            port=parts.port or 6379,
            db=int(db_text),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
        )

    def __str__(self) -> str:  # never the password
        return f"redis://{self.host}:{self.port}/{self.db}"


def encode_command(*args: bytes | str | int | float) -> bytes:
    """One command as RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


class _Dropped:
    """The place in line of a command whose reply nobody waits for (`post`)."""

    __slots__ = ()


_DROPPED: Final = _Dropped()


class _Waiter:
    """A caller's place in line: its reply, once read (a caller that gave up is not told)."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Any = None


class RedisConnection:
    """Commands to one Redis server. `run` (a task of its owner's nursery) keeps the writer
    and the reader; `call` sends one command and waits for its reply."""

    def __init__(
        self,
        url: RedisURL,
        *,
        connect_timeout: float,
        connect: Callable[[str, int], Awaitable[trio.SocketStream]] = trio.open_tcp_stream,
    ) -> None:
        self.url = url
        self._connect_timeout = connect_timeout
        self._open = connect
        self._stream: trio.SocketStream | None = None
        self._waiters: collections.deque[_Waiter | _Dropped] = collections.deque()
        self._outgoing: list[bytes] = []  # commands handed to the writer, not sent yet
        self._to_send = trio.Event()  # set when `_outgoing` has something
        self._opened = trio.Event()  # a new stream for the writer and the reader
        self._connecting: trio.Event | None = None
        self._closed = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the commands and read the replies of each connection in turn, until
        cancelled."""
        task_status.started()
        try:
            while True:
                await self._opened.wait()
                self._opened = trio.Event()
                stream = self._stream
                if stream is None:
                    continue
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write, stream)
                    await self._read(stream)
                    nursery.cancel_scope.cancel()
        finally:
            self._closed = True
            self._break(RedisError("the store connection is closed"))

    async def call(self, *args: bytes | str | int | float) -> Any:
        """The reply to one command; RedisError when the store cannot answer (an error reply
        included). Cancellation (the caller's deadline) leaves the reply to be dropped."""
        stream = self._stream or await self._connect()
        return await self._exchange(stream, [encode_command(*args)])

    async def pipeline(self, commands: Sequence[Sequence[bytes | str | int | float]]) -> list[Any]:
        """The replies to several commands sent at once, in order."""
        stream = self._stream or await self._connect()
        replies: list[Any] = await self._exchange(
            stream, [encode_command(*c) for c in commands], many=True
        )
        return replies

    def post(self, commands: Sequence[Sequence[bytes | str | int | float]]) -> bool:
        """Send commands whose replies nobody needs (they are read and dropped), without
        waiting: False, and nothing sent, when there is no open connection."""
        if self._stream is None:
            return False
        self._waiters.extend(_DROPPED for _ in commands)
        self._outgoing += (encode_command(*c) for c in commands)
        self._to_send.set()
        return True

    async def _exchange(
        self, stream: trio.SocketStream, data: list[bytes], *, many: bool = False
    ) -> Any:
        if stream is not self._stream:
            raise RedisError("the store connection broke")
        # The place in the line and the command together, with no checkpoint between: a
        # place taken whose command was never sent would pair every later reply with the
        # wrong caller.
        waiters = [_Waiter() for _ in data]
        self._waiters.extend(waiters)
        self._outgoing += data
        self._to_send.set()
        for waiter in waiters:
            await waiter.done.wait()  # cancelled: the reply is read later, and dropped
        replies = []
        for waiter in waiters:
            if isinstance(waiter.reply, Exception):
                raise RedisError(str(waiter.reply)) from None
            replies.append(waiter.reply)
        return replies if many else replies[0]

    async def _connect(self) -> trio.SocketStream:
        """The open connection, opened (AUTH, SELECT) by the first caller that needs it;
        callers meanwhile wait for it."""
        if self._closed:
            raise RedisError("the store connection is closed")
        if self._connecting is not None:
            await self._connecting.wait()
            if self._stream is None:
                raise RedisError(f"cannot connect to the store at {self.url}")
            return self._stream
        self._connecting = connecting = trio.Event()
        try:
            with trio.move_on_after(self._connect_timeout) as timed:
                stream = await self._open(self.url.host, self.url.port)
            if timed.cancelled_caught:
                raise RedisError(
                    f"cannot connect to the store at {self.url}: no answer within "
                    f"{self._connect_timeout:g} s"
                )
            self._stream = stream
            self._opened.set()
            setup: list[list[bytes | str | int | float]] = []
            if self.url.password is not None:
                auth: list[bytes | str | int | float] = ["AUTH"]
                if self.url.username is not None:
                    auth.append(self.url.username)
                setup.append([*auth, self.url.password])
            if self.url.db:
                setup.append(["SELECT", self.url.db])
            if setup:
                await self._exchange(stream, [encode_command(*c) for c in setup], many=True)
            return stream
        except OSError as exc:
            raise RedisError(f"cannot connect to the store at {self.url}: {exc}") from None
        except BaseException:
            self._break(RedisError("the store connection broke"))
            raise
        finally:
            self._connecting = None
            connecting.set()

    async def _write(self, stream: trio.SocketStream) -> None:
        """Send what callers handed over, everything since the last send in one write; a send
        that does not finish within the connect timeout drops the connection."""
        while True:
            await self._to_send.wait()
            self._to_send = trio.Event()
            data, self._outgoing = b"".join(self._outgoing), []
            with trio.move_on_after(self._connect_timeout) as sending:
                try:
                    await stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self._break(
                        RedisError(f"cannot send to the store at {self.url}: {exc}"), stream
                    )
                    return
            if sending.cancelled_caught:
                self._break(RedisError(f"sending to the store at {self.url} timed out"), stream)
                return

    async def _read(self, stream: trio.SocketStream) -> None:
        reader = hiredis.Reader(replyError=Exception)
        try:
            while True:
                data = await stream.receive_some(_READ_BYTES)
                if not data:
                    raise RedisError(f"the store at {self.url} closed the connection")
                reader.feed(bytes(data))
                while (reply := reader.gets()) is not False:
                    if not self._waiters:
                        raise RedisError("the store sent a reply nobody asked for")
                    waiter = self._waiters.popleft()
                    if isinstance(waiter, _Waiter):
                        waiter.reply = reply
                        waiter.done.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._break(RedisError(f"the store connection at {self.url} broke: {exc}"), stream)
        except RedisError as exc:
            self._break(exc, stream)
        except hiredis.ProtocolError as exc:
            self._break(RedisError(f"the store at {self.url} sent invalid RESP: {exc}"), stream)

    def _break(self, error: RedisError, stream: trio.SocketStream | None = None) -> None:
        """Fail every waiting caller and drop the connection (the next call opens one)."""
        current = self._stream
        if stream is not None and current is not stream:
            return
        self._stream = None
        self._outgoing = []
        while self._waiters:
            waiter = self._waiters.popleft()
            if isinstance(waiter, _Waiter):
                waiter.reply = error
                waiter.done.set()
        if current is not None:
            current.socket.close()
