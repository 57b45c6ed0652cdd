"""When a stream whose body has begun is judged stalled: `Stall`, the bound on an engine's
silence that follows the stream's own pace.

A fixed bound has to be long enough for the slowest healthy pause any engine may make (a busy
engine's step that carries another request's prefill, a machine starved for CPU), so a dead
engine keeps its clients waiting that long. The bound here is the stream's own: silence
longer than `factor` times the largest gap the stream has shown so far (between two reads of
its body), never less than `floor_s` (a stream's first gaps say little) nor more than
`ceiling_s` (`proxy.stall_timeout_s`, the bound of old). A steady stream is left within
`floor_s` of its engine falling silent; one that has already paused for seconds may pause as
long again. The wait for the first bytes of the body (the time to first token) is not judged
by it: the read timeout bounds that.

The pool (`UpstreamResponse`, reading the body itself) and the relay (`Relay`) both apply it:
the gap of a stream is the silence each observes (a wait the router's own client caused by not
taking bytes is not the engine's and does not count).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import EngineStalledError

__all__ = ["Stall", "stalled"]


@dataclass(frozen=True, slots=True)
class Stall:
    """The silence allowed to an engine between two pieces of a stream (see the module's
    docstring): `factor` x the largest gap so far, within [`floor_s`, `ceiling_s`] (the
    ceiling wins when the floor is above it)."""

    ceiling_s: float  # proxy.stall_timeout_s
    floor_s: float  # proxy.stall_floor_s
    factor: float  # proxy.stall_factor

    def allowed(self, gap: float) -> float:
        """Seconds of silence allowed after the largest gap so far was `gap` seconds."""
        return min(self.ceiling_s, max(self.floor_s, self.factor * gap))


def stalled(url: str, silent: float, gap: float) -> EngineStalledError:
    """The engine at `url` was silent for `silent` seconds mid-stream, its largest gap before
    having been `gap` seconds."""
    return EngineStalledError(
        f"engine {url} was silent for {silent:.3g} s between two pieces of a stream whose "
        f"largest gap so far was {gap:.3g} s (proxy.stall_floor_s, proxy.stall_factor, "
        "proxy.stall_timeout_s)"
    )
