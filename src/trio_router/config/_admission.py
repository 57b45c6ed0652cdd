"""The sections of who may send what, and when: [admission] (the router's queue),
[[tenants]] (keys, weights and limits) and [limits] (where tenants' limits are counted)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ._values import check_choice, positive

Fairness = Literal["tenant", "none"]
FAIRNESS: typing.Final[tuple[Fairness, ...]] = typing.get_args(Fairness)
LimitStore = Literal["local", "redis"]
LIMIT_STORES: typing.Final[tuple[LimitStore, ...]] = typing.get_args(LimitStore)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    max_in_flight_per_engine: int = 0  # an engine is saturated at this many; 0: no cap
    max_waiting_per_engine: int = 0  # ... or when its own queue is this long; 0: ignore
    queue_size: int = 1024  # requests waiting at the router, in all; beyond: 429
    queue_timeout_s: float = 30.0  # longest wait in the queue; then 503
    fairness: Fairness = "tenant"  # "tenant": weighted round robin across tenants; "none": FIFO
    priority: int = 0  # anonymous traffic's band (higher is served first)
    ttft_deadline_ms: int = 0  # anonymous traffic's first-token deadline; 0: none
    sheddable_below: int = 0  # bands below this are refused when saturated, never queued
    priority_to_engines: bool = False  # set vLLM's request `priority` (minus the band)
    reserve_per_engine: int = 0  # slots of each engine's cap only the top band may take
    # The waiting room: a request for a known model with no routable engine waits in the
    # queue (queue_timeout_s at most; then 503 no_engine) instead of failing at once. Known:
    # a model some engine served within known_model_s, or one the configuration names
    # (routing.models, aliases, fallbacks).
    wait_for_engine: bool = True
    known_model_s: float = 3600.0

    def __post_init__(self) -> None:
        for key in (
            "max_in_flight_per_engine",
            "max_waiting_per_engine",
            "queue_size",
            "ttft_deadline_ms",
            "reserve_per_engine",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"admission.{key} must be >= 0, got {getattr(self, key)}")
        positive("admission", queue_timeout_s=self.queue_timeout_s)
        if self.known_model_s < 0:
            raise ConfigError(f"admission.known_model_s must be >= 0, got {self.known_model_s}")
        check_choice(self.fairness, FAIRNESS, "admission.fairness")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    name: str = ""
    key_env: str = ""  # env var holding the tenant's Bearer key
    weight: int = 1  # share of the queue's dispatches, against the other tenants
    requests_per_minute: int = 0  # token bucket (burst = this); 0: unlimited
    max_concurrent: int = 0  # in flight + queued; 0: unlimited
    priority: int = 0  # its band in the queue (higher is served first)
    ttft_deadline_ms: int = 0  # its requests' first-token deadline; 0: none

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("tenants: every tenant needs a name")
        if not self.key_env:
            raise ConfigError(
                f"tenants: tenant {self.name!r} needs key_env (the environment "
                "variable holding its key)"
            )
        if self.weight < 1:
            raise ConfigError(
                f"tenants: tenant {self.name!r}: weight must be >= 1, got {self.weight}"
            )
        for key in ("requests_per_minute", "max_concurrent", "ttft_deadline_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    f"tenants: tenant {self.name!r}: {key} must be >= 0, got {getattr(self, key)}"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsConfig:
    """Where tenants' limits are counted: by each replica ("local"), or in a Redis server
    every replica shares ("redis"), so that N replicas together admit what one would."""

    store: LimitStore = "local"
    redis_url_env: str = (
        "TRIO_ROUTER_REDIS_URL"  # env var: redis://[[user]:password@]host[:port][/db]
    )
    key_prefix: str = "trio_router:"
    timeout_s: float = 0.25  # longest a request waits for the store; then local limits
    retry_s: float = 2.0  # after the store failed, local limits this long before asking again
    lease_s: float = 30.0  # a concurrency slot's time to live, renewed while its request runs
    connect_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        check_choice(self.store, LIMIT_STORES, "limits.store")
        if self.store == "redis" and not self.redis_url_env:
            raise ConfigError(
                'limits.store = "redis" needs limits.redis_url_env (the environment variable '
                "holding the store's URL)"
            )
        positive(
            "limits",
            timeout_s=self.timeout_s,
            retry_s=self.retry_s,
            lease_s=self.lease_s,
            connect_timeout_s=self.connect_timeout_s,
        )
        if not self.key_prefix:
            raise ConfigError("limits.key_prefix must not be empty")
