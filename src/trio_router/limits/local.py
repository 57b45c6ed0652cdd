"""Tenants' limits counted by this replica alone (`[limits] store = "local"`), and the one
way in and out of limits every store offers (`Limits`).

- **Requests per minute**: a token bucket per tenant holding `requests_per_minute` requests,
  refilled at that rate on Trio's clock; empty: 429 with `Retry-After` and OpenAI's
  `x-ratelimit-*` headers.
- **Concurrency**: at most `max_concurrent` requests of a tenant in flight or queued at
  once; beyond: 429 with `Retry-After`.

Each rejection is reported as (reason, tenant name): "rate_limited" or
"tenant_concurrency". Everything here is synchronous bookkeeping on the Trio thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from ..errors import RateLimitedError
from .tenants import Tenant

__all__ = ["Limits", "LocalLimits", "OnReject", "Ticket"]

# Told of each request turned away by a tenant's limits: (reason, tenant name).
OnReject = Callable[[str, str], None]


def _ignore(reason: str, tenant: str) -> None:
    return None


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted request: what `leave` gives back (the tenant it counts for, its lease)."""

    tenant: Tenant
    lease: tuple[bytes, str] | None = None  # shared limits: (the leases' key, the lease id)


class Limits(Protocol):
    """Where a request of a tenant is admitted and left: the exchange's one way in and out."""

    async def admit(self, tenant: Tenant) -> Ticket: ...

    def leave(self, ticket: Ticket) -> None: ...


class LocalLimits:
    """Each tenant's bucket and concurrency, counted by this replica (see the module's
    docstring)."""

    def __init__(self, *, on_reject: OnReject = _ignore) -> None:
        self._on_reject = on_reject

    def observe(self, *, on_reject: OnReject) -> None:
        """Report each rejection (reason, tenant name)."""
        self._on_reject = on_reject

    async def admit(self, tenant: Tenant) -> Ticket:
        """`admit_nowait`, as `Limits` asks (local limits never wait)."""
        return self.admit_nowait(tenant)

    def admit_nowait(self, tenant: Tenant) -> Ticket:
        """Count a new request of `tenant`, or raise RateLimitedError (429) when it is over
        its concurrency or its rate. Every admitted request ends with `leave`."""
        if tenant.max_concurrent and tenant.active >= tenant.max_concurrent:
            self._on_reject("tenant_concurrency", tenant.name)
            raise RateLimitedError(
                f"tenant {tenant.name!r} already has {tenant.active} requests in flight or "
                f"queued (its max_concurrent)",
                code="tenant_concurrency",
                headers=((b"retry-after", b"1"),),
            )
        if (error := _take_token(tenant, trio.current_time())) is not None:
            self._on_reject("rate_limited", tenant.name)
            raise error
        tenant.active += 1
        return Ticket(tenant)

    def leave(self, ticket: Ticket) -> None:
        """The request ended: its tenant's count given back."""
        ticket.tenant.active -= 1


def _take_token(tenant: Tenant, now: float) -> RateLimitedError | None:
    """Spend one request of the tenant's rate, or the error saying when one will be there."""
    rate = tenant.requests_per_minute
    if not rate:
        return None
    per_s = rate / 60.0
    if tenant.refilled_at == -math.inf:
        tenant.tokens = float(rate)
    else:
        tenant.tokens = min(float(rate), tenant.tokens + (now - tenant.refilled_at) * per_s)
    tenant.refilled_at = now
    if tenant.tokens >= 1.0:
        tenant.tokens -= 1.0
        return None
    wait = math.ceil((1.0 - tenant.tokens) / per_s)
    reset = math.ceil((rate - tenant.tokens) / per_s)
    return RateLimitedError(
        f"tenant {tenant.name!r} is over its {rate} requests per minute",
        headers=(
            (b"retry-after", b"%d" % wait),
            (b"x-ratelimit-limit-requests", b"%d" % rate),
            (b"x-ratelimit-remaining-requests", b"0"),
            (b"x-ratelimit-reset-requests", b"%ds" % reset),
        ),
    )
