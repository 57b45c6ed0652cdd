"""Tenants: who a request is (its client key), and each tenant's limits and live state.

- **Keys.** With `[[tenants]]`, a request needs one of their keys (each read from its
  `key_env`), or `server.api_key_env`'s key, which makes it the anonymous tenant's; with only
  `server.api_key_env`, that key; with neither, no key. Keys are compared in constant time.
- **State.** Each tenant keeps its local token bucket and its count of requests in flight or
  queued (`active`) across reloads; a tenant whose rate changed starts with a full bucket.
  What the limits do with them is `local` (and `shared`, across replicas).

Everything here is synchronous, on the Trio thread.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Final

from ..config import Config, TenantConfig, env_key
from ..errors import AuthError, ConfigError

__all__ = ["ANONYMOUS", "ClientKeys", "Tenant", "Tenants", "client_keys"]

ANONYMOUS: Final = ""  # the tenant of requests when no tenants are configured


@dataclass(eq=False)
class Tenant:
    """One tenant's limits and live state (compared by identity: a reload keeps the object)."""

    name: str
    weight: int = 1  # share of the fair queue's dispatches
    requests_per_minute: int = 0  # 0: unlimited
    max_concurrent: int = 0  # in flight + queued; 0: unlimited
    tokens: float = 0.0  # the local bucket: requests left of the rate
    refilled_at: float = -math.inf  # when the bucket was last refilled (-inf: never; full)
    active: int = 0  # requests in flight or queued
    priority: int = 0  # its band in the router's queue
    ttft_deadline_s: float = 0.0  # its requests' default first-token deadline; 0: none

    def configure(self, config: TenantConfig) -> None:
        """Take the limits of `config`; a changed rate starts with a full bucket."""
        if config.requests_per_minute != self.requests_per_minute:
            self.tokens = float(config.requests_per_minute)  # a new rate starts full
        self.weight = config.weight
        self.requests_per_minute = config.requests_per_minute
        self.max_concurrent = config.max_concurrent
        self.priority = config.priority
        self.ttft_deadline_s = config.ttft_deadline_ms / 1000


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """The keys clients of one config authenticate with, as read from the environment."""

    server: bytes | None  # `server.api_key_env`'s key (the anonymous tenant's), or None
    tenants: tuple[tuple[bytes, str], ...]  # (key, tenant name) of each of `[[tenants]]`


def client_keys(config: Config) -> ClientKeys:
    """The client keys `config` names. Raises ConfigError naming the variable when one is
    unset or empty, or when two tenants have the same key; a config that passed this check
    configures `Tenants` without error (while the environment stays as it is)."""
    server = env_key(config.server.api_key_env, "server.api_key_env")
    names: dict[str, str] = {}  # key -> tenant name
    for tenant in config.tenants:
        key = env_key(tenant.key_env, f"tenants[{tenant.name!r}].key_env")
        if key in names:
            raise ConfigError(f"tenants {names[key]!r} and {tenant.name!r} have the same key")
        names[key] = tenant.name
    return ClientKeys(
        server=server.encode() if server else None,
        tenants=tuple((key.encode(), name) for key, name in names.items()),
    )


class Tenants:
    """The configured tenants, their keys and the anonymous tenant of one router process.
    Built from a config and reconfigured on every reload (`configure`)."""

    def __init__(self, config: Config) -> None:
        self._tenants: dict[str, Tenant] = {}
        self._anonymous = Tenant(name=ANONYMOUS)
        self._server_key: bytes | None = None
        self._keys: tuple[tuple[bytes, str], ...] = ()
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take the tenants and keys of `config` (at start and on reload). Tenants that
        remain keep their state (a changed rate starts full); requests of removed tenants
        keep going. Raises ConfigError only for a config `client_keys` refuses."""
        keys = client_keys(config)
        old, self._tenants = self._tenants, {}
        for tenant_config in config.tenants:
            tenant = old.get(tenant_config.name) or Tenant(name=tenant_config.name)
            tenant.configure(tenant_config)
            self._tenants[tenant.name] = tenant
        self._anonymous.priority = config.admission.priority
        self._anonymous.ttft_deadline_s = config.admission.ttft_deadline_ms / 1000
        self._server_key, self._keys = keys.server, keys.tenants

    @property
    def configured(self) -> bool:
        """Whether the config has `[[tenants]]`."""
        return bool(self._tenants)

    @property
    def anonymous(self) -> Tenant:
        """The tenant of requests that no tenant's key names."""
        return self._anonymous

    def authenticate(self, authorization: bytes | None) -> Tenant:
        """The tenant a request's `Authorization` value belongs to (see the module's
        docstring); AuthError when its key is missing or not one of them."""
        server_key = self._server_key
        if self._tenants:
            token = _bearer(authorization)
            if (tenant := self._tenant_of(token)) is not None:
                return tenant
            if server_key is None or not hmac.compare_digest(token, server_key):
                raise AuthError("invalid API key")
        elif server_key is not None and not hmac.compare_digest(_bearer(authorization), server_key):
            raise AuthError("invalid API key")
        return self._anonymous

    def _tenant_of(self, token: bytes) -> Tenant | None:
        """The tenant whose key `token` is, or None; every key is compared, in constant
        time, whichever matches."""
        found = None
        for key, name in self._keys:
            if hmac.compare_digest(key, token):
                found = name
        return self._tenants.get(found) if found is not None else None


def _bearer(authorization: bytes | None) -> bytes:
    """The token of "Bearer <token>"; AuthError if there is none."""
    if authorization is None:
        raise AuthError("missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        raise AuthError("invalid API key")
    return token.strip()
