"""Reload is rebuild: SIGHUP re-reads the config file and swaps in the runtime it builds.

`Reloader.reload()` builds the new runtime with the same function as start-up
(`runtime.build_runtime`), swaps it in with one assignment, and retires what the old one held
and the new one does not. Sections that shape the listening server or discovery need a
restart; they are reported and ignored.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import trio

from ..config import Config, StatsConfig
from ..discovery.supervision import EngineWorker, Prober, Supervisors
from ..errors import ConfigError
from ..http import UpstreamPool
from ..kv.index import BlockIndex
from ..kv.tokens import Tokenizer
from ..metrics import Metrics
from ..table import RoutingTable
from .app import RouterApp
from .runtime import Runtime, build_runtime

__all__ = ["LIVE_SECTIONS", "RESTART_SECTIONS", "SERVER_RESTART_KEYS", "ReloadOutcome", "Reloader"]

logger = logging.getLogger(__name__)

LIVE_SECTIONS: Final = ("server", "routing", "proxy", "probe", "stats", "admission", "tenants")
RESTART_SECTIONS: Final = ("discovery", "tracing", "kv_events", "disaggregation", "limits")
# Keys of [server] that shape the listening server itself: they need a restart.
SERVER_RESTART_KEYS: Final = ("bind", "backlog", "max_connections", "write_timeout_s", "log_format")


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What one SIGHUP did: the sections applied, the changes that need a restart (ignored),
    or the error that kept the old config."""

    applied: tuple[str, ...] = ()
    needs_restart: tuple[str, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class Reloader:
    """Applies a re-read config to the running process (SIGHUP).

    Live: [routing], [proxy], [admission], [[tenants]] and [server] except the keys in
    SERVER_RESTART_KEYS: new requests use the new settings (`build_runtime`); requests in
    flight keep the ones they started with (a new upstream pool replaces the old one when a
    proxy timeout changes; the old one's exchanges finish on their connections). A new
    `proxy.api_key_env` key also goes to the next probes and scrapes. [probe]: each engine's
    next probe uses the new settings. [stats]: every engine's supervisor restarts with the
    new scraper settings (routing state kept). SERVER_RESTART_KEYS and RESTART_SECTIONS
    ([discovery], [tracing]) need a restart: logged and ignored. A file that does not load,
    or names an unset key variable, changes nothing.
    """

    def __init__(
        self,
        load: Callable[[], Config],
        runtime: Runtime,
        *,
        app: RouterApp,
        table: RoutingTable,
        metrics: Metrics,
        prober: Prober,
        supervisors: Supervisors,
        stats_workers: Callable[[StatsConfig], list[EngineWorker]],
        on_reload: Callable[[ReloadOutcome], None] | None = None,
        kv_index: BlockIndex | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self._load, self.runtime = load, runtime
        self._kv_index, self._tokenizer = kv_index, tokenizer
        self._prober = prober
        self._supervisors, self._stats_workers = supervisors, stats_workers
        self._app, self._table = app, table
        self._metrics, self._on_reload = metrics, on_reload

    @property
    def config(self) -> Config:
        return self.runtime.config

    async def reload(self) -> ReloadOutcome:
        """Re-read and apply the config file. The file is read in a worker thread; the swap
        itself is one synchronous step. Cancellation before the swap changes nothing."""
        try:
            new = await trio.to_thread.run_sync(self._load)
            outcome, retired = self._apply(new)
        except ConfigError as exc:
            logger.error("config reload failed; keeping the running config: %s", exc)
            outcome, retired = ReloadOutcome(error=str(exc)), None
        self._metrics.reload("error" if outcome.error else "ok" if outcome.applied else "unchanged")
        if self._on_reload is not None:
            self._on_reload(outcome)
        if retired is not None:
            await retired.aclose()  # idle connections only; busy ones close when done
        return outcome

    def _apply(self, new: Config) -> tuple[ReloadOutcome, UpstreamPool | None]:
        """Build the runtime of `new` and swap it in (no await: a request sees all old or all
        new settings). Returns the outcome and the upstream pool to retire, if one was
        replaced. Raises ConfigError, having changed nothing."""
        previous = self.runtime
        old = previous.config
        restart = [
            f"server.{key} ({getattr(old.server, key)} -> {getattr(new.server, key)})"
            for key in SERVER_RESTART_KEYS
            if getattr(new.server, key) != getattr(old.server, key)
        ]
        restart += [
            f"[{section}]"
            for section in RESTART_SECTIONS
            if getattr(new, section) != getattr(old, section)
        ]
        effective = dataclasses.replace(
            new,
            server=dataclasses.replace(
                new.server, **{key: getattr(old.server, key) for key in SERVER_RESTART_KEYS}
            ),
            **{section: getattr(old, section) for section in RESTART_SECTIONS},
        )
        applied = tuple(
            f"[{section}]"
            for section in LIVE_SECTIONS
            if getattr(effective, section) != getattr(old, section)
        )
        if restart:
            logger.warning(
                "config reload: %s changed, which needs a restart; ignored until then",
                ", ".join(restart),
            )
        runtime = build_runtime(effective, self._table, previous, kv_index=self._kv_index)
        if self._tokenizer is not None:
            self._tokenizer.timeout = effective.routing.tokenize_timeout_s
        self._app.settings, self.runtime = runtime.settings, runtime
        self._prober.api_key = runtime.engine_key
        self._supervisors.outliers.configure(effective.proxy)
        self._app.tenants.configure(effective)  # its keys were checked by build_runtime
        self._app.admission.configure(effective)
        if effective.probe != old.probe or effective.stats != old.stats:
            self._supervisors.update_config(
                effective.probe,
                workers=None
                if effective.stats == old.stats
                else self._stats_workers(effective.stats),
            )
        retired_pool, unsubscribe = runtime.retired(previous)
        if unsubscribe is not None:
            unsubscribe()
        if applied:
            logger.warning("config reload applied: %s", ", ".join(applied))
        elif not restart:
            logger.warning("config reload: nothing changed")
        return ReloadOutcome(applied=applied, needs_restart=tuple(restart)), retired_pool
