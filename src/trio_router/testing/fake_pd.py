"""vLLM's KV-transfer protocol (NixlConnector) in the fake engine, spoken strictly.

A `FakeKvTransfer` on a `FakeEngine` makes it a prefill engine, a decode engine, or both:

- **Prefill step** (a request with `kv_transfer_params.do_remote_decode` true): refused with
  400, as a strict engine would, unless it is capped at one token (`max_tokens`, and
  `max_completion_tokens` when present), not streamed (`stream` false, no `stream_options`)
  and without `min_tokens` above 1. The engine then "computes" the prompt's blocks, holds them
  for the decode engine for `hold_s` (vLLM's lease) and answers a one-token completion whose
  JSON carries `kv_transfer_params` (`do_remote_prefill`, `remote_engine_id`,
  `remote_block_ids`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size`, and a
  field of its own that a router must pass on untouched). A client that goes away during the
  step frees the blocks at once (vLLM aborts the request). With `return_params` false it
  answers like a prefill that ended on its own: no parameters.
- **Decode step** (`kv_transfer_params.do_remote_prefill` true): the engine pulls the blocks
  from the prefill engine named in the parameters (an HTTP request to its `remote_host` and
  `remote_port`, spoken with h11, standing in for the NIXL read), which frees them;
  parameters a prefill engine did not give (another engine id, other blocks, a missing
  field, the private field changed) fail the request with 500, as the real transfer fails.
  A request without parameters is prefilled by the decode engine itself and counted in
  `recomputed`.

A prefill-only engine refuses whole requests (400): every request it gets must be a prefill
step. Observations (`prefills`, `pulled`, `recomputed`, `refused`, `held_blocks()`) let a
test check that nothing was left held and nothing recomputed by mistake.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import h11
import trio

__all__ = ["PULL_PATH", "FakeKvTransfer"]

PULL_PATH: Final = "/_fake/kv/pull"  # where a decode engine reads a prefill engine's blocks
PULL_DEADLINE_S: Final = 5.0  # for one read of a prefill engine's blocks
ROLES: Final = ("prefill", "decode", "both")


@dataclass
class _Held:
    blocks: list[int]
    expires: float  # trio time; inf while the prefill is still running


@dataclass
class FakeKvTransfer:
    """See the module's docstring."""

    role: str  # "prefill", "decode" or "both"
    block_size: int = 16
    hold_s: float = 30.0  # how long computed blocks wait for their decode engine
    return_params: bool = True  # False: the prefill answers without kv_transfer_params
    engine_id: str = field(default_factory=lambda: f"fake-{secrets.token_hex(4)}")
    host: str = ""  # where decode engines reach this engine (set when it is served)
    port: int = 0
    # observations
    prefills: int = 0  # prefill steps answered with parameters
    pulled: int = 0  # decode requests served with a prefill engine's blocks
    recomputed: int = 0  # generation requests this engine prefilled itself
    refused: list[str] = field(default_factory=list)  # why requests were refused
    _held: dict[str, _Held] = field(default_factory=dict)
    _next_block: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    # -- what the engine checks -------------------------------------------------------------
    @staticmethod
    def params(request: dict[str, Any]) -> dict[str, Any] | None:
        params = request.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    def is_prefill_step(self, request: dict[str, Any]) -> bool:
        params = self.params(request)
        return params is not None and params.get("do_remote_decode") is True

    def is_decode_step(self, request: dict[str, Any]) -> bool:
        params = self.params(request)
        return params is not None and params.get("do_remote_prefill") is True

    def refusal(self, request: dict[str, Any]) -> str | None:
        """Why this engine refuses `request` (a 400), or None."""
        why = None
        if self.is_prefill_step(request):
            if self.role == "decode":
                why = "a decode engine does not take prefill steps"
            elif request.get("stream") is not False:
                why = "a prefill step must have stream: false"
            elif "stream_options" in request:
                why = "a prefill step must not have stream_options"
            elif request.get("max_tokens") != 1:
                why = "a prefill step must have max_tokens: 1"
            elif request.get("max_completion_tokens", 1) != 1:
                why = "a prefill step must have max_completion_tokens: 1"
            elif not isinstance(min_tokens := request.get("min_tokens", 0), int) or min_tokens > 1:
                why = "a prefill step must not ask for min_tokens"
        elif self.role == "prefill":
            why = "a prefill engine only takes prefill steps (kv_transfer_params.do_remote_decode)"
        if why is not None:
            self.refused.append(why)
        return why

    # -- the prefill side ---------------------------------------------------------------------
    @contextmanager
    def computing(self, request_id: str, prompt_tokens: int) -> Iterator[list[int]]:
        """The blocks of a prefill step while it runs: held from here on, freed at once if
        the step does not finish (the client left: vLLM aborts it), kept for `hold_s`
        after it does."""
        count = max(1, math.ceil(prompt_tokens / self.block_size))
        blocks = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        self._held[request_id] = held = _Held(blocks, math.inf)
        try:
            yield blocks
        except BaseException:
            del self._held[request_id]
            raise
        held.expires = trio.current_time() + self.hold_s

    def answer_params(
        self, request_id: str, blocks: list[int], *, ok: bool = True
    ) -> dict[str, Any] | None:
        """The `kv_transfer_params` of a finished prefill step's answer (None, the blocks
        freed, when the step failed or the engine gives none)."""
        if not (ok and self.return_params):
            del self._held[request_id]  # nothing to hand over: the engine frees them
            return None
        self.prefills += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            # A field of this version only: the decode side needs it back unchanged.
            "fake_lease": f"{self.engine_id}/{request_id}/{len(blocks)}",
        }

    def give(self, request: dict[str, Any]) -> bool:
        """A decode engine reads blocks (`PULL_PATH`): True, and they are freed, if this
        engine holds exactly these for that request."""
        request_id = request.get("remote_request_id")
        held = self._held.get(request_id) if isinstance(request_id, str) else None
        self._expire()
        if (
            held is None
            or request_id not in self._held
            or request.get("remote_engine_id") != self.engine_id
            or request.get("remote_block_ids") != [held.blocks]
            or request.get("fake_lease") != f"{self.engine_id}/{request_id}/{len(held.blocks)}"
        ):
            return False
        del self._held[request_id]
        return True

    def held_blocks(self) -> int:
        """Blocks held now (for a running prefill step, or waiting for their decode engine)."""
        self._expire()
        return sum(len(h.blocks) for h in self._held.values())

    def _expire(self) -> None:
        now = trio.current_time()
        for request_id in [r for r, h in self._held.items() if h.expires <= now]:
            del self._held[request_id]

    # -- the decode side ----------------------------------------------------------------------
    async def pull(self, request: dict[str, Any]) -> str | None:
        """Read the blocks the decode step's parameters name from their prefill engine; why
        that failed, or None."""
        params = self.params(request) or {}
        missing = [
            key
            for key in (
                "remote_engine_id",
                "remote_block_ids",
                "remote_request_id",
                "remote_host",
                "remote_port",
            )
            if not params.get(key)
        ]
        if missing:
            return f"kv_transfer_params without {missing}"
        host, port = str(params["remote_host"]), params["remote_port"]
        url = f"http://{host}:{port}{PULL_PATH}"
        if not isinstance(port, int):
            return f"KV transfer from {url} failed: remote_port is not a number"
        try:
            with trio.fail_after(PULL_DEADLINE_S):
                status = await _post_json(host, port, PULL_PATH, params)
        except (OSError, trio.BrokenResourceError, h11.ProtocolError, trio.TooSlowError) as exc:
            return f"KV transfer from {url} failed: {exc!r}"
        if status != 200:
            return f"KV transfer from {url}: the prefill engine holds no such blocks"
        self.pulled += 1
        return None


async def _post_json(host: str, port: int, path: str, payload: dict[str, Any]) -> int:
    """POST `payload` as JSON on a connection of its own, spoken with h11 (which the router
    depends on anyway); the answer's status once the whole answer has arrived. The
    connection is closed on return and on cancellation."""
    body = json.dumps(payload).encode()
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=path,
        headers=[
            ("host", f"{host}:{port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("connection", "close"),
        ],
    )
    async with await trio.open_tcp_stream(host, port) as stream:
        for event in (request, h11.Data(data=body), h11.EndOfMessage()):
            await stream.send_all(client.send(event) or b"")
        status = 0
        # An engine that closes before the end of its answer makes h11 raise ProtocolError.
        while not isinstance(answer := client.next_event(), h11.EndOfMessage):
            if answer is h11.NEED_DATA:
                client.receive_data(await stream.receive_some())
            elif isinstance(answer, h11.Response):
                status = answer.status_code
        return status
