"""Passive health: what requests tell of the engines (outlier ejection).

An engine that cannot be reached is ejected at once and re-probed; one that answers its
probes but fails requests (timeouts, broken or malformed answers, 5xx with
`proxy.eject_on_5xx`) is ejected after `proxy.eject_after_failures` in a row and held out for
`proxy.ejection_s` times its consecutive ejections, whatever its probes say. Requests never
eject more than `proxy.max_ejected_percent` of the engines (a connection refused outright
excepted: that engine is surely down). Probes readmit an engine once its hold is over, or
as soon as one passes after one failed during the hold: the engine was down (killed,
restarted: what made its requests fail was its death) and is back, as Envoy's passing active
health check unejects a host.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from ..config import Config, ProxyConfig
from ..table import Engine, EngineState, RoutingTable

__all__ = ["Outliers"]

logger = logging.getLogger(__name__)


class Outliers:
    """Outlier ejection for one routing table; `wake_up(uid)` re-probes an engine at once."""

    def __init__(
        self, table: RoutingTable, config: ProxyConfig, *, wake_up: Callable[[str], None]
    ) -> None:
        self._table, self._ejection, self._wake_up = table, config, wake_up
        self._ejected: set[str] = set()  # ejected by requests, until a probe readmits them
        self._held: dict[str, float] = {}  # not readmitted before this trio time
        self._ejections: dict[str, int] = {}  # consecutive outlier ejections: the hold factor
        self._down: set[str] = set()  # held, and a probe failed since: readmitted when back

    def configure(self, config: Config) -> None:
        """Apply the outlier-detection settings of a reloaded config (its [proxy])."""
        self._ejection = config.proxy

    def hold_left(self, uid: str, now: float) -> float:
        """Seconds before a probe may readmit `uid` (<= 0: it may now; at once when a probe
        failed during its hold: it was down, and is back)."""
        if uid in self._down:
            return -math.inf
        return self._held.get(uid, -math.inf) - now

    def probe_failed(self, uid: str) -> None:
        """A probe of `uid` failed: if requests hold it out, it was down, not misbehaving, and
        the next probe that passes readmits it."""
        if uid in self._held:
            self._down.add(uid)

    def readmitted(self, uid: str) -> None:
        """A probe found `uid` healthy after its hold: it is no longer ejected."""
        self._held.pop(uid, None)
        self._ejected.discard(uid)
        self._down.discard(uid)

    def forget(self, uid: str) -> None:
        """`uid` is no longer supervised."""
        self._held.pop(uid, None)
        self._ejected.discard(uid)
        self._down.discard(uid)

    def report_unreachable(
        self, engine: Engine, generation: int, reason: str, *, refused: bool = True
    ) -> None:
        """Passive health: the proxy could not reach `engine`. Eject it now and re-probe at once,
        rather than at its next interval. Ignored if the entry has moved on. A connection
        that was not `refused` outright (it timed out, or closed unanswered: what an engine
        whose backlog overflows in a burst does too) ejects only while requests have ejected
        less than `proxy.max_ejected_percent` of the engines."""
        may = (
            self._table.current(engine.uid, generation) is engine and engine.routable
            if refused
            else self._may_eject(engine, generation)
        )
        if may and self._table.mark_failed(engine.uid, generation, reason, eject=True):
            self._ejected.add(engine.uid)
            logger.warning("engine %s ejected after a failed request: %s", engine.name, reason)
            self._wake_up(engine.uid)

    def request_failed(self, engine: Engine, generation: int, reason: str) -> None:
        """Outlier detection: a request to `engine` failed after reaching it (a timeout, a
        broken or malformed answer; an engine 5xx if `proxy.eject_on_5xx`). After
        `proxy.eject_after_failures` in a row the engine is ejected, and its probes may not
        bring it back for `proxy.ejection_s` times its consecutive ejections: an engine that
        passes its probe but fails every request must not keep getting traffic."""
        engine.request_failures += 1
        threshold = self._ejection.eject_after_failures
        if not threshold or engine.request_failures < threshold or not engine.routable:
            return
        if not self._may_eject(engine, generation):
            return
        count = self._ejections[engine.uid] = self._ejections.get(engine.uid, 0) + 1
        hold = self._ejection.ejection_s * count
        why = (
            f"{engine.request_failures} requests in a row failed (last: {reason}); "
            f"out of routing for {hold:g} s"
        )
        if self._table.mark_failed(engine.uid, generation, why, eject=True):
            self._ejected.add(engine.uid)
            self._held[engine.uid] = trio.current_time() + hold
            logger.warning("engine %s ejected: %s", engine.name, why)
            self._wake_up(engine.uid)

    def request_succeeded(self, engine: Engine) -> None:
        """A request to `engine` succeeded: its run of failures is over, and it has shown it
        is alive (its probes wait)."""
        engine.request_failures = 0
        engine.answered_at = trio.current_time()
        if self._ejections:
            self._ejections.pop(engine.uid, None)

    def _may_eject(self, engine: Engine, generation: int) -> bool:
        """Requests may take `engine` out of routing: it is routable now, and ejecting it keeps
        the engines requests have ejected within `proxy.max_ejected_percent` of all."""
        if self._table.current(engine.uid, generation) is not engine or not engine.routable:
            return False
        eligible = sum(1 for e in self._table if e.state is not EngineState.PENDING)
        ejected = sum(1 for uid in self._ejected if uid in self._table)
        if (ejected + 1) * 100 <= self._ejection.max_ejected_percent * eligible:
            return True
        logger.warning(
            "engine %s failing requests is kept in routing: %d of %d engines are "
            "ejected already (proxy.max_ejected_percent = %d)",
            engine.name,
            ejected,
            eligible,
            self._ejection.max_ejected_percent,
        )
        return False
