"""Chat answers carried on through the engine's own parsers: a stream whose reasoning or tool
calls a text completion could not carry on (`resume.Track.mode == "parsed"`).

The model's reasoning and tool parsers turn token ids into `delta.reasoning`, `delta.content`
and `delta.tool_calls`; their state is the whole answer so far, which a text completion's
prompt cannot hand them. vLLM's scale-out endpoints (`--enable-scale-out`) can, and the
continuation goes through three of them at the engine that carries it on:

1. `/v1/chat/completions/render`: the original chat request (the attempt's own request, its
   answer read whole here) gives its prompt's token ids and its sampling parameters resolved
   as the engine resolves them (the model's defaults included);
2. `/inference/v1/generate`: those token ids and the answer's so far, the same sampling
   parameters, the token limits reduced by what was generated; its events carry token ids;
3. `/v1/chat/completions/derender`, once for each read of those events (every event that
   arrived while the previous call was out: the calls pace themselves), with a `stream_state`
   the router carries: built first from what passed to the client (every token id, how many
   each event had, the ids of the tool calls the client has), then the one derender returns.
   Derender replays that state through fresh parsers and answers the read's tokens as one
   chat chunk, parsed as the engine would have parsed them; the tool calls the client already
   has keep their ids, later ones get fresh ids from the engine.

The chunks are written in the original's shape (its id, created and model), with one usage
object (the original prompt, every completion token) when the client asked for it, and one
[DONE]. A derender call costs in proportion to the answer's length (it replays every earlier
chunk), so none is made on a healthy stream: only for a continuation, and only for one that
needs the parsers. An engine without the scale-out endpoints fails the continuation like a
broken one (another engine may carry it on; else the client's stream ends with an error event).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import trio

from ...http import (
    EngineStalledError,
    EngineUnreachableError,
    MalformedResponseError,
    UpstreamResponse,
    fetch,
    read_whole,
)
from ...table import Engine
from ..prepared import Prepared
from ..runtime import Runtime
from .request import parsing_request, token_limit
from .track import StreamAbortedError, Track

__all__ = ["carry_on_parsed"]

logger = logging.getLogger(__name__)

_GENERATE: Final = b"/inference/v1/generate"
_DERENDER: Final = b"/v1/chat/completions/derender"
_JSON: Final = [(b"content-type", b"application/json")]
MAX_PARSED_BYTES: Final = 16 * 1024 * 1024  # a render's or a derender's answer, read whole
_encode = msgspec.json.encode
Write = Callable[[bytes], Awaitable[None]]  # bytes into the client's answer


def _read(body: bytes, what: str) -> dict[str, Any]:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise MalformedResponseError(f"{what} is not a JSON object: {body[:200]!r}")
    return decoded


def _generate_body(rendered: dict[str, Any], payload: dict[str, Any], track: Track) -> bytes:
    """The generate request that goes on after `track`'s tokens: the rendered request's
    prompt and the answer's tokens so far, its sampling parameters with the token limits
    reduced."""
    done = track.generated_ids()
    params = dict(rendered.get("sampling_params") or {})
    limit = params.get("max_tokens")
    if type(limit) is not int:
        limit = token_limit(payload)
    if type(limit) is int:
        params["max_tokens"] = max(1, limit - len(done))
    if type(least := params.get("min_tokens")) is int:
        params["min_tokens"] = max(0, least - len(done))
    body = {**rendered, "token_ids": [*rendered["token_ids"], *done]}
    body |= {"sampling_params": params, "stream": True, "stream_options": None}
    body.pop("request_id", None)
    return _encode(body)


class _Derender:
    """One continuation's derender calls (see the module's docstring)."""

    def __init__(self, rt: Runtime, engine: Engine, prepared: Prepared, track: Track) -> None:
        self._rt, self._engine, self._track = rt, engine, track
        prompt = track.prompt_ids()
        self._base = {
            "stream": True,
            "model": prepared.model,
            "prompt_token_ids": prompt,
            "prompt_tokens": len(prompt),
            "chat_request": parsing_request(prepared.payload),
        }
        parts = track.generated_parts()
        self._state: dict[str, Any] = {
            "output_token_ids": [token for part in parts for token in part],
            "output_chunk_lens": [len(part) for part in parts if part],
            "role_sent": True,
            "tools_streamed": bool(track.tool_ids),
            "last_tool_call_ids": list(track.tool_ids),
        }

    async def chunk(self, ids: list[int], reason: str | None, stop: Any) -> dict[str, Any]:
        """The chat chunk of `ids` (the read's tokens) and the finish, if it is the last."""
        choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": reason}
        if reason is not None:
            choice["stop_reason"] = stop
        generate = {"request_id": "continuation", "choices": [choice]}
        request = {**self._base, "generate_chunk": generate, "stream_state": self._state}
        engine = self._engine
        assert self._rt.resume is not None
        with trio.move_on_after(self._rt.resume.stall.ceiling_s) as waited:
            status, body = await fetch(
                self._rt.pool,
                engine.url,
                _DERENDER,
                _JSON,
                max_bytes=MAX_PARSED_BYTES,
                method=b"POST",
                body=_encode(request),
            )
        if waited.cancelled_caught:
            raise EngineStalledError(f"engine {engine.name} did not answer its derender")
        if status != 200:
            raise StreamAbortedError(
                f"engine {engine.name} answered its derender with {status}: {body[:200]!r}"
            )
        answer = _read(body, f"engine {engine.name}'s derender")
        state, chunk = answer.get("stream_state"), answer.get("chunk")
        if not isinstance(state, dict) or not isinstance(chunk, dict):
            raise MalformedResponseError(f"engine {engine.name}'s derender: {body[:200]!r}")
        self._state = state
        return chunk


async def carry_on_parsed(
    response: UpstreamResponse,
    engine: Engine,
    write: Write,
    rt: Runtime,
    prepared: Prepared,
    track: Track,
    streaming: Callable[[UpstreamResponse], None] | None = None,
) -> bytes:
    """The continuation at `engine`, whose answer to the render request is `response`,
    written into the client's answer by `write` (left open: `Deliver` ends it); returns the
    last bytes written (the usage object is there when asked for). `streaming` hears of the
    generate stream once it has begun (a handover breaks that one off). Raises
    `StreamAbortedError` (or another TransportError) when the engine fails it."""
    what = f"engine {engine.name}'s render"
    rendered = _read(await read_whole(response, MAX_PARSED_BYTES, what), what)
    if response.status != 200 or not isinstance(rendered.get("token_ids"), list):
        raise StreamAbortedError(
            f"engine {engine.name} cannot carry on a parsed answer (render answered "
            f"{response.status}; it needs vLLM's --enable-scale-out)"
        )
    body = _generate_body(rendered, prepared.payload, track)
    derender = _Derender(rt, engine, prepared, track)
    try:
        async with rt.pool.request(engine.url, b"POST", _GENERATE, _JSON, body) as generated:
            if generated.status != 200:
                raise StreamAbortedError(
                    f"engine {engine.name} answered the continuation with {generated.status}"
                )
            assert rt.resume is not None
            generated.stall = rt.resume.stall
            if streaming is not None:
                streaming(generated)
            return await _pump(generated, derender, write, track)
    except EngineUnreachableError as exc:  # the engine has gone since the render
        raise StreamAbortedError(str(exc)) from exc


async def _pump(
    generated: UpstreamResponse, derender: _Derender, write: Write, track: Track
) -> bytes:
    """Each read of the generate events: its tokens derendered as one chunk and written."""
    partial = b""
    async for data in generated:
        *events, partial = (partial + data).split(b"\n\n")
        if len(partial) > MAX_PARSED_BYTES:
            raise MalformedResponseError("a generate event longer than the router reads")
        ids, reason, stop = _tokens(events, track)
        if ids or reason is not None:
            shown = ids
            if reason == "stop" and ids and (stop is None or type(stop) is int):
                shown = ids[:-1]  # the end-of-answer token: counted, never shown as text
            chunk = await derender.chunk(shown, reason, stop)
            if event := track.parsed_chunk(chunk, ids, reason):
                await write(event)
        if reason is not None:
            ending = track.ending()
            await write(ending)
            return ending
    raise StreamAbortedError("the engine ended the continuation before its answer was complete")


def _tokens(events: list[bytes], track: Track) -> tuple[list[int], str | None, Any]:
    """The token ids of a read's generate events, and its finish (reason, stop reason)."""
    ids: list[int] = []
    reason: str | None = None
    stop: Any = None
    for event in events:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        decoded = _read(event[6:], "a generate event")
        if "error" in decoded:
            raise StreamAbortedError(f"the continuation failed: {decoded['error']!r}")
        for choice in decoded.get("choices") or ():
            ids += choice.get("token_ids") or ()
            if (finished := choice.get("finish_reason")) is not None:
                reason, stop = finished, choice.get("stop_reason")
    if reason == "abort":
        raise StreamAbortedError("the engine aborted the continuation")
    return ids, reason, stop
