"""What `/health` answers: whether this router can route."""

from __future__ import annotations

from ..table import EngineState, RoutingTable
from .loop import DiscoveryStatus

__all__ = ["Readiness"]


class Readiness:
    """What `/health` answers: whether this router can route, which is not the same as
    whether its view of the API is fresh.

    Not ready until the first LIST has succeeded and every engine it found has had its first
    probe answered (or failed): a new replica gets no traffic before it knows its engines.
    From then on ready, whatever happens to the API server: staleness, watch errors and
    rejected credentials are reported ("degraded", with the reason) but do not take the
    router out of its Service, because its last table, kept honest by its own probes, still
    routes (engines that die meanwhile fail their probes and leave routing). With `strict`,
    any of those makes it not ready, as a router that must never route from a stale table
    would want."""

    def __init__(
        self, status: DiscoveryStatus, table: RoutingTable, *, strict: bool = False
    ) -> None:
        self._status, self._table, self._strict = status, table, strict
        self._probed = False  # the first probes are over; latched

    def check(self, now: float) -> tuple[bool, str, str]:
        """(ready, "ok" | "degraded" | "unavailable", reason)."""
        status = self._status
        if not status.synced:  # the reason: "Kubernetes pods not listed yet", or the pool's
            return False, "unavailable", status.health(now)[1]
        if not self._probed:
            probing = sum(1 for e in self._table if e.state is EngineState.PROBING)
            if probing:
                return False, "unavailable", (f"waiting for the first probe of {probing} engine(s)")
            self._probed = True
        fresh, reason = status.health(now)
        if fresh:
            return True, "ok", reason
        if self._strict:
            return False, "unavailable", reason
        return True, "degraded", f"routing from the last known table: {reason}"
