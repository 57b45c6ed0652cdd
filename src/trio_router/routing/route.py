"""How a routing step chooses its engines: `Route`, a policy and the engines of a model it may
choose from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..table import Engine
from .disaggregation import Roles
from .policy import Policy

__all__ = ["Route"]


@dataclass(frozen=True, slots=True)
class Route:
    """How a step chooses its engines: `policy` among the engines of the model `among`
    allows (None: all of them). `phase` "prefill": the prefill step's engine, which is not
    one of the request's attempts."""

    policy: Policy
    among: Callable[[Roles], Sequence[Engine]] | None = None
    phase: str = ""
