"""A fleet of fake vLLM engines in one process, each on its own loopback address, for the scale
benchmark (bench/bench_scale.py) and the endpoint picker's (bench/bench_picker.py).

    python bench/fleet.py SPEC.json

SPEC.json: {"port": 18800, "engines": {"127.0.10.1": "ok", "127.0.11.1": "hang",
"127.0.12.1": "slow:1.0", ...}}. Every engine listens on its address and `port` (or on the port
its key names: "127.0.0.1:18801") and answers `GET /v1/models` (model `fake-model`), `GET
/metrics` (a vLLM page, tests/fixtures, with the engine's own requests running and none
waiting) and `POST /v1/chat/completions` (a small
chat.completion):

- "ok": at once;
- "slow:S": after S seconds (a busy engine);
- "hang": never (it accepts the connection and reads the request, then stays silent: a stuck
  node or a partitioned zone, as seen from the router);
- "paced": a streamed chat (`"stream": true`) as vLLM writes its tokens: the answer's head at
  once, the first event `ttft_s` later, then one event per running stream at every decode
  step of the engine (every `itl_s`, all of the engine's streams in the same step, as vLLM's
  batch does), each event its own HTTP chunk; as many events as the request's `max_tokens`
  (64 without it), then `data: [DONE]`. The spec's `"paced": {"ttft_s": 0.02, "itl_s":
  0.005}` sets the two (these are the defaults). A non-streamed chat is answered at once.

A chat request with `"stream": true` to any other engine is answered with a chunked event
stream of 2,000 events of about 1 KB each, written at once (for slow-reader runs). Every
engine answers `GET /health`, and `GET /fleet/answers` with the chat answers the whole fleet
has finished so far (`{"answers": N}`, for a load generator to count what was served in a
window). Every answer carries `fake-HOST:PORT` (the engine's own address), so a client can tell
which engine served it. Request bodies may come with a length or chunked.

Like vLLM (uvicorn), an engine closes a keep-alive connection after 5 s without a request (the
spec's `keep_alive_s` changes it). The process prints "ready N" once every engine listens,
then serves until killed. asyncio protocols keep its own CPU small next to the router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import resource
import sys
from functools import partial
from pathlib import Path
from typing import Final

KEEP_ALIVE_S: Final = 5.0  # uvicorn's default timeout_keep_alive, which vLLM keeps
_FIXTURE: Final = (
    Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_metrics.txt"
).read_bytes()
# The fixture's running and waiting samples, which each engine fills in with its own figures.
_RUNNING_SAMPLE: Final = re.compile(rb"^(vllm:num_requests_running\{[^}]*\}) \S+$", re.M)
_WAITING_SAMPLE: Final = re.compile(rb"^(vllm:num_requests_waiting\{[^}]*\}) \S+$", re.M)
_METRICS: dict[int, bytes] = {}
RUNNING: dict[str, int] = {}  # chat requests each engine (its address) is answering now


def metrics(running: int) -> bytes:
    """The engine's /metrics page as vLLM writes it: `running` requests running, none
    waiting (the fleet queues nothing)."""
    page = _METRICS.get(running)
    if page is None:
        page = _RUNNING_SAMPLE.sub(rb"\1 %d.0" % running, _FIXTURE)
        page = _METRICS[running] = _WAITING_SAMPLE.sub(rb"\1 0.0", page)
    return page


MODELS: Final = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "fake-model",
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": "fake-model",
                "parent": None,
                "max_model_len": 4096,
            }
        ],
    }
).encode()
PACED_EVENTS: Final = 64  # events of a paced stream whose request sets no max_tokens
_MAX_TOKENS: Final = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_STREAMED: Final = re.compile(rb'"stream"\s*:\s*true')


_EVENT: Final = b"data: " + json.dumps({"choices": [{"delta": {"content": "x" * 1000}}]}).encode()
STREAM: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\n\n\r\n" % (len(_EVENT) + 2, _EVENT) for _ in range(2000))
    + b"0\r\n\r\n"
)
STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\nserver: fleet\r\n\r\n"
)


class Counter:
    """The chat answers the fleet has finished (`GET /fleet/answers`)."""

    answers = 0


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: %d\r\nserver: fleet\r\n\r\n" % len(body)
        + body
    )


def _chat(address: str, marker: str) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-fleet",
            "object": "chat.completion",
            "created": 0,
            "model": "fake-model",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": f"hello from {address}"},
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
            "system_fingerprint": marker,
        }
    ).encode()


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def _sse(delta: dict[str, str], finish: str | None, marker: str) -> bytes:
    """One chat.completion.chunk event, as vLLM writes it."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    event = {
        "id": "chatcmpl-fleet",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake-model",
        "system_fingerprint": marker,
        "choices": [choice],
    }
    return _chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


class _Stream:
    __slots__ = ("engine", "left")

    def __init__(self, engine: Engine, left: int) -> None:
        self.engine, self.left = engine, left  # events still to write


class Pacer:
    """One "paced" engine's decode steps: every `itl_s`, each of its running streams gets its
    next event (see the module's docstring)."""

    def __init__(self, marker: str, ttft_s: float, itl_s: float) -> None:
        self.ttft_s, self._itl_s = ttft_s, itl_s
        self.first = _sse({"role": "assistant", "content": ""}, None, marker)
        self._token = _sse({"content": " tok"}, None, marker)
        self._last = (
            _sse({}, "stop", marker) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )  # [DONE] right after the finish event, as vLLM sends it
        self._running: list[_Stream] = []
        self._next = 0.0
        self._ticking = False

    def start(self, engine: Engine, events: int) -> None:
        """The answer's head now, its first event `ttft_s` later, then one per step."""
        engine.write(STREAM_HEAD)
        asyncio.get_running_loop().call_later(self.ttft_s, self._first, engine, events)

    def _first(self, engine: Engine, events: int) -> None:
        if not engine.write(self.first):
            engine.stream_ended()
            return
        if events <= 1:
            engine.write(self._last)
            engine.stream_done()
            return
        self._running.append(_Stream(engine, events - 1))
        if not self._ticking:
            self._ticking = True
            loop = asyncio.get_running_loop()
            self._next = loop.time() + self._itl_s
            loop.call_at(self._next, self._step)

    def _step(self) -> None:
        running = []
        for stream in self._running:
            if stream.left == 1:
                if stream.engine.write(self._last):
                    stream.engine.stream_done()
                else:
                    stream.engine.stream_ended()
            elif stream.engine.write(self._token):
                stream.left -= 1
                running.append(stream)
            else:
                stream.engine.stream_ended()
        self._running = running
        if not running:
            self._ticking = False
            return
        loop = asyncio.get_running_loop()
        self._next = max(self._next + self._itl_s, loop.time())  # late: no burst of steps
        loop.call_at(self._next, self._step)


def _take_request(buffer: bytes) -> tuple[list[bytes], bytes, bytes] | None:
    """(head lines, body, rest of the buffer) of the first whole request in `buffer` (its
    body with a length or chunked), or None while it is incomplete."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end].split(b"\r\n")
    length, chunked = 0, False
    for line in head[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    at = end + 4
    if not chunked:
        if len(buffer) < at + length:
            return None
        return head, buffer[at : at + length], buffer[at + length :]
    parts: list[bytes] = []
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(buffer[at:line_end].split(b";")[0].strip() or b"0", 16)
        at = line_end + 2
        if size == 0:  # trailers end with an empty line
            while (line_end := buffer.find(b"\r\n", at)) > at:
                at = line_end + 2
            if line_end < 0:
                return None
            return head, b"".join(parts), buffer[line_end + 2 :]
        if len(buffer) < at + size + 2:
            return None
        parts.append(buffer[at : at + size])
        at += size + 2


class Engine(asyncio.Protocol):
    """One connection to one engine."""

    def __init__(
        self, address: str, kind: str, marker: str, pacer: Pacer | None, keep_alive_s: float
    ) -> None:
        self._address, self._marker = address, marker
        self._hang = kind == "hang"
        self._delay = float(kind.split(":", 1)[1]) if kind.startswith("slow:") else 0.0
        self._pacer = pacer
        self._keep_alive_s = keep_alive_s
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._streaming = False  # a paced stream is being written: the next request waits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._transport = None

    def _arm(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        if self._transport is not None:
            self._idle = asyncio.get_running_loop().call_later(
                self._keep_alive_s, self._transport.close
            )

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._serve()

    def _serve(self) -> None:
        while not self._streaming and (request := _take_request(self._buffer)) is not None:
            head, body, self._buffer = request
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if self._hang:
                continue
            method, _, rest = head[0].partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            chat = method == b"POST" and path == b"/v1/chat/completions"
            if chat:
                RUNNING[self._address] = RUNNING.get(self._address, 0) + 1
            if chat and self._pacer is not None and _STREAMED.search(body):
                tokens = _MAX_TOKENS.search(body)
                self._streaming = True
                self._pacer.start(self, int(tokens.group(1)) if tokens else PACED_EVENTS)
                continue
            reply = self._answer(method, path, body)
            if self._delay:
                asyncio.get_running_loop().call_later(self._delay, self._send, reply, chat)
            else:
                self._send(reply, chat)

    def _answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"GET" and path == b"/v1/models":
            return _response(b"200 OK", b"application/json", MODELS)
        if method == b"GET" and path == b"/metrics":
            page = metrics(RUNNING.get(self._address, 0))
            return _response(b"200 OK", b"text/plain; version=0.0.4", page)
        if method == b"GET" and path == b"/health":
            return _response(b"200 OK", b"application/json", b"")
        if method == b"GET" and path == b"/fleet/answers":
            return _response(b"200 OK", b"application/json", b'{"answers":%d}' % Counter.answers)
        if method == b"POST" and path == b"/v1/chat/completions":
            if _STREAMED.search(body):
                return STREAM
            return _response(b"200 OK", b"application/json", _chat(self._address, self._marker))
        return _response(b"404 Not Found", b"application/json", b'{"detail":"Not Found"}')

    def _send(self, reply: bytes, chat: bool) -> None:
        if chat:
            RUNNING[self._address] -= 1
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(reply)
            Counter.answers += chat
            self._arm()

    def write(self, data: bytes) -> bool:
        """Part of a paced stream; False once the connection is gone."""
        if self._transport is None or self._transport.is_closing():
            return False
        self._transport.write(data)
        return True

    def stream_ended(self) -> None:
        """A paced stream ended (its connection gone, or written whole)."""
        RUNNING[self._address] -= 1

    def stream_done(self) -> None:
        """The paced stream's last bytes were written: the next request may be answered."""
        Counter.answers += 1
        self.stream_ended()
        self._streaming = False
        self._arm()
        self._serve()


async def serve(spec: dict[str, object]) -> None:
    loop = asyncio.get_running_loop()
    port = int(str(spec["port"]))
    engines = spec["engines"]
    assert isinstance(engines, dict)
    paced = spec.get("paced") or {}
    assert isinstance(paced, dict)
    ttft_s, itl_s = float(paced.get("ttft_s", 0.02)), float(paced.get("itl_s", 0.005))
    keep_alive_s = float(str(spec.get("keep_alive_s", KEEP_ALIVE_S)))
    servers = []
    for key, kind in engines.items():
        address, _, own = key.partition(":")  # "ADDRESS" or "ADDRESS:PORT"
        marker = f"fake-{address}:{own or port}"
        pacer = Pacer(marker, ttft_s, itl_s) if kind == "paced" else None
        servers.append(
            await loop.create_server(
                partial(Engine, address, kind, marker, pacer, keep_alive_s),
                address,
                int(own or port),
                backlog=1024,
                reuse_address=True,
            )
        )
    print(f"ready {len(servers)}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    spec = json.loads(Path(sys.argv[1]).read_text())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(spec))


if __name__ == "__main__":
    main()
