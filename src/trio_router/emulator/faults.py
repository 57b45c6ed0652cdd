"""Faults injected into an emulated engine on command, for failure drills.

- `hang`: the engine stops stepping and its HTTP server stops answering, yet keeps every
  connection open: new requests are read and left without a byte of answer, streams in
  flight go silent (a wedged GPU, a stuck event loop).
- `slow`: each step takes `factor` times its duration (a throttled or shared GPU).
- `5xx`: every new request is answered with `status` (500 or 503) and vLLM's error body;
  requests in flight carry on (an engine whose server is failing).
- `kill` is the fleet's (`fleet.Fleet.kill`): the engine's server and loop are cancelled,
  which closes its listener and every connection; `recover` serves a fresh engine at the
  same address (a restarted pod: an empty cache, its KV events numbered from 0 again).
- `recover` clears the others.

`Faults` is one engine's state, read by its loop and its app; changes wake whoever waits on
it. Synchronous mutators, Trio thread only.
"""

from __future__ import annotations

import enum
from typing import Final

import trio

__all__ = ["ERROR_STATUSES", "Fault", "Faults"]

ERROR_STATUSES: Final = (500, 503)


class Fault(enum.Enum):
    """What an engine is suffering (the names of the control API)."""

    NONE = "none"
    HANG = "hang"
    SLOW = "slow"
    ERROR = "5xx"
    KILL = "kill"


class Faults:
    """One engine's injected fault (see the module)."""

    def __init__(self) -> None:
        self.fault = Fault.NONE
        self.slow_factor = 1.0  # step durations are multiplied by this
        self.error_status = 0  # 0: answer normally
        self._changed = trio.Event()

    @property
    def hung(self) -> bool:
        return self.fault is Fault.HANG

    def hang(self) -> None:
        self._set(Fault.HANG)

    def slow(self, factor: float) -> None:
        """Steps take `factor` (above 0) times as long."""
        if not factor > 0:
            raise ValueError(f"a slowdown factor must be above 0: {factor}")
        self._set(Fault.SLOW, slow_factor=factor)

    def fail(self, status: int) -> None:
        """Answer new requests with `status` (500 or 503)."""
        if status not in ERROR_STATUSES:
            raise ValueError(f"an error status must be one of {ERROR_STATUSES}: {status}")
        self._set(Fault.ERROR, error_status=status)

    def recover(self) -> None:
        self._set(Fault.NONE)

    def _set(self, fault: Fault, *, slow_factor: float = 1.0, error_status: int = 0) -> None:
        self.fault, self.slow_factor, self.error_status = fault, slow_factor, error_status
        self._changed.set()
        self._changed = trio.Event()

    async def wait_answering(self) -> None:
        """Return at once unless hung; hung, wait until it is not."""
        while self.hung:
            await self._changed.wait()

    def describe(self) -> dict[str, object]:
        """The fault as the control API shows it."""
        out: dict[str, object] = {"fault": self.fault.value}
        if self.fault is Fault.SLOW:
            out["factor"] = self.slow_factor
        elif self.fault is Fault.ERROR:
            out["status"] = self.error_status
        return out
