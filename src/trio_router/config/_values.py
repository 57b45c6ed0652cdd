"""Checks every config section uses, and secrets read from the environment."""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import ConfigError


def positive(where: str, **values: float) -> None:
    """Each of `values` must be > 0; the error names `where`.key and the value."""
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{where}.{key} must be > 0, got {value!r}")


def check_choice(value: object, allowed: Iterable[str], where: str) -> None:
    """`value` must be one of `allowed` (a `Literal` type's arguments); the error names the
    key `where` and every allowed value."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{where} must be one of {allowed}, got {value!r}")


def check_zmq_endpoint(endpoint: str, where: str) -> None:
    """`endpoint` is "" (none) or a ZMQ endpoint, tcp://HOST:PORT or ipc://PATH."""
    if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{where} must be a ZMQ endpoint (tcp://HOST:PORT), got {endpoint!r}")


def env_key(env_var: str, where: str) -> str:
    """The secret held in the environment variable `env_var` ("" if the setting `where` is
    off); ConfigError if it is unset or empty."""
    if not env_var:
        return ""
    value = os.environ.get(env_var, "")
    if not value:
        raise ConfigError(
            f"{where} names the environment variable {env_var!r}, "
            "which is unset or empty; export it or clear the setting"
        )
    return value
