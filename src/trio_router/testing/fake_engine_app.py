"""The ASGI app of a `FakeEngine` (`fake_engine_app`), and serving it over HTTP/1.1 with
Hypercorn on real TCP (`serve_fake_engine`, `open_fake_engines`).

The app records every request, answers GET /v1/models, /metrics, /health and /version from
the engine, refuses what vLLM's server refuses, and answers the POST endpoints with the
bodies of `fake_replies`, streams one event per HTTP chunk, with the engine's delays, gate
and failures. A client that goes away is counted in `disconnects` and cancels its reply.
"""

from __future__ import annotations

import email.parser
import email.policy
import email.utils
import json
import logging
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from functools import partial
from typing import Any, Final
from urllib.parse import parse_qsl

import hypercorn.config
import hypercorn.trio
import trio

from ..asgi import Message, Receive, Scope, Send, answer_lifespan
from .fake_engine import FakeEngine, SeenRequest
from .fake_kv import open_fake_kv
from .fake_pd import PULL_PATH, FakeKvTransfer
from .fake_replies import (
    POST_HANDLERS,
    SSE_DONE,
    Reply,
    error_body,
    prompt_tokens,
    stored_response,
    transcription,
)

__all__ = [
    "FakeEngineAbort",
    "FakeEngineApp",
    "fake_engine_app",
    "open_fake_engines",
    "serve_fake_engine",
]

_GENERATION: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
_TOKENIZER: Final = frozenset({"/tokenize", "/detokenize"})
_AUDIO: Final = {"/v1/audio/transcriptions": False, "/v1/audio/translations": True}
_STORED: Final = re.compile(r"/v1/responses/([^/]+)(/cancel)?")
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


def _timing_first_token(engine: FakeEngine, path: str, send: Send) -> Send:
    """`send`, counting for a generation request the time to the reply's first body bytes
    into vLLM's TTFT histogram (a request spends no time in this engine's queue)."""
    if path not in _GENERATION:
        return send
    arrived, answering = trio.current_time(), False

    async def timed(message: Message) -> None:
        nonlocal answering
        if not answering and message["type"] == "http.response.body":
            answering = True
            engine.first_tokens += 1
            engine.first_token_seconds += trio.current_time() - arrived
        await send(message)

    return timed


class FakeEngineAbort(Exception):
    """Raised inside the fake engine's app to break off a response mid-body."""


class FakeEngineApp:
    """The ASGI app of one `FakeEngine` (lifespan and HTTP)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self._counter = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        engine = self.engine
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                engine.disconnects += 1
                engine.notify()
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        client = scope.get("client")
        engine.record(
            SeenRequest(
                method=scope["method"],
                path=scope["path"],
                query=dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"))),
                headers=list(scope["headers"]),
                body=bytes(body),
                client=(client[0], client[1]) if client else None,
            )
        )
        inference = scope["path"] in POST_HANDLERS or scope["path"] in _AUDIO
        finished = False  # the last body message was handed to the server
        send = _timing_first_token(engine, scope["path"], send)

        async def tracked_send(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
                # Hypercorn's trio worker closes a connection whose client went away with
                # send_eof() outside its send lock; if that races the final (empty) write of a
                # finished reply, the write fails with BusyResourceError. The client has its
                # answer, so that is not an error of this engine.
                with suppress(trio.BusyResourceError):
                    await send(message)
                return
            await send(message)

        async def watch_disconnect(scope: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:  # the server also reports the end of a finished exchange
                engine.disconnects += 1
                scope.cancel(reason="client disconnected")

        if inference:
            engine.in_flight += 1
            engine.max_in_flight = max(engine.max_in_flight, engine.in_flight)
        aborted = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, nursery.cancel_scope)
                aborted = await self._answer(scope, bytes(body), tracked_send)
                nursery.cancel_scope.cancel(reason="reply sent")
        finally:
            if inference:
                engine.in_flight -= 1
                if finished and not aborted:
                    engine.completed += 1
            engine.notify()
        if aborted:
            raise FakeEngineAbort(f"{engine.name}: stream broken off on purpose")

    # -- dispatch ----------------------------------------------------------------------------
    async def _answer(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Send the whole reply; True if a stream was broken off on purpose."""
        engine = self.engine
        method, path = scope["method"], scope["path"]
        if engine.fail_status is not None:
            await self._send_json(
                send,
                engine.fail_status,
                error_body(engine.fail_status, f"{engine.name} is failing"),
            )
            return False
        if method == "GET" and path in ("/v1/models", "/metrics", "/health", "/version"):
            await self._answer_get(path, send)
            return False
        if engine.pd is not None and method == "POST" and path == PULL_PATH:
            given = engine.pd.give(json.loads(body))
            await self._send_json(send, 200 if given else 404, {"given": given})
            return False
        reply: Reply | None = None
        if (stored := _STORED.fullmatch(path)) is not None:
            cancel = stored.group(2) is not None
            if method != ("POST" if cancel else "GET"):
                reply = Reply(405, {"detail": "Method Not Allowed"})
            else:
                reply = stored_response(engine, stored.group(1), cancel=cancel)
        elif path in _AUDIO and method == "POST":
            if (status := engine.inference_fail_status) is not None:
                reply = Reply(status, error_body(status, _refusal_message(engine)))
            else:
                reply = self._audio(scope, body, translate=_AUDIO[path])
        else:
            reply = self._refusal(method, path, body)
        if reply is None:
            request = json.loads(body)
            model = request.get("model") or (engine.models[0] if engine.models else "")
            self._counter += 1
            rid = f"{self._counter:08x}"
            if engine.pd is not None and path in _GENERATION:
                return await self._kv_transfer(engine.pd, scope, send, request, str(model), rid)
            reply = POST_HANDLERS[path](engine, request, str(model), rid)
        if reply.events is None:
            await self._delay_whole_reply(
                reply, gated=engine.gate_tokenizer or path not in _TOKENIZER
            )
            if engine.break_whole_replies and reply.status == 200:
                return await self._send_half(send, reply.payload)
            await self._send_json(send, reply.status, reply.payload)
            return False
        return await self._stream(send, reply.events)

    async def _send_half(self, send: Send, payload: Any) -> bool:
        """The head of a whole reply and half its body: the caller then breaks it off."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = [(b"content-length", b"%d" % len(body)), *self._common_headers()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
        )
        return True

    async def _kv_transfer(
        self,
        pd: FakeKvTransfer,
        scope: Scope,
        send: Send,
        request: dict[str, Any],
        model: str,
        rid: str,
    ) -> bool:
        """A generation request to an engine with a KV connector (see `fake_pd`)."""
        engine, path = self.engine, scope["path"]
        if (why := pd.refusal(request)) is not None:
            await self._send_json(send, 400, error_body(400, why, param="kv_transfer_params"))
            return False
        if pd.is_prefill_step(request):
            # The engine's own id for the request (vLLM's too is unique even when two
            # clients send the same X-Request-Id), derived from the client's.
            client_id = dict(scope["headers"]).get(b"x-request-id", b"req").decode()
            request_id = f"{client_id}-{rid}"
            with pd.computing(request_id, len(prompt_tokens(request))) as blocks:
                reply = POST_HANDLERS[path](engine, request, model, rid)
                await self._delay_whole_reply(reply)
            params = pd.answer_params(request_id, blocks, ok=reply.status == 200)
            if params is not None:
                reply.payload["kv_transfer_params"] = params
            await self._send_json(send, reply.status, reply.payload)
            return False
        if pd.is_decode_step(request):
            if (failure := await pd.pull(request)) is not None:
                pd.refused.append(failure)
                await self._send_json(send, 500, error_body(500, failure))
                return False
        else:
            pd.recomputed += 1
        reply = POST_HANDLERS[path](engine, request, model, rid)
        if reply.events is None:
            await self._delay_whole_reply(reply)
            await self._send_json(send, reply.status, reply.payload)
            return False
        return await self._stream(send, reply.events)

    async def _answer_get(self, path: str, send: Send) -> None:
        engine = self.engine
        if path == "/v1/models":
            if engine.hang_models:
                await trio.sleep_forever()
            await self._send_json(send, 200, engine.models_payload())
        elif path == "/metrics":
            await self._send_bytes(
                send,
                200,
                engine.metrics_text().encode(),
                b"text/plain; version=0.0.4; charset=utf-8",
            )
        elif path == "/health":
            await self._send_bytes(send, 200, b"", None)
        else:
            await self._send_json(send, 200, {"version": "0.0.0-fake"})

    def _audio(self, scope: Scope, body: bytes, *, translate: bool) -> Reply:
        """An audio upload: its multipart form read with the standard library's MIME parser
        (not the router's), the fields kept in `forms`."""
        engine = self.engine
        content_type = dict(scope["headers"]).get(b"content-type", b"")
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type + b"\r\n\r\n" + body
        )
        if not message.is_multipart():
            return Reply(400, error_body(400, "expected a multipart/form-data body"))
        fields: dict[str, str] = {}
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if isinstance(name, str) and part.get_filename() is None:
                payload = part.get_payload(decode=True)
                fields[name] = payload.decode() if isinstance(payload, bytes) else ""
        engine.forms.append(fields)
        model = fields.get("model", "")
        if model not in engine.model_ids:
            message_text = f"The model `{model}` does not exist."
            return Reply(404, error_body(404, message_text, param="model"))
        self._counter += 1
        return transcription(engine, fields, model, f"{self._counter:08x}", translate=translate)

    def _refusal(self, method: str, path: str, body: bytes) -> Reply | None:
        """The error reply to a request the engine refuses (as vLLM's server would), or None
        when it is answered."""
        engine = self.engine
        if path not in POST_HANDLERS:
            return Reply(404, {"detail": "Not Found"})
        if method != "POST":
            return Reply(405, {"detail": "Method Not Allowed"})
        if (status := engine.inference_fail_status) is not None:
            return Reply(status, error_body(status, _refusal_message(engine)))
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return Reply(400, error_body(400, f"invalid JSON body: {exc}"))
        model = request.get("model")
        if model is not None and model not in engine.model_ids:
            message = (
                f"The model `{model}` does not exist. Valid aliases: {', '.join(engine.model_ids)}."
            )
            return Reply(404, error_body(404, message, param="model"))
        limit = request.get("max_completion_tokens", request.get("max_tokens"))
        if isinstance(limit, int) and limit > engine.max_model_len:
            # vLLM's answer, as JSON also to a request for a stream.
            message = (
                f"max_tokens={limit} cannot be greater than max_model_len="
                f"{engine.max_model_len}. Please request fewer output tokens. "
                f"(parameter=max_tokens, value={limit})"
            )
            return Reply(400, error_body(400, message, param="max_tokens"))
        return None

    async def _delay_whole_reply(self, reply: Reply, *, gated: bool = True) -> None:
        """A whole reply's delays: the engine's TTFT (and a generation's inter-token delays,
        added up), then its gate if `gated`."""
        engine = self.engine
        delay = engine.ttft_s
        if isinstance(reply.payload, dict) and reply.payload.get("object") in (
            "chat.completion",
            "text_completion",
            "response",
        ):
            delay += engine.inter_token_s * max(0, engine.tokens - 1)
        if delay > 0:
            await trio.sleep(delay)
        if gated and engine.gate is not None:
            await engine.gate.wait()

    async def _stream(self, send: Send, events: list[bytes]) -> bool:
        engine = self.engine
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_SSE_HEADERS, *self._common_headers()],
            }
        )
        if engine.ttft_s > 0:
            await trio.sleep(engine.ttft_s)
        for i, event in enumerate(events):
            if i == engine.break_after_events:
                return True
            if i == engine.break_inside_event:
                half = {"type": "http.response.body", "body": event[: len(event) // 2]}
                await send({**half, "more_body": True})
                return True
            if i == engine.stall_after_events:
                await trio.sleep_forever()
            if i == 1:
                if engine.abort_after_first_event:
                    return True
                if engine.gate is not None:
                    await engine.gate.wait()
            if i > 0 and engine.inter_token_s > 0 and event is not SSE_DONE:
                await trio.sleep(engine.inter_token_s)
            if pause := engine.pauses.get(i):
                await trio.sleep(pause)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        if engine.break_after_events == len(events):  # the body's last chunk lost
            return True
        if engine.end_gate is not None:
            await engine.end_gate.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return False

    def _common_headers(self) -> list[tuple[bytes, bytes]]:
        engine = self.engine
        headers = [(b"x-fake-engine", engine.name.encode()), *engine.extra_headers]
        if engine.send_date and not any(name == b"date" for name, _ in engine.extra_headers):
            headers.append((b"date", email.utils.formatdate(usegmt=True).encode()))
        return headers

    async def _send_json(self, send: Send, status: int, payload: Any) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        await self._send_bytes(send, status, body, b"application/json")

    async def _send_bytes(
        self, send: Send, status: int, body: bytes, content_type: bytes | None
    ) -> None:
        headers = [(b"content-length", b"%d" % len(body)), *self._common_headers()]
        if content_type is not None:
            headers.append((b"content-type", content_type))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def fake_engine_app(engine: FakeEngine) -> FakeEngineApp:
    """The ASGI app serving `engine`."""
    return FakeEngineApp(engine)


def _hypercorn_config(host: str, port: int) -> hypercorn.config.Config:
    config = hypercorn.config.Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(f"{__name__}.hypercorn")  # quiet unless configured
    config.graceful_timeout = 0.5
    config.backlog = 2048  # like vLLM's uvicorn
    config.keep_alive_max_requests = 1 << 30  # like vLLM's uvicorn: no per-connection cap
    config.include_date_header = False  # the app sends its own Date (FakeEngine.send_date)
    return config


async def serve_fake_engine(
    engine: FakeEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `engine` over HTTP/1.1 with Hypercorn until cancelled.

    Reports the bound URL (like "http://127.0.1.3:40123") through `task_status`, so
    `url = await nursery.start(serve_fake_engine, engine)` returns once it accepts
    connections. Cancellation closes the listener and every connection.
    """
    app: Any = fake_engine_app(engine)  # plain-dict ASGI typing, not hypercorn's TypedDicts
    async with AsyncExitStack() as stack:
        if engine.kv is not None and engine.kv.port:
            await stack.enter_async_context(
                open_fake_kv(engine.kv, host, engine.kv.port, replay_port=engine.kv.replay_port)
            )
        nursery = await stack.enter_async_context(trio.open_nursery())
        urls: list[str] = await nursery.start(
            partial(
                hypercorn.trio.serve,
                app,
                _hypercorn_config(host, port),
                shutdown_trigger=trio.sleep_forever,
            )
        )
        if engine.pd is not None:  # where decode engines read this engine's blocks
            engine.pd.host, _, bound = urls[0].removeprefix("http://").rpartition(":")
            engine.pd.port = int(bound)
        task_status.started(urls[0])


@asynccontextmanager
async def open_fake_engines(
    engines: Sequence[FakeEngine], *, hosts: Iterable[str] | None = None, port: int = 0
) -> AsyncIterator[list[str]]:
    """Serve several fake engines, by default on 127.0.1.1, 127.0.1.2, ..., each on `port`
    (0: an ephemeral one), and yield their URLs in order. Leaving the block stops them all."""
    host_list = (
        list(hosts) if hosts is not None else [f"127.0.1.{i + 1}" for i in range(len(engines))]
    )
    if len(host_list) < len(engines):
        raise ValueError(f"{len(engines)} engines but only {len(host_list)} hosts")
    async with trio.open_nursery() as nursery:
        urls = [
            await nursery.start(serve_fake_engine, engine, host, port)
            for engine, host in zip(engines, host_list, strict=False)
        ]
        yield urls
        nursery.cancel_scope.cancel(reason="fake engines closed")


def _refusal_message(engine: FakeEngine) -> str:
    """What an engine told to fail its inference requests says."""
    return engine.fail_message or f"{engine.name} refuses"
