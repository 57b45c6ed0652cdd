"""A fleet of fake vLLM engines in one process, each on its own loopback address, for the scale
benchmark (bench/bench_scale.py).

    python bench/fleet.py SPEC.json

SPEC.json: {"port": 18800, "engines": {"127.0.10.1": "ok", "127.0.11.1": "hang",
"127.0.12.1": "slow:1.0", ...}}. Every engine listens on its address and `port` and answers
`GET /v1/models` (model `fake-model`), `GET /metrics` (a vLLM page: tests/fixtures) and
`POST /v1/chat/completions` (a small chat.completion):

- "ok": at once;
- "slow:S": after S seconds (a busy engine);
- "hang": never (it accepts the connection and reads the request, then stays silent: a stuck
  node or a partitioned zone, as seen from the router).

A chat request with `"stream": true` is answered with a chunked event stream of 2,000 events
of about 1 KB each, written at once (for slow-reader runs).

Like vLLM (uvicorn), an engine closes a keep-alive connection after 5 s without a request.
The process prints "ready N" once every engine listens, then serves until killed. asyncio
protocols keep its own CPU small next to the router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sys
from functools import partial
from pathlib import Path
from typing import Final

KEEP_ALIVE_S: Final = 5.0  # uvicorn's default timeout_keep_alive, which vLLM keeps
METRICS: Final = (
    Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_metrics.txt"
).read_bytes()
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


_EVENT: Final = b"data: " + json.dumps({"choices": [{"delta": {"content": "x" * 1000}}]}).encode()
STREAM: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\n\n\r\n" % (len(_EVENT) + 2, _EVENT) for _ in range(2000))
    + b"0\r\n\r\n"
)


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: %d\r\nserver: fleet\r\n\r\n" % len(body)
        + body
    )


def _chat(address: str) -> bytes:
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
        }
    ).encode()


class Engine(asyncio.Protocol):
    """One connection to one engine."""

    def __init__(self, address: str, kind: str) -> None:
        self._address = address
        self._hang = kind == "hang"
        self._delay = float(kind.split(":", 1)[1]) if kind.startswith("slow:") else 0.0
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._idle: asyncio.TimerHandle | None = None

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
            self._idle = asyncio.get_running_loop().call_later(KEEP_ALIVE_S, self._transport.close)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end].split(b"\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if self._hang:
                continue
            reply = self._answer(head[0], body)
            if self._delay:
                asyncio.get_running_loop().call_later(self._delay, self._send, reply)
            else:
                self._send(reply)

    def _answer(self, request_line: bytes, body: bytes) -> bytes:
        method, _, rest = request_line.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method == b"GET" and path == b"/v1/models":
            return _response(b"200 OK", b"application/json", MODELS)
        if method == b"GET" and path == b"/metrics":
            return _response(b"200 OK", b"text/plain; version=0.0.4", METRICS)
        if method == b"POST" and path == b"/v1/chat/completions":
            if b'"stream": true' in body or b'"stream":true' in body:
                return STREAM
            return _response(b"200 OK", b"application/json", _chat(self._address))
        return _response(b"404 Not Found", b"application/json", b'{"detail":"Not Found"}')

    def _send(self, reply: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(reply)
            self._arm()


async def serve(spec: dict[str, object]) -> None:
    loop = asyncio.get_running_loop()
    port = int(str(spec["port"]))
    engines = spec["engines"]
    assert isinstance(engines, dict)
    servers = []
    for address, kind in engines.items():
        servers.append(
            await loop.create_server(
                partial(Engine, address, kind), address, port, backlog=1024, reuse_address=True
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
