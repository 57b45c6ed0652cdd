"""Fake vLLM engines with a real capacity, for the flow-control benchmark (bench/bench_flow.py):
each serves `capacity` streams at once and queues the rest itself, first come first served, so
that its time to first token grows with its queue, as vLLM's does.

    python bench/flow_engines.py SPEC.json

SPEC.json: {"engines": 4, "host": "127.0.0.1", "capacity": 4, "prefill_s": 0.2, "itl_s": 0.02,
"tokens": 40, "priority_scheduling": false}. Each engine listens on `host` and a free port; the
process prints "ready URL URL ..." once every engine listens, then serves until killed.

Every engine answers `GET /v1/models` (model `fake-model`), `GET /health`, `GET /metrics` (the
vLLM page of tests/fixtures, its `vllm:num_requests_running` and `vllm:num_requests_waiting`
the engine's own) and `POST /v1/chat/completions`. A chat takes one of the engine's
`capacity` slots (waiting in the engine's queue until one is free) for `prefill_s`, then
`tokens` tokens (the request's `max_tokens` when smaller), one every `itl_s`. Streamed
(`"stream": true`), the answer's head goes out at once (vLLM sends it before the request is
scheduled), then one `chat.completion.chunk` event per token (the first with the role), a
finish event and `data: [DONE]`, each its own HTTP chunk; otherwise one chat.completion when the
last token is made.

With `"priority_scheduling": true` an engine schedules as vLLM does with
`--scheduling-policy priority`: waiting requests by their body's `priority` (lower first; 0
without one), then arrival; and a request that finds every slot taken by a running request of a
worse priority preempts the worst of them, which goes back to waiting (its tokens so far
sent) and, once it has a slot again, computes its prefill again before its next token.
Without it, first come, first served, never preempted.

A client that closes its connection aborts its request, queued or running (vLLM's server
aborts a request whose client left): the engine reads the connection while it answers, and a
write that fails counts the same.

`GET /flow/records` returns every chat request the process has seen (JSON: `{"now": unix,
"records": [...]}`), each with the engine, the request's `x-bench-id` and `x-bench-tenant`
headers, its deadline (the `x-bench-deadline-unix` header: the unix time by which its client
wants the first token; null without one), when its client sent it (`x-bench-sent-unix`), the
`priority` field of its body (null without one), and the unix times it arrived, took a slot,
sent its first token and ended (null when not reached), and how it ended ("done", "aborted"
by its client, null while running). Wall clock (unix) time, because the benchmark compares it
with the client's, in another process.

With `"upstreams": [URL, ...]` in the spec the process fakes nothing: each of its engines
relays every request (but `/flow/records`) to one real engine (vLLM) instead, each over a
new upstream connection (asked to close
after its answer, as the answer then tells the client), recording the same figures: "started"
is when the request was handed to the engine (queued or running there, it is the engine's),
"first_token" when the first event with content went by. A client that leaves closes the
upstream connection, which vLLM takes as an abort.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Final

import trio

from fleet import _take_request as take_request

MODEL: Final = "fake-model"
FIXTURE: Final = (
    Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_metrics.txt"
).read_text()
MODELS: Final = json.dumps(
    {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 4096}],
    }
).encode()
STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\nserver: flow\r\n\r\n"
)
_MAX_TOKENS: Final = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_STREAMED: Final = re.compile(rb'"stream"\s*:\s*true')
_PRIORITY: Final = re.compile(rb'"priority"\s*:\s*(-?\d+)')
_TOKEN: Final = re.compile(rb'"content":"[^"]')  # an event (or answer) with content
_GAUGE: Final = re.compile(r"^(vllm:num_requests_(?:running|waiting))\{[^}]*\} \S+$", re.M)


@dataclass
class Record:
    """One chat request as the engine saw it (see the module's docstring)."""

    engine: str
    id: str | None
    tenant: str | None
    deadline: float | None
    sent: float | None  # x-bench-sent-unix: when the client sent it
    priority: int | None
    arrived: float
    started: float | None = None
    first_token: float | None = None
    ended: float | None = None
    outcome: str | None = None
    preempted: int = 0  # times it lost its slot to a request of a better priority


@dataclass(frozen=True)
class Spec:
    capacity: int
    prefill_s: float
    itl_s: float
    tokens: int
    upstream: tuple[str, int] | None = None  # relay to this real engine (host, port)
    priority_scheduling: bool = False  # as vLLM's --scheduling-policy priority


class Ticket:
    """One request's claim on a slot: its rank, and how it is told it has one (or lost it)."""

    def __init__(self, priority: int, seq: int) -> None:
        self.rank = (priority, seq)
        self.granted = trio.Event()
        self.scope: trio.CancelScope | None = None  # while it runs: cancelled to preempt it
        self.preempted = False


class Engine:
    """One engine: its slots, the requests waiting for one (by rank) and running, and every
    request's record."""

    def __init__(self, name: str, spec: Spec, records: list[Record]) -> None:
        self.name, self.spec, self.records = name, spec, records
        self.free = spec.capacity
        self.queue: list[tuple[tuple[int, int], Ticket]] = []  # a heap by rank
        self.holders: set[Ticket] = set()
        self.seq = itertools.count()
        self.waiting = self.running = 0

    def ticket(self, priority: int | None) -> Ticket:
        rank = (priority or 0) if self.spec.priority_scheduling else 0
        return Ticket(rank, next(self.seq))

    async def acquire(self, ticket: Ticket) -> None:
        """Wait for a slot (preempting a worse request when priorities are scheduled)."""
        heapq.heappush(self.queue, (ticket.rank, ticket))
        self._schedule()
        try:
            await ticket.granted.wait()
        except BaseException:
            if ticket.granted.is_set():
                self.release(ticket)
            else:
                self.queue = [(r, t) for r, t in self.queue if t is not ticket]
                heapq.heapify(self.queue)
            raise

    def release(self, ticket: Ticket) -> None:
        if ticket in self.holders:
            self.holders.discard(ticket)
            self.free += 1
            self._schedule()

    def _schedule(self) -> None:
        while self.queue:
            rank, ticket = self.queue[0]
            if self.free > 0:
                heapq.heappop(self.queue)
                self.free -= 1
                self.holders.add(ticket)
                ticket.granted.set()
                continue
            running = [t for t in self.holders if t.scope is not None]
            if not self.spec.priority_scheduling or not running:
                return
            victim = max(running, key=lambda t: t.rank)
            if victim.rank <= rank:
                return
            victim.preempted = True
            assert victim.scope is not None
            victim.scope.cancel()
            self.holders.discard(victim)
            self.free += 1

    def metrics(self) -> bytes:
        values = {
            "vllm:num_requests_running": self.running,
            "vllm:num_requests_waiting": self.waiting,
        }
        text = _GAUGE.sub(
            lambda m: f'{m.group(1)}{{engine="0",model_name="{MODEL}"}} {values[m.group(1)]}.0',
            FIXTURE,
        )
        return text.replace("meta-llama/Llama-3.1-8B-Instruct", MODEL).encode()


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nserver: flow\r\n\r\n"
        % (status, content_type, len(body))
        + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(name: str, delta: dict[str, str], finish: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    event = {
        "id": "chatcmpl-flow",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "system_fingerprint": name,
        "choices": [choice],
    }
    return _chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


def _whole(name: str, tokens: int) -> bytes:
    body = {
        "id": "chatcmpl-flow",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "system_fingerprint": name,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": " tok" * tokens},
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
    }
    return _response(b"200 OK", b"application/json", json.dumps(body).encode())


def _header(head: list[bytes], name: bytes) -> str | None:
    for line in head[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode()
    return None


class Connection:
    """One client connection: requests read in turn; while one is answered, a reader watches
    for the client leaving (and keeps anything it sends for the next request)."""

    def __init__(self, stream: trio.SocketStream, engine: Engine) -> None:
        self.stream, self.engine = stream, engine
        self.buffer = b""
        self.eof = False  # the client left, or the connection ends after this answer

    async def serve(self) -> None:
        while True:
            while (request := take_request(self.buffer)) is None:
                if self.eof or not (data := await self.stream.receive_some()):
                    return
                self.buffer += data
            head, body, self.buffer = request
            method, _, rest = head[0].partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            relayed = self.engine.spec.upstream is not None and path != b"/flow/records"
            if relayed or (method == b"POST" and path == b"/v1/chat/completions"):
                if not await self._chat(head, body):
                    return
            else:
                await self.stream.send_all(self._answer(method, path))

    def _answer(self, method: bytes, path: bytes) -> bytes:
        if method == b"GET" and path == b"/v1/models":
            return _response(b"200 OK", b"application/json", MODELS)
        if method == b"GET" and path == b"/metrics":
            return _response(b"200 OK", b"text/plain; version=0.0.4", self.engine.metrics())
        if method == b"GET" and path == b"/health":
            return _response(b"200 OK", b"application/json", b"")
        if method == b"GET" and path == b"/flow/records":
            records = [asdict(r) for r in self.engine.records]
            body = json.dumps({"now": time.time(), "records": records}).encode()
            return _response(b"200 OK", b"application/json", body)
        return _response(b"404 Not Found", b"application/json", b'{"detail":"Not Found"}')

    async def _watch(self, scope: trio.CancelScope) -> None:
        """Until the client closes the connection (then `scope` is cancelled) or this task is
        cancelled; data read meanwhile is kept."""
        try:
            while data := await self.stream.receive_some():
                self.buffer += data
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.eof = True
        scope.cancel(reason="the client left")

    async def _chat(self, head: list[bytes], body: bytes) -> bool:
        """Answer one chat; False once the client has left."""
        engine, spec = self.engine, self.engine.spec
        deadline = _header(head, b"x-bench-deadline-unix")
        priority = _PRIORITY.search(body)
        record = Record(
            engine=engine.name,
            id=_header(head, b"x-bench-id"),
            tenant=_header(head, b"x-bench-tenant"),
            deadline=float(deadline) if deadline else None,
            sent=float(sent) if (sent := _header(head, b"x-bench-sent-unix")) else None,
            priority=int(priority.group(1)) if priority else None,
            arrived=time.time(),
        )
        engine.records.append(record)
        asked = _MAX_TOKENS.search(body)
        tokens = min(spec.tokens, int(asked.group(1))) if asked else spec.tokens
        streamed = _STREAMED.search(body) is not None
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as answering:
                nursery.start_soon(self._watch, answering)
                try:
                    if spec.upstream is not None:
                        await self._relay(spec.upstream, head, body, record)
                        self.eof = True  # the answer said "connection: close"
                    else:
                        if streamed:
                            await self.stream.send_all(STREAM_HEAD)
                        await self._generate(record, tokens, streamed)
                    record.outcome = "done"
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    answering.cancel(reason="the client left")
            if answering.cancelled_caught or record.outcome is None:
                record.outcome, self.eof = "aborted", True
            record.ended = time.time()
            nursery.cancel_scope.cancel(reason="answered")
        return not self.eof

    async def _relay(
        self, upstream: tuple[str, int], head: list[bytes], body: bytes, record: Record
    ) -> None:
        """The request to the real engine `upstream`, its answer back as it comes."""
        kept = (b"content-length", b"transfer-encoding", b"connection")
        lines = [line for line in head[1:] if line.partition(b":")[0].strip().lower() not in kept]
        lines += [b"content-length: %d" % len(body), b"connection: close"]
        request = b"\r\n".join([head[0], *lines]) + b"\r\n\r\n" + body
        async with await trio.open_tcp_stream(*upstream) as engine:
            await engine.send_all(request)
            record.started = time.time()
            tail = b""
            while data := await engine.receive_some(65536):
                if record.first_token is None and _TOKEN.search(tail + data):
                    record.first_token = time.time()
                tail = data[-64:]
                await self.stream.send_all(data)

    async def _generate(self, record: Record, tokens: int, streamed: bool) -> None:
        engine, spec = self.engine, self.engine.spec
        produced = 0
        while produced < tokens:
            ticket = engine.ticket(record.priority)
            engine.waiting += 1
            try:
                await engine.acquire(ticket)
            finally:
                engine.waiting -= 1
            engine.running += 1
            try:
                with trio.CancelScope() as ticket.scope:
                    if record.started is None:
                        record.started = time.time()
                    start, resume = trio.current_time(), produced
                    await trio.sleep_until(start + spec.prefill_s)  # or its recomputation
                    for k in range(resume, tokens):
                        if k > resume:
                            await trio.sleep_until(
                                start + spec.prefill_s + (k - resume) * spec.itl_s
                            )
                        delta = (
                            {"role": "assistant", "content": " tok"}
                            if k == 0
                            else {"content": " tok"}
                        )
                        if streamed:  # a preemption lands between events, not in one
                            with trio.CancelScope(shield=True):
                                await self.stream.send_all(_event(engine.name, delta, None))
                        if k == 0:
                            record.first_token = time.time()
                        produced = k + 1
                ticket.scope = None
                if ticket.preempted:
                    record.preempted += 1
            finally:
                engine.running -= 1
                engine.release(ticket)
        if streamed:
            await self.stream.send_all(
                _event(engine.name, {}, "length") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            )
        else:
            await self.stream.send_all(_whole(engine.name, tokens))


async def _handle(engine: Engine, stream: trio.SocketStream) -> None:
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await Connection(stream, engine).serve()


async def serve(raw: dict[str, object]) -> None:
    spec = Spec(
        capacity=int(str(raw.get("capacity", 4))),
        prefill_s=float(str(raw.get("prefill_s", 0.2))),
        itl_s=float(str(raw.get("itl_s", 0.02))),
        tokens=int(str(raw.get("tokens", 40))),
        priority_scheduling=bool(raw.get("priority_scheduling", False)),
    )
    upstreams = raw.get("upstreams") or []
    assert isinstance(upstreams, list)
    host = str(raw.get("host", "127.0.0.1"))
    records: list[Record] = []
    async with trio.open_nursery() as nursery:
        urls = []
        for index in range(len(upstreams) or int(str(raw.get("engines", 4)))):
            if upstreams:
                where = str(upstreams[index]).removeprefix("http://").rsplit(":", 1)
                spec = replace(spec, upstream=(where[0], int(where[1])))
            listeners = await trio.open_tcp_listeners(0, host=host, backlog=1024)
            port = listeners[0].socket.getsockname()[1]
            engine = Engine(f"engine-{index}@{host}:{port}", spec, records)
            nursery.start_soon(trio.serve_listeners, partial(_handle, engine), listeners)
            urls.append(f"http://{host}:{port}")
        print("ready", *urls, flush=True)


def main() -> None:
    trio.run(serve, json.loads(Path(sys.argv[1]).read_text()))


if __name__ == "__main__":
    main()
