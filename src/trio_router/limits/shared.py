"""Tenant limits across router replicas: each tenant's request bucket and concurrency kept in
Redis, updated by one server-side script per request, so the replicas together admit exactly
what one router would.

- **Requests per minute**: a token bucket per tenant (a hash: tokens, last refill), refilled
  at the tenant's rate from the store's own clock (`TIME`), so replicas whose clocks differ
  still agree. Its key expires when it would be full again: a full bucket is no key.
- **Concurrency**: a sorted set per tenant of leases (member: a request's lease id, score:
  when it expires). A request takes a lease if fewer than `max_concurrent` live ones are
  there; the replica renews the leases of its running requests every third of
  `limits.lease_s` and gives each back when its request ends. A replica that dies leaves its
  leases to expire: its slots come back within `limits.lease_s`.
- **Replicas**: each replica renews its own entry in a sorted set of replicas; their count
  is what the local fallback divides by.
- **Failure**: a request waits for the store at most `limits.timeout_s`. When the store does
  not answer in time, or cannot be reached, the request is admitted by local limits instead:
  each limit divided by the number of replicas last seen (rounded up), counted by this
  replica alone; for `limits.retry_s` every request does so without asking the store, then
  the next one asks again. The change each way is logged once and counted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from ..config import LimitsConfig
from ..errors import RateLimitedError
from .local import LocalLimits, OnReject, Ticket
from .redis import RedisConnection, RedisError, RedisURL
from .tenants import Tenant

__all__ = ["SharedLimits"]

logger = logging.getLogger(__name__)

# KEYS: bucket, leases. ARGV: requests per minute, max concurrent, lease ms, lease id.
# Returns {0} (admitted), {1, retry ms, reset ms} (over its rate), {2, active} (concurrency).
_ADMIT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm = tonumber(ARGV[1])
local maxc = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local active = redis.call('ZCARD', KEYS[2])
  if active >= maxc then return {2, active} end
end
if rpm > 0 then
  local per_ms = rpm / 60000
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens = tonumber(b[1])
  local at = tonumber(b[2])
  if tokens == nil or at == nil then tokens = rpm; at = now end
  tokens = math.min(rpm, tokens + math.max(0, now - at) * per_ms)
  if tokens < 1 then
    return {1, math.ceil((1 - tokens) / per_ms), math.ceil((rpm - tokens) / per_ms)}
  end
  tokens = tokens - 1
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil((rpm - tokens) / per_ms) + 1000)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[2], now + lease, ARGV[4])
  redis.call('PEXPIRE', KEYS[2], lease * 2)
end
return {0}
"""
# KEYS: the leases' sets, one per lease. ARGV: lease ms, then the lease ids in KEYS' order.
_RENEW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + lease, ARGV[i + 1])
  redis.call('PEXPIRE', key, lease * 2)
end
return #KEYS
"""
# KEYS: the replicas' set. ARGV: this replica's id, ms it counts for. Returns the count.
_HEARTBEAT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return redis.call('ZCARD', KEYS[1])
"""


def _codes(reply: Any) -> list[int]:
    """The admit script's reply, checked: a list of integers, its code first."""
    lengths = {0: 1, 1: 3, 2: 2}
    if (
        not isinstance(reply, list)
        or not all(isinstance(v, int) for v in reply)
        or lengths.get(reply[0] if reply else -1) != len(reply)
    ):
        raise RedisError(f"the store answered the admit script with {reply!r}")
    return reply


_SHAS: Final = {
    script: hashlib.sha1(script.encode()).hexdigest() for script in (_ADMIT, _RENEW, _HEARTBEAT)
}


class SharedLimits:
    """admit/leave of a tenant's request against the store (see the module's docstring).
    `run` (a task of the server's nursery) keeps the connection, the replica's heartbeat and
    the leases' renewal."""

    def __init__(
        self,
        config: LimitsConfig,
        url: RedisURL,
        *,
        connect: Callable[[str, int], Awaitable[trio.SocketStream]] = trio.open_tcp_stream,
    ) -> None:
        self._config = config
        self._local = LocalLimits()  # requests of tenants without limits, and the fallback
        self._connection = RedisConnection(
            url, connect_timeout=config.connect_timeout_s, connect=connect
        )
        self._prefix = config.key_prefix.encode()
        self._replica = secrets.token_hex(8)
        self._lease_ms = max(1, round(config.lease_s * 1000))
        self._leases: dict[str, bytes] = {}  # lease id -> its set's key, of running requests
        self._shares: dict[str, Tenant] = {}  # each tenant's share while the store is away
        self.replicas = 1  # as last seen in the store
        self.up = True  # the store answered last time it was asked
        self._down_until = -math.inf
        self._on_call: Callable[[float], None] = lambda seconds: None
        self._on_fallback: Callable[[str], None] = lambda reason: None
        self._on_state: Callable[[bool], None] = lambda up: None
        self._on_replicas: Callable[[int], None] = lambda count: None
        self._on_reject: OnReject = lambda reason, tenant: None

    def observe(
        self,
        *,
        on_call: Callable[[float], None],
        on_fallback: Callable[[str], None],
        on_state: Callable[[bool], None],
        on_replicas: Callable[[int], None],
        on_reject: OnReject,
    ) -> None:
        """Report the store's latency, each fallback (reason), its state (up or not), the
        replicas it counts, and each request turned away (reason, tenant name), by the store
        or by the local fallback."""
        self._on_call, self._on_fallback, self._on_state = on_call, on_fallback, on_state
        self._on_replicas, self._on_reject = on_replicas, on_reject
        self._local.observe(on_reject=on_reject)
        on_state(self.up)

    # -- per request -----------------------------------------------------------------------
    async def admit(self, tenant: Tenant) -> Ticket:
        """Admit a request of `tenant`, or raise RateLimitedError (429). Asks the store when
        the tenant has limits; local limits when it cannot (see the module's docstring)."""
        if not (tenant.requests_per_minute or tenant.max_concurrent):
            return await self._local.admit(tenant)
        now = trio.current_time()
        if now < self._down_until:
            self._on_fallback("down")
            return self._admit_locally(tenant)
        lease_id = secrets.token_hex(8) if tenant.max_concurrent else ""
        keys = self._keys(tenant)
        started = now
        reason = ""
        reply: list[int] = []
        with trio.move_on_after(self._config.timeout_s) as waited:
            try:
                reply = _codes(
                    await self._script(
                        _ADMIT,
                        keys,
                        [
                            tenant.requests_per_minute,
                            tenant.max_concurrent,
                            self._lease_ms,
                            lease_id,
                        ],
                    )
                )
            except RedisError as exc:
                reason = "error"
                self._failed(f"{exc}")
        if waited.cancelled_caught:
            reason = "timeout"
            self._failed(f"no answer within {self._config.timeout_s:g} s (limits.timeout_s)")
        if reason:
            self._on_fallback(reason)
            return self._admit_locally(tenant)
        self._on_call(trio.current_time() - started)
        self._back()
        return self._decide(tenant, reply, keys[1], lease_id)

    def leave(self, ticket: Ticket) -> None:
        """The request ended: its count given back, its lease released."""
        self._local.leave(ticket)
        if ticket.lease is not None:  # given back now; if it cannot be, it expires
            key, lease_id = ticket.lease
            self._leases.pop(lease_id, None)
            self._connection.post([["ZREM", key, lease_id]])

    def _decide(self, tenant: Tenant, reply: list[int], leases: bytes, lease_id: str) -> Ticket:
        code = reply[0]
        if code == 1:
            retry, reset = math.ceil(reply[1] / 1000), math.ceil(reply[2] / 1000)
            self._on_reject("rate_limited", tenant.name)
            raise RateLimitedError(
                f"tenant {tenant.name!r} is over its {tenant.requests_per_minute} requests per "
                "minute (across all router replicas)",
                headers=(
                    (b"retry-after", b"%d" % max(1, retry)),
                    (b"x-ratelimit-limit-requests", b"%d" % tenant.requests_per_minute),
                    (b"x-ratelimit-remaining-requests", b"0"),
                    (b"x-ratelimit-reset-requests", b"%ds" % max(1, reset)),
                ),
            )
        if code == 2:
            self._on_reject("tenant_concurrency", tenant.name)
            raise RateLimitedError(
                f"tenant {tenant.name!r} already has {reply[1]} requests in flight or "
                "queued across all router replicas (its max_concurrent)",
                code="tenant_concurrency",
                headers=((b"retry-after", b"1"),),
            )
        tenant.active += 1
        if not lease_id:
            return Ticket(tenant)
        self._leases[lease_id] = leases
        return Ticket(tenant, (leases, lease_id))

    def _admit_locally(self, tenant: Tenant) -> Ticket:
        """This replica's share of the tenant's limits: each divided by the replicas last
        seen, rounded up."""
        local = self._shares.get(tenant.name)
        if local is None:
            local = self._shares[tenant.name] = Tenant(name=tenant.name)
        rate = math.ceil(tenant.requests_per_minute / self.replicas)
        if local.requests_per_minute != rate:
            local.requests_per_minute, local.refilled_at = rate, -math.inf  # starts full
        local.max_concurrent = math.ceil(tenant.max_concurrent / self.replicas)
        return self._local.admit_nowait(local)  # left by the local share

    def _keys(self, tenant: Tenant) -> list[bytes]:
        name = tenant.name.encode()
        return [self._prefix + b"rate:" + name, self._prefix + b"leases:" + name]

    def _failed(self, why: str) -> None:
        self._down_until = trio.current_time() + self._config.retry_s
        if self.up:
            self.up = False
            self._on_state(False)
            logger.warning(
                "limit store %s: %s; local limits (each tenant's limits / %d replicas) for "
                "%g s at a time until it answers",
                self._connection.url,
                why,
                self.replicas,
                self._config.retry_s,
            )

    def _back(self) -> None:
        if not self.up:
            self.up = True
            self._on_state(True)
            logger.warning("limit store %s answers again: shared limits", self._connection.url)

    async def _script(self, script: str, keys: list[bytes], args: list[Any]) -> Any:
        """EVALSHA, loading the script first when the store does not have it."""
        sha = _SHAS[script]
        try:
            return await self._connection.call("EVALSHA", sha, len(keys), *keys, *args)
        except RedisError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self._connection.call("SCRIPT", "LOAD", script)
        return await self._connection.call("EVALSHA", sha, len(keys), *keys, *args)

    # -- the background --------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The connection's writer and reader, and the heartbeat (replicas, lease renewal)
        every third of a lease."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._connection.run)
            task_status.started()
            interval = self._config.lease_s / 3
            while True:
                with trio.move_on_after(max(self._config.timeout_s, min(interval, 5.0))):
                    try:
                        await self._heartbeat()
                    except RedisError as exc:
                        logger.debug("limit store heartbeat failed: %s", exc)
                await trio.sleep(interval)

    async def _heartbeat(self) -> None:
        ttl = self._lease_ms  # a replica counts for one lease after its last heartbeat
        count = await self._script(_HEARTBEAT, [self._prefix + b"replicas"], [self._replica, ttl])
        if not isinstance(count, int):
            raise RedisError(f"the store answered the heartbeat with {count!r}")
        self.replicas = max(1, count)
        self._on_replicas(self.replicas)
        if self._leases:
            leases = list(self._leases.items())
            await self._script(
                _RENEW, [key for _, key in leases], [self._lease_ms, *(i for i, _ in leases)]
            )
