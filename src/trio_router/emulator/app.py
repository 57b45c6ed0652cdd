"""The HTTP surface of an emulated engine, as vLLM 0.32's OpenAI server shows it to routers
and dashboards: an ASGI app (`EngineApp`) and serving it (`serve_engine`, over the lean HTTP/1.1
server of `http_server`).

GET /health (200, empty), /v1/models (the served model, then its LoRA adapters), /version,
/metrics; POST /v1/chat/completions and /v1/completions (a JSON body, or server-sent events,
one per HTTP chunk, ending with `data: [DONE]`), /tokenize (`prompt` or `messages`),
/detokenize and /reset_prefix_cache (vLLM serves it in its development mode); with runtime
LoRA updating (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's plain-text answer, or its error). Errors are vLLM's JSON
bodies, also for a request that asked for a stream. A client that goes away aborts its
request at once (its blocks are freed, and no success is counted). With KV-cache events
configured, `serve_engine` publishes them (`kv_publisher`) for as long as the engine runs.
An injected fault (`faults`) holds every request unanswered (hang) or answers it with 500
or 503.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Final

import trio
import zmq

from ..asgi import Receive, Scope, Send, answer_lifespan
from ..testing.fake_engine import model_permission
from .engine import EmulatedEngine, Generation
from .http_server import DIRECT_WRITE, serve_asgi
from .kv_events import KvEndpoints
from .kv_publisher import open_kv_publisher
from .lora import LoraError
from .openai_api import (
    Answer,
    Refusal,
    check_model,
    error_body,
    prepare_generation,
    prompt_of,
)

__all__ = ["EngineApp", "serve_engine"]

VLLM_VERSION: Final = "0.32.0"
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_JSON: Final = b"application/json"
_GENERATION: Final = {"/v1/chat/completions": True, "/v1/completions": False}
_POSTS: Final = frozenset({*_GENERATION, "/tokenize", "/detokenize", "/reset_prefix_cache"})
_GETS: Final = frozenset({"/health", "/v1/models", "/version", "/metrics"})
_LORA_POSTS: Final = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


async def _send_bytes(send: Send, status: int, body: bytes, content_type: bytes | None) -> None:
    headers = [(b"content-length", b"%d" % len(body))]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send_bytes(send, status, json.dumps(payload, separators=(",", ":")).encode(), _JSON)


class EngineApp:
    """The ASGI app of one `EmulatedEngine` (lifespan and HTTP)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        runtime_lora = engine.config.lora.allow_runtime_updating
        self._posts = _POSTS | _LORA_POSTS if runtime_lora else _POSTS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        method, path = scope["method"], scope["path"]
        faults = self.engine.faults
        await faults.wait_answering()  # hung: the request is read, and left unanswered
        if faults.error_status:
            status = faults.error_status
            reason = f"the engine is failing (injected fault: {status})"
            await _send_json(send, status, error_body(status, reason))
            return
        if method == "GET" and path in _GETS:
            await self._get(path, send)
        elif path in _GETS or path in self._posts:
            if method != "POST" or path in _GETS:
                await _send_json(send, 405, {"detail": "Method Not Allowed"})
            elif path in _LORA_POSTS:
                await self._lora(path, scope, bytes(body), send)
            else:
                extensions = scope.get("extensions") or {}
                await self._post(path, bytes(body), receive, send, extensions)
        else:
            await _send_json(send, 404, {"detail": "Not Found"})

    async def _get(self, path: str, send: Send) -> None:
        engine = self.engine
        if path == "/health":
            await _send_bytes(send, 200, b"", None)
        elif path == "/version":
            await _send_json(send, 200, {"version": VLLM_VERSION})
        elif path == "/metrics":
            text = engine.metrics_text().encode()
            await _send_bytes(send, 200, text, b"text/plain; version=0.0.4; charset=utf-8")
        else:
            await _send_json(send, 200, self._models())

    def _models(self) -> dict[str, Any]:
        config, created = self.engine.config, int(time.time())
        name = config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [model_permission(f"modelperm-{name}", created)],
        }
        adapters = self.engine.loras.cards(
            created, lambda: model_permission(f"modelperm-{uuid.uuid4().hex}", created)
        )
        return {"object": "list", "data": [card, *adapters]}

    async def _lora(self, path: str, scope: Scope, raw: bytes, send: Send) -> None:
        """POST /v1/load_lora_adapter or /v1/unload_lora_adapter: vLLM's answer."""
        loading = path == "/v1/load_lora_adapter"
        body = _lora_body(scope, raw, ("lora_name", "lora_path") if loading else ("lora_name",))
        answer: str | LoraError
        if isinstance(body, LoraError):
            answer = body
        elif loading:
            inplace = body.get("load_inplace") is True
            answer = self.engine.loras.load(
                body["lora_name"], body["lora_path"], load_inplace=inplace
            )
        else:
            answer = self.engine.loras.unload(body["lora_name"])
        if isinstance(answer, LoraError):
            error = {"message": answer.message, "type": answer.type, "param": answer.param}
            await _send_json(send, answer.status, {"error": {**error, "code": answer.status}})
        else:
            await _send_bytes(send, 200, answer.encode(), None)  # vLLM's: no content type

    async def _post(
        self, path: str, raw: bytes, receive: Receive, send: Send, extensions: dict[str, Any]
    ) -> None:
        if path == "/reset_prefix_cache":  # no body: vLLM's takes query parameters only
            await _send_json(send, 200, {"success": self.engine.reset_prefix_cache()})
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            await _send_json(send, 400, error_body(400, f"invalid JSON body: {exc}"))
            return
        if path == "/tokenize":
            await self._tokenize(body, send)
        elif path == "/detokenize":
            await self._detokenize(body, send)
        else:
            chat = _GENERATION[path]
            await self._generate(body, receive, send, chat=chat, extensions=extensions)

    async def _tokenize(self, body: dict[str, Any], send: Send) -> None:
        engine = self.engine
        if isinstance(refused := check_model(body, engine.config, engine.loras), Refusal):
            await _send_json(send, refused.status, refused.body)
            return
        ids = prompt_of(body, engine.vocab, chat="messages" in body)
        if isinstance(ids, Refusal):
            await _send_json(send, ids.status, ids.body)
            return
        strs = [engine.vocab.token_str(t) for t in ids] if body.get("return_token_strs") else None
        answer = {
            "count": len(ids),
            "max_model_len": engine.config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        await _send_json(send, 200, answer)

    async def _detokenize(self, body: dict[str, Any], send: Send) -> None:
        engine = self.engine
        if isinstance(refused := check_model(body, engine.config, engine.loras), Refusal):
            await _send_json(send, refused.status, refused.body)
            return
        tokens = body.get("tokens")
        size = engine.vocab.vocab_size
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < size for t in tokens
        ):
            message = f"`tokens` must be a list of token ids in 0..{size - 1}"
            await _send_json(send, 400, error_body(400, message, param="tokens"))
            return
        await _send_json(send, 200, {"prompt": engine.vocab.decode(tokens)})

    async def _generate(
        self,
        body: dict[str, Any],
        receive: Receive,
        send: Send,
        *,
        chat: bool,
        extensions: dict[str, Any],
    ) -> None:
        """Run a generation request; its client going away aborts it. A stream's tokens go
        straight to its connection as the engine hands them out, when its server offers
        that (`http_server.DIRECT_WRITE`) and the connection takes them."""
        engine = self.engine
        prepared = prepare_generation(body, engine.config, engine.vocab, engine.loras, chat=chat)
        if isinstance(prepared, Refusal):
            await _send_json(send, prepared.status, prepared.body)
            return
        generation = engine.submit(prepared.prompt, prepared.params, prepared.lora)
        answer = Answer(prepared, engine.vocab)
        reply = self._stream if prepared.stream else self._whole
        if prepared.stream and (direct := extensions.get(DIRECT_WRITE)) is not None:
            generation.take_now = partial(_write_now, direct, answer)
        try:
            with engine.answering():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
                    await reply(generation, answer, send)
                    nursery.cancel_scope.cancel(reason="answered")
        finally:
            engine.abort(generation)  # nothing if it finished; else its client went away

    @staticmethod
    async def _whole(generation: Generation, answer: Answer, send: Send) -> None:
        tokens: list[int] = []
        while True:
            new, finish = await generation.wait()
            tokens += new
            if finish is not None:
                await _send_json(send, 200, answer.whole(tokens, finish.value))
                return

    @staticmethod
    async def _stream(generation: Generation, answer: Answer, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        # The head goes out at once, as from vLLM's server; a chat's role event only with the
        # first token, as vLLM's chat stream writes it on its first output.
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        chunk = partial(send_chunk, send)
        first = answer.first_event()
        while True:
            new, finish = await generation.wait()
            if first is not None:
                await chunk(first)
                first = None
            reason = None if finish is None else finish.value
            await chunk(answer.chunk(new, reason))
            answer.opened = True  # later tokens may take the fast path
            if finish is not None:
                break
        if answer.prepared.include_usage:
            await chunk(answer.usage_event())
        await chunk(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _lora_body(scope: Scope, raw: bytes, required: tuple[str, ...]) -> dict[str, Any] | LoraError:
    """A load or unload request's body, or vLLM's validation error: the content type must be
    JSON, the body an object with each `required` field a string."""
    headers = dict(scope.get("headers") or [])
    media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    if media_type != b"application/json":
        message = "Unsupported Media Type: Only 'application/json' is allowed"
        return LoraError(400, "Bad Request", f"1 validation error:\n  {message}")
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return LoraError(400, "Bad Request", "1 validation error:\n  JSON object expected", "body")
    if missing := [key for key in required if not isinstance(body.get(key), str)]:
        where = [f"body.{key}" for key in missing]
        errors = "".join(f"\n  {{'loc': '{w}', 'msg': 'Field required'}}" for w in where)
        count = f"{len(missing)} validation error{'s' if len(missing) > 1 else ''}:"
        return LoraError(400, "Bad Request", count + errors, where[0])
    return body


def _write_now(direct: Any, answer: Answer, tokens: list[int]) -> bool:
    """A stream's fast path (`Generation.take_now`): its event written at once, if its
    connection can take it and its first token (with a chat's role event before it) went
    the slow way."""
    if not (answer.opened and direct.ready_now()):
        return False
    direct.write_now(answer.chunk(tokens, None))
    return True


async def send_chunk(send: Send, data: bytes) -> None:
    """One HTTP chunk of a stream."""
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel `scope` when the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel(reason="client disconnected")


async def serve_engine(
    engine: EmulatedEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    kv_endpoints: KvEndpoints | None = None,
    zmq_context: zmq.Context[zmq.Socket[bytes]] | None = None,
    listening: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `engine` and serve it over HTTP/1.1 (`http_server`) until cancelled. Reports the
    bound URL ("http://127.0.1.3:8000") once it accepts connections; cancellation stops the engine,
    closes the listener and every connection. With KV-cache events in its config, they are
    published at `kv_endpoints` (by default the config's endpoints as given) on sockets of
    `zmq_context` (a fleet shares one; by default one of its own, closed with it); an
    endpoint that cannot be bound raises OSError. Its HTTP listeners are added to
    `listening`, if given (`http_server.serve_asgi`)."""
    app: Any = EngineApp(engine)  # plain-dict ASGI typing, not hypercorn's TypedDicts
    async with AsyncExitStack() as stack:
        publish = None
        if (kv_config := engine.config.kv_events).enabled:
            if zmq_context is None:
                zmq_context = zmq.Context()
                stack.callback(zmq_context.destroy, linger=0)
            where = kv_endpoints or kv_config.endpoints()
            kv = await stack.enter_async_context(open_kv_publisher(kv_config, where, zmq_context))
            publish = kv.publish
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(engine.run, publish=publish))
            url = await nursery.start(partial(serve_asgi, listening=listening), app, host, port)
            task_status.started(url)
