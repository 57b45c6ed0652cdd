"""The fleet's fault-injection API, for failure drills (`trio-router emulate --control-port`).

    POST /emulator/fault   {"engine": 2, "fault": "hang"}
                           {"engine": 2, "fault": "slow", "factor": 10}
                           {"engine": 2, "fault": "5xx", "status": 503}
                           {"engine": 2, "fault": "kill"}
                           {"engine": 2, "fault": "terminate"}
                           {"engine": 2, "fault": "recover"}
    POST /emulator/scale   {"engines": 6}
    GET  /emulator/engines

`engine` is the engine's index in the printed list (from 0). What each fault does is in
`faults`; `kill` cancels the engine's server (its listener and connections close), as SIGKILL
would; `terminate` first aborts its requests and lets their answers be written, as vLLM does
on SIGTERM (`Fleet.terminate`), then kills it; `recover` serves a fresh engine at the same
address, or lifts any other fault. A killed engine takes only `recover` (or `kill` again,
which does nothing): 409 otherwise. Answers are JSON: the engine's index, URL and fault
(`{"engine": 2, "url": "...", "fault": "slow", "factor": 10.0}`); a bad request is 400 with
the reason, an unknown engine 404.

`scale` serves engines until the fleet has `engines` (0 to MAX_ENGINES), each configured as
the first one and placed after the others (the next pod IP, or the next port), or drops the
last ones beyond it and stops them as `terminate` does (`Fleet.scale`; with `--kubernetes`
their pods follow, `kubernetes`); it answers the fleet's engines as `GET /emulator/engines`
does (a new engine's URL is also logged, at `--log-level info`). Fault and scale requests
are applied one at a time, in the order they come.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

import trio

from ..asgi import Receive, Scope, Send, answer_lifespan
from ..errors import ConfigError
from .faults import ERROR_STATUSES, Fault, Faults
from .fleet import MAX_ENGINES, Fleet
from .http_server import serve_asgi

__all__ = ["ControlApp", "serve_control"]

logger = logging.getLogger(__name__)

DEFAULT_SLOWDOWN: Final = 10.0
DEFAULT_STATUS: Final = 503
_FAULTS: Final = frozenset({"kill", "terminate", "hang", "slow", "5xx", "recover"})


class _Refused(Exception):
    """A control request that cannot be applied: its status and reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class ControlApp:
    """The ASGI app of the fault-injection API over `fleet` (see the module)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._changing = trio.Lock()  # one fault or scale at a time: each sees the last done

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
        route = (scope["method"], scope["path"])
        try:
            if route == ("GET", "/emulator/engines"):
                answer: Any = [self._state(i) for i in range(len(self.fleet))]
            elif route == ("POST", "/emulator/fault"):
                async with self._changing:
                    answer = await self._apply(bytes(body))
            elif route == ("POST", "/emulator/scale"):
                async with self._changing:
                    await self._scale(_size(bytes(body)))
                    answer = [self._state(i) for i in range(len(self.fleet))]
            else:
                raise _Refused(404, f"no such route: {scope['method']} {scope['path']}")
        except _Refused as refused:
            await _send_json(send, refused.status, {"error": str(refused)})
            return
        await _send_json(send, 200, answer)

    def _state(self, index: int) -> dict[str, Any]:
        engine = self.fleet.engine(index)
        fault = {"fault": Fault.KILL.value} if engine is None else engine.faults.describe()
        return {"engine": index, "url": self.fleet.urls[index], **fault}

    async def _scale(self, engines: int) -> None:
        """`Fleet.scale`. Raises _Refused for a size the fleet's layout cannot take, or an
        engine whose address cannot be served."""
        try:
            await self.fleet.scale(engines)
        except ConfigError as exc:
            raise _Refused(400, str(exc)) from None
        except OSError as exc:
            raise _Refused(409, f"engine {len(self.fleet)} cannot be served: {exc}") from None
        logger.info("fleet scaled to %d engine(s)", len(self.fleet))

    async def _apply(self, raw: bytes) -> dict[str, Any]:
        """Apply one fault request; the engine's state after it. Raises _Refused."""
        body = _object(raw)
        index, fault = body.get("engine"), body.get("fault")
        if type(index) is not int:
            raise _Refused(400, f'"engine" must be an engine\'s index: {index!r}')
        if not 0 <= index < len(self.fleet):
            raise _Refused(404, f"no engine {index}: the fleet has {len(self.fleet)}")
        if fault not in _FAULTS:
            raise _Refused(400, f'"fault" must be one of {sorted(_FAULTS)}: {fault!r}')
        engine = self.fleet.engine(index)
        if fault == "recover":
            if engine is None:
                await self.fleet.restart(index)
            else:
                engine.faults.recover()
        elif fault == "kill":
            self.fleet.kill(index)
        elif engine is None:
            raise _Refused(409, f"engine {index} is killed: recover it first")
        elif fault == "terminate":
            await self.fleet.terminate(index)
        else:
            _inflict(engine.faults, fault, body)
        logger.info("engine %d: %s", index, fault)
        return self._state(index)


def _object(raw: bytes) -> dict[str, Any]:
    """A control request's body, a JSON object. Raises _Refused."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _Refused(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _Refused(400, "the body must be a JSON object")
    return body


def _size(raw: bytes) -> int:
    """The fleet size a scale request asks for. Raises _Refused."""
    engines = _object(raw).get("engines")
    if type(engines) is not int or not 0 <= engines <= MAX_ENGINES:
        raise _Refused(400, f'"engines" must be a number of engines, 0..{MAX_ENGINES}: {engines!r}')
    return engines


def _inflict(faults: Faults, fault: str, body: dict[str, Any]) -> None:
    """Set a running engine's hang, slowdown or error status. Raises _Refused."""
    if fault == "hang":
        faults.hang()
    elif fault == "slow":
        factor = body.get("factor", DEFAULT_SLOWDOWN)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise _Refused(400, f'"factor" must be a number above 0: {factor!r}')
        faults.slow(float(factor))
    else:
        status = body.get("status", DEFAULT_STATUS)
        if status not in ERROR_STATUSES or isinstance(status, bool):
            raise _Refused(400, f'"status" must be one of {list(ERROR_STATUSES)}: {status!r}')
        faults.fail(status)


async def _send_json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def serve_control(
    fleet: Fleet,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the fault-injection API over `fleet` until cancelled; reports its URL once it
    accepts connections."""
    await serve_asgi(ControlApp(fleet), host, port, task_status=task_status)
