"""Routing policies: the pure, synchronous choice of one engine for one request.

A decision reads the candidates (the routable engines serving the model), their in-flight
counts, their scraped stats (ignored once stale), and the policy's own bounded memory. Nothing
here awaits, does I/O or takes a lock: a decision runs on the Trio thread between two
checkpoints, so it sees one consistent table. The only clock read is `trio.current_time()`
(injectable), used to judge whether scraped stats are fresh. Cost per decision does not grow
with the number of engines, except where noted.

Policies: `round_robin`, `least_loaded` (power of two choices), `session` (consistent hashing
of a session key with bounded load) and `prefix_aware` (the same, keyed by the opening of the
conversation, for prefix-cache affinity). Both hashing policies are deterministic functions of
the request, the engine set and the load figures: every router replica, a fresh one included,
makes the same choice from the same inputs, with no shared state. `make_policy` builds a
policy from the config; subscribed to the table's removals, it lets go of an engine the
moment it leaves the table.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection, Sequence
from typing import Final, Protocol

import trio

from ..config import RoutingConfig
from ..kv.index import BlockIndex
from ..table import Engine
from .affinity import PrefixAwarePolicy, SessionPolicy
from .balance import LeastLoadedPolicy, LoadGauge, RoundRobinPolicy
from .kv_aware import KvAwarePolicy, KvTuning
from .request import Decision, RequestInfo, request_info

__all__ = ["Decision", "Policy", "RequestInfo", "make_policy", "request_info"]

logger = logging.getLogger(__name__)

_UNUSED_DEFAULT: Final = RoutingConfig.__dataclass_fields__["prefix_cache_entries"].default


class Policy(Protocol):
    """A routing policy. `choose` is pure and synchronous; `forget` drops per-engine memory."""

    name: str
    # It reads more of a request than its model (the session key, the opening): the members
    # `request_info` reads (`request_reads`) are parsed, and it is rendered for the request.
    needs_request_info: bool
    # It routes on the prompt's token ids (`RequestInfo.tokens`), asked of an engine first.
    needs_tokens: bool

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> Decision:
        """The engine for `request` among `candidates` whose uid is not in `exclude` (with a
        short reason for the decision log). Raises NoEngineError when none is left."""
        ...

    def forget(self, uid: str) -> None:
        """Drop everything remembered about engine `uid` (it left the routing table)."""
        ...


def make_policy(
    config: RoutingConfig,
    *,
    clock: Callable[[], float] | None = None,
    rng: random.Random | None = None,
    kv_index: BlockIndex | None = None,
) -> Policy:
    """Build the policy `config.policy` names. Its `forget` must hear of every engine that
    leaves the table (`RoutingTable.add_remove_listener`, which returns the way to stop).
    `clock` defaults to `trio.current_time`
    (so `choose` must then run inside Trio); `rng` to a fresh Random."""
    rng = rng if rng is not None else random.Random()
    gauge = LoadGauge(
        queue_weight=config.load_queue_weight,
        kv_weight=config.load_kv_weight,
        clock=clock if clock is not None else trio.current_time,
    )
    least = LeastLoadedPolicy(gauge, rng)
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    if config.policy == "least_loaded":
        return least
    if config.policy == "session":
        return SessionPolicy(
            gauge, least, rng, load_factor=config.session_load_factor, vnodes=config.session_vnodes
        )
    if config.policy in ("prefix_aware", "kv_aware"):
        if config.prefix_cache_entries != _UNUSED_DEFAULT:
            logger.warning(
                "routing.prefix_cache_entries is no longer used: prefix_aware keeps "
                "no memory (its choice depends on the request, the engines and "
                "their load only)"
            )
        prefix = PrefixAwarePolicy(
            gauge,
            least,
            rng,
            load_factor=config.prefix_balance_rel,
            slack=config.prefix_balance_abs,
            vnodes=config.session_vnodes,
        )
        if config.policy == "prefix_aware":
            return prefix
        index = kv_index if kv_index is not None else BlockIndex()
        return KvAwarePolicy(index, gauge, prefix, KvTuning.of(config))
    raise ValueError(f"unknown routing policy {config.policy!r}")  # RoutingConfig validates
