"""The API server in front of an emulated engine core: vLLM V1 runs it as a process of its own
(HTTP, request processing, detokenizing and writing every stream's events), beside the engine
core that steps the model, and on a small CPU machine its work delays what a client sees.

`FrontEnd` keeps its timeline (Trio's clock): each piece of work starts when the last one
ended or when it comes, whichever is later, and lasts what the profile's `[front_end]` says
(`profiles.FrontEndCost`, emulated seconds scaled by the engine's time scale). A request
reaches the engine core when its arrival is processed; a step's tokens reach their readers
when its output is. The engine core's steps do not wait for it.

Arrivals are handled in rounds: a request that comes while the front end is still handling
earlier arrivals (and nothing else was queued after them) joins them, and the round's
requests all reach the engine core when its work is done. vLLM's API server interleaves the
requests on its event loop, so a burst of them progresses together and is handed on nearly
together; handed on one after another, a burst would reach the engine core spread out and be
prefilled over more, smaller steps than vLLM's (docs/performance.md, "cpu-tiny against the
real vLLM CPU engine").
"""

from __future__ import annotations

import math
from collections import deque

from .profiles import FrontEndCost
from .request import Request

__all__ = ["FrontEnd"]


class FrontEnd:
    """One engine's API server: its timeline and the requests it has not yet handed on."""

    def __init__(self, cost: FrontEndCost, time_scale: float) -> None:
        self.cost, self._scale = cost, time_scale
        self._free_at = -math.inf  # when its last piece of work ends (Trio's clock)
        self._arriving: deque[tuple[float, Request]] = deque()  # in order of readiness
        self.reached: dict[str, float] = {}  # request id -> reached the core (emulated s)
        self._round = 0
        self._round_end = -math.inf

    def _work(self, now: float, seconds: float) -> float:
        """Queue `seconds` of work at `now`; when it ends (Trio's clock)."""
        self._free_at = max(now, self._free_at) + seconds / self._scale
        return self._free_at

    def arrive(self, request: Request, now: float) -> None:
        """A request has come (Trio's clock `now`): it reaches the core once processed."""
        joined = self._round and now < self._free_at and self._free_at == self._round_end
        ready = self._work(now, self.cost.arrival_s)
        if joined:
            for i in range(len(self._arriving) - self._round, len(self._arriving)):
                self._arriving[i] = (ready, self._arriving[i][1])
            self._round += 1
        else:
            self._round = 1
        self._round_end = ready
        self._arriving.append((ready, request))

    def arrived(self, now: float) -> list[Request]:
        """The requests processed by `now`, in order; each leaves the front end."""
        out = []
        while self._arriving and self._arriving[0][0] <= now:
            ready, request = self._arriving.popleft()
            self.reached[request.request_id] = ready * self._scale
            out.append(request)
        self._round = min(self._round, len(self._arriving))  # those handed on leave it
        return out

    def next_arrival(self) -> float:
        """When the next request reaches the core (Trio's clock; inf: none is coming)."""
        return self._arriving[0][0] if self._arriving else math.inf

    def remove(self, request: Request) -> bool:
        """Forget a request whose client went away: drop it if it is not yet handed on
        (True), else forget when it reached the core (False)."""
        self.reached.pop(request.request_id, None)
        for index, item in enumerate(self._arriving):
            if item[1] is request:
                if index >= len(self._arriving) - self._round:
                    self._round -= 1  # it was in the open round
                del self._arriving[index]
                return True
        return False

    def output(self, step_end: float, tokens: int, finished: int = 0) -> float:
        """When a step that ended at `step_end` (Trio's clock) has its `tokens` tokens at
        their readers; the ends of the `finished` requests among them are worked on after
        that."""
        ready = self._work(step_end, self.cost.output_seconds(tokens))
        if finished:
            self._work(ready, self.cost.finish_s * finished)
        return ready
