"""What a reload (SIGHUP) may change: `plan(running, new)` splits a re-read config into what
applies live and what needs a restart, and returns the config to apply (the running one's
restart-only parts kept) with the outcome to report. The server applies it
(`server.Router.apply`).

Live: [routing], [proxy], [admission], [[tenants]], [probe], [stats] and [server] except the
keys in SERVER_RESTART_KEYS: new requests use the new settings, requests in flight keep the
ones they started with. SERVER_RESTART_KEYS and RESTART_SECTIONS need a restart: logged and
ignored.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Final

from ..config import Config

__all__ = [
    "LIVE_SECTIONS",
    "RESTART_SECTIONS",
    "SERVER_RESTART_KEYS",
    "ReloadOutcome",
    "log_applied",
    "plan",
]

logger = logging.getLogger(__name__)

LIVE_SECTIONS: Final = (
    "server",
    "routing",
    "proxy",
    "probe",
    "stats",
    "admission",
    "tenants",
)
RESTART_SECTIONS: Final = (
    "discovery",
    "tracing",
    "kv_events",
    "disaggregation",
    "limits",
    "metrics",
    "picker",
)
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


def plan(running: Config, new: Config) -> tuple[Config, ReloadOutcome]:
    """The config to apply for `new` while `running` runs (what needs a restart kept as it
    runs), and the outcome to report; the changes that need a restart are logged
    (`log_applied` says what was applied, once it is)."""
    restart = [
        f"server.{key} ({getattr(running.server, key)} -> {getattr(new.server, key)})"
        for key in SERVER_RESTART_KEYS
        if getattr(new.server, key) != getattr(running.server, key)
    ]
    restart += [
        f"[{section}]"
        for section in RESTART_SECTIONS
        if getattr(new, section) != getattr(running, section)
    ]
    effective = dataclasses.replace(
        new,
        server=dataclasses.replace(
            new.server, **{key: getattr(running.server, key) for key in SERVER_RESTART_KEYS}
        ),
        **{section: getattr(running, section) for section in RESTART_SECTIONS},
    )
    applied = tuple(
        f"[{section}]"
        for section in LIVE_SECTIONS
        if getattr(effective, section) != getattr(running, section)
    )
    if restart:
        logger.warning(
            "config reload: %s changed, which needs a restart; ignored until then",
            ", ".join(restart),
        )
    return effective, ReloadOutcome(applied=applied, needs_restart=tuple(restart))


def log_applied(outcome: ReloadOutcome) -> None:
    """Say what a reload applied, once it has."""
    if outcome.applied:
        logger.warning("config reload applied: %s", ", ".join(outcome.applied))
    elif not outcome.needs_restart:
        logger.warning("config reload: nothing changed")
