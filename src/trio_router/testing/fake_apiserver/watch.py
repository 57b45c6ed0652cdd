"""One WATCH request to the fake API server, answered as the real one answers it: refused (a
planned status, 504 for a resourceVersion not reached yet, HTTP 410 for a compacted one when
the server says so), or a chunked stream of JSON lines (the current objects as ADDED when no
resourceVersion was given, then every event of the history that the selectors match,
bookmarks when allowed) that ends at its timeout, or as a plan or the server cuts it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from .history import KINDS, History, Matcher, api_version, event_line, matcher
from .wire import Exchange

TRUE: Final = ("true", "True", "1")
WATCH_S: Final = 1800  # a watch's timeout when the request names none
SEND_EVENTS: Final = 256  # events per write (each still its own chunk, as the API server)


@dataclass(frozen=True, slots=True)
class WatchPlan:
    """What the server does with one WATCH request (default: serve it normally).

    kind: "serve"; "status" (answer `status` with a Status body and `headers`);
    "error_event" (200, then one ERROR event with code `status`, then end); "stall" (200
    headers, then silence); "reset" (serve `after_events` events, then cut the connection).
    """

    kind: str = "serve"
    status: int = 500
    reason: str = "InternalError"
    message: str = "injected failure"
    headers: tuple[tuple[str, str], ...] = ()
    after_events: int = 0


@dataclass(frozen=True, slots=True)
class Cut:
    """How the server last cut its open watches: `how` is "end" (the end of the chunked
    body), "rst" (TCP RST), "reset" (the connection closed mid-body) or "expire" (410);
    `count` tells one cut from the next. A stream under way ends at the first cut after it
    began."""

    count: int = 0
    how: str = ""

    def next(self, how: str) -> Cut:
        return Cut(self.count + 1, how)


class Server(Protocol):
    """What a watch reads of the server (`FakeApiServer`), and what it counts there."""

    history: History
    cut: Cut  # how open watches were last cut
    expired_as_event: bool  # 410 as an ERROR event in a 200 stream, or HTTP 410
    max_watch_s: float | None  # cap on timeoutSeconds
    bookmark_interval_s: float | None  # periodic bookmarks (when allowed)
    events_sent: int
    bookmarks_sent: int

    def count_open_watch(self, resource: str, change: int) -> None: ...

    def notify(self) -> None: ...

    async def wait_for(self, predicate: Callable[[], bool]) -> None: ...


@dataclass(frozen=True, slots=True)
class _Stream:
    """What one watch stream sends, fixed when it begins."""

    resource: str  # PODS or POOLS
    match: Matcher
    plan: WatchPlan
    bookmarks: bool  # allowWatchBookmarks
    deadline: float  # trio time at which it ends (with a bookmark, when allowed)
    interval: float | None  # between periodic bookmarks, None for none
    cut: Cut  # the server's when it began


async def serve_watch(
    server: Server, exchange: Exchange, query: dict[str, str], resource: str, plan: WatchPlan
) -> bool:
    """Answer one WATCH of `resource` as `plan` says; True if the connection may be kept.
    The server's open watches count this one while its stream is open; a cancellation
    leaves the stream unfinished (the caller closes the connection)."""
    rv_text = query.get("resourceVersion", "")
    start = int(rv_text) if rv_text.isdigit() and rv_text != "0" else None
    if await _refused(server, exchange, plan, start):
        return True
    expired = start is not None and start < server.history.compacted_rv
    await exchange.start_stream()
    server.count_open_watch(resource, 1)
    try:
        if expired:
            await exchange.end_with_error(410, "Expired", f"too old resource version: {start}")
            return True
        if plan.kind == "error_event":
            await exchange.end_with_error(plan.status, plan.reason, plan.message)
            return True
        if plan.kind == "stall":
            await trio.sleep_forever()
        return await _stream_events(server, exchange, _stream(server, query, resource, plan), start)
    finally:
        server.count_open_watch(resource, -1)


async def _refused(server: Server, exchange: Exchange, plan: WatchPlan, start: int | None) -> bool:
    """Answer without a stream when the plan, or the resourceVersion asked for, says so:
    a planned status; 504 for one not reached yet; 410 for a compacted one when the server
    sends expiry as an HTTP status. True if answered."""
    history = server.history
    if plan.kind == "status":
        await exchange.send_status(plan.status, plan.reason, plan.message, plan.headers)
    elif start is not None and start > history.rv:
        cause = {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
        await exchange.send_status(
            504,
            "Timeout",
            f"Too large resource version: {start}, current: {history.rv}",
            details={"causes": [cause], "retryAfterSeconds": 1},
        )
    elif start is not None and start < history.compacted_rv and not server.expired_as_event:
        message = f"too old resource version: {start} ({history.compacted_rv})"
        await exchange.send_status(410, "Expired", message)
    else:
        return False
    return True


def _stream(server: Server, query: dict[str, str], resource: str, plan: WatchPlan) -> _Stream:
    """The stream `query` asks for, within the server's bounds (`max_watch_s`) and with its
    periodic bookmarks (`bookmark_interval_s`) when the client allows bookmarks."""
    bookmarks = query.get("allowWatchBookmarks") in TRUE
    timeout = float(query.get("timeoutSeconds") or WATCH_S)
    if server.max_watch_s is not None:
        timeout = min(timeout, server.max_watch_s)
    interval = server.bookmark_interval_s if bookmarks and server.bookmark_interval_s else None
    deadline = trio.current_time() + timeout
    return _Stream(resource, matcher(query), plan, bookmarks, deadline, interval, server.cut)


async def _stream_events(
    server: Server, exchange: Exchange, stream: _Stream, start: int | None
) -> bool:
    """Send the stream's events as they happen until it ends; True if the connection may be
    kept."""
    history, plan = server.history, stream.plan
    next_bookmark = trio.current_time() + stream.interval if stream.interval else math.inf
    if start is None:  # no resourceVersion: synthetic ADDED for the current objects
        current = history.matching(stream.resource, stream.match)
        await exchange.send_lines([event_line("ADDED", o) for o in current])
        cursor = history.rv
    else:
        cursor = start
    sent = 0
    while True:
        if server.cut != stream.cut:  # before sending: changes made with a cut stay unsent
            return await _end_at_cut(server, exchange)
        limit = plan.after_events - sent if plan.kind == "reset" else math.inf
        cursor, batch = _next_batch(history, stream, cursor, limit)
        await _send_events(server, exchange, batch)
        sent += len(batch)
        if plan.kind == "reset" and sent >= plan.after_events:
            return False  # cut: the chunked body never ends
        now = trio.current_time()
        if now >= next_bookmark:
            await exchange.send_lines([_bookmark(history, stream.resource)])
            next_bookmark = now + (stream.interval or math.inf)
            server.bookmarks_sent += 1
            server.notify()
        if now >= stream.deadline:  # routine expiry: a bookmark "right before the deadline"
            await exchange.end_stream(
                [_bookmark(history, stream.resource)] if stream.bookmarks else []
            )
            return True
        with trio.move_on_at(min(stream.deadline, next_bookmark)):
            await server.wait_for(_news(server, stream.cut, cursor))


def _next_batch(
    history: History, stream: _Stream, cursor: int, limit: float
) -> tuple[int, list[bytes]]:
    """The events after `cursor` the stream selects, at most `limit` of them, and the
    resourceVersion they bring the stream to."""
    batch: list[bytes] = []
    for entry in history.after(cursor):
        if len(batch) >= limit:
            break
        cursor = entry.rv
        if entry.resource == stream.resource and stream.match(entry.name, entry.labels):
            batch.append(entry.line)
    return cursor, batch


async def _send_events(server: Server, exchange: Exchange, batch: list[bytes]) -> None:
    """Send `batch` and count it in the server's `events_sent`."""
    for i in range(0, len(batch), SEND_EVENTS):
        await exchange.send_lines(batch[i : i + SEND_EVENTS])
    server.events_sent += len(batch)
    if batch:
        server.notify()


def _news(server: Server, cut: Cut, cursor: int) -> Callable[[], bool]:
    """Whether a stream at `cursor`, begun under `cut`, has something to do: a later cut,
    or an event since `cursor`."""
    return lambda: server.cut != cut or server.history.has_after(cursor)


async def _end_at_cut(server: Server, exchange: Exchange) -> bool:
    """End the stream under way as the server's last cut says; True if the connection may
    be kept."""
    how = server.cut.how
    if how == "end":
        await exchange.end_stream()
        return False  # and close the connection
    if how == "rst":
        exchange.reset_on_close()
        return False
    if how == "reset" or not server.expired_as_event:
        return False
    await exchange.end_with_error(410, "Expired", "too old resource version")
    return True


def _bookmark(history: History, resource: str) -> bytes:
    """A BOOKMARK event at the current resourceVersion."""
    obj = {
        "kind": KINDS[resource][0],
        "apiVersion": api_version(resource),
        "metadata": {"resourceVersion": str(history.rv)},
    }
    return json.dumps({"type": "BOOKMARK", "object": obj}).encode() + b"\n"
