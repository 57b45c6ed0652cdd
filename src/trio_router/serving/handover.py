"""A followed stream's handover to another engine: `Handover`, one per stream a continuation
can carry on (`deliver.Deliver` makes it with the stream's `resume.Track`).

- While the stream is passed on from an engine (`passing(engine, response)`, a context), it
  is registered in that engine's `streams`. Discovery tells them when the engine is going
  away (`Engine.leaving`: its pod terminating or deleted); the stream is then broken off at
  once (`UpstreamResponse.break_off` with EngineLeavingError, reason "leaving") when another
  engine could carry it on: a continuation is possible, another engine of the model is
  routable and the request has continuations left. The failure takes the way any other does
  (`failover.try_engines`), and the engine, out of routing, is not chosen again. A stream
  that cannot be carried on is left to finish at its engine, which drains it (vLLM's
  `--shutdown-timeout`).
- The pause the client sees is timed: from the last bytes the failed engine sent (whatever
  the failure) to the first bytes of the continuation passed on (`carrying_on`), observed in
  `trio_router_stream_handover_seconds`.

Registering is a set's add and discard per attempt: nothing per event.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from ..http import EngineLeavingError, TransportError, UpstreamResponse
from ..table import Engine
from .attempt import broke_reason
from .runtime import Runtime

__all__ = ["Handover"]


class Handover:
    """One followed stream's handover (see the module's docstring), for the request's
    `model`; `could_go_on()` tells whether a continuation could carry the answer on now."""

    __slots__ = (
        "_attempts",
        "_could_go_on",
        "_engine",
        "_lost_at",
        "_metrics",
        "_model",
        "_reason",
        "_response",
        "_table",
        "carried",
    )

    def __init__(self, rt: Runtime, model: str, could_go_on: Callable[[], bool]) -> None:
        self._attempts = rt.resume.attempts if rt.resume is not None else 0
        self._table, self._metrics = rt.services.table, rt.services.metrics
        self._model, self._could_go_on = model, could_go_on
        self._engine: Engine | None = None
        self._response: UpstreamResponse | None = None
        self._lost_at: float | None = None  # the failed engine's last bytes, Trio time
        self._reason = ""  # why it was left, as the resume counter names it
        self.carried = 0  # continuations that have answered

    def passing(self, engine: Engine, response: UpstreamResponse) -> Handover:
        """The stream is passed on from `engine`'s `response` in the `with` block: registered
        there for the block's length. Leaving it notes when that engine last sent bytes and
        why it would be left: the TransportError that ends the block, or, when the body
        ended, "abort" (a body that ended before its answer did: `StreamAbortedError`)."""
        self._engine, self._response = engine, response
        return self

    def now_from(self, response: UpstreamResponse) -> None:
        """The stream's bytes come from `response` from now on, at the same engine (a parsed
        continuation's generate stream, after its render's answer)."""
        if self._response is not None:
            self._response = response

    def __enter__(self) -> None:
        assert self._engine is not None
        self._engine.streams.add(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        response, engine = self._response, self._engine
        assert response is not None and engine is not None
        engine.streams.discard(self)
        self._response = None
        self._lost_at = response.received_at
        self._reason = broke_reason(exc) if isinstance(exc, TransportError) else "abort"

    def engine_leaving(self, engine: Engine, why: str) -> None:
        """`engine` is going away (`Engine.leaving`): the stream is broken off now if another
        engine could carry it on."""
        response = self._response
        if (
            response is None
            or engine is not self._engine
            or self.carried >= self._attempts
            or not self._table.routable(self._model)
            or not self._could_go_on()
        ):
            return
        response.break_off(
            EngineLeavingError(
                f"engine {engine.name} is going away ({why}): its stream goes on elsewhere"
            )
        )

    def carrying_on(self) -> Callable[[float], None] | None:
        """A continuation answered: what times its first bytes (an `on_first`), if the
        failure it follows was timed."""
        self.carried += 1
        return self._first if self._lost_at is not None else None

    def _first(self, now: float) -> None:
        if (lost_at := self._lost_at) is not None:
            self._lost_at = None
            self._metrics.handed_over(self._model, self._reason, now - lost_at)
