"""Tenant fairness in the router's queue: which line of a band is served next, and whose
waiting request gives way when the queue is full.

- **Lines.** A band's waiting requests stand in lines: with `admission.fairness = "tenant"`
  one line per tenant, with `"none"` one line for all (`FIFO`). What order a line keeps
  (earliest deadline first, then arrival) is the queue's (`ordering`); which line goes next
  is this module's.
- **Turns by weight.** Dispatches go round robin across a band's lines, weighted by their
  tenant's `weight` (stride scheduling): each line has a pass that grows by 1/weight per
  dispatch in that band, and the line with the lowest pass goes next. A line that forms
  starts at the band's last dispatched pass, never below: no credit for time spent idle. A
  tenant's backlog then delays another tenant's next request by about one dispatch at most.
  Passes are kept per band for all models' queues, as long as the tenant is (a reload keeps
  the tenants that remain), and dropped with it.
- **Making room.** When the queue is full, a request of a band higher than the lowest band
  waiting takes the place of the newest waiting request of that lowest band (shed); in the
  lowest band itself, with fairness, it takes the place of the newest request of the tenant
  with the most waiting in that band when that tenant has more than one more than the
  newcomer's own (queue_full). `Fairness` keeps every model's waiting requests by band and
  tenant for that choice; the queue evicts the one it names.

Everything here is synchronous bookkeeping on the Trio thread.
"""

from __future__ import annotations

import math
from typing import Final, Generic, Literal, Protocol, TypeVar
from weakref import WeakKeyDictionary

from ...limits.tenants import Tenant

__all__ = ["FIFO", "Fairness", "Queued", "discard"]

FIFO: Final = Tenant(name="(fifo)")  # the one line of a band when fairness is "none"


class Queued(Protocol):
    """What fairness reads of a waiting request."""

    @property
    def tenant(self) -> Tenant: ...

    @property
    def priority(self) -> int: ...  # its band

    @property
    def queued_at(self) -> float: ...


Q = TypeVar("Q", bound=Queued)
Why = Literal["shed", "queue_full"]  # why a waiting request gives way: its refusal's code

# Each line's pass in one band: grows by 1/weight per dispatch in that band (see above).
Passes = WeakKeyDictionary[Tenant, float]


def discard(index: dict[int, dict[Tenant, list[Q]]], band: int, key: Tenant, item: Q) -> None:
    """Take `item` out of `index[band][key]`, and the entries it leaves empty."""
    lines = index.get(band, {})
    line = lines.get(key)
    if line is not None and item in line:
        line.remove(item)
        if not line:
            del lines[key]
            if not lines:
                del index[band]


class Fairness(Generic[Q]):
    """Which line goes next in a band, and which waiting request gives way to a newcomer
    when the queue is full (see the module's docstring). `fair`: lines by tenant (True) or
    one line per band (False); a change applies to requests that join from then on."""

    def __init__(self, *, fair: bool = True) -> None:
        self.fair = fair
        self._passes: dict[int, Passes] = {}  # by band
        # Every model's waiting requests by band, then tenant, oldest first.
        self._waiting: dict[int, dict[Tenant, list[Q]]] = {}

    # -- turns ---------------------------------------------------------------------------
    def line(self, tenant: Tenant) -> Tenant:
        """The line a request of `tenant` joins in its band: its tenant's, or FIFO."""
        return tenant if self.fair else FIFO

    def opened(self, band: int, key: Tenant, clock: float) -> None:
        """Line `key` formed in `band` of a queue whose last dispatch there had pass
        `clock`: it starts there, or where it was if further on (no credit for idle time)."""
        passes = self._passes.setdefault(band, WeakKeyDictionary())
        passes[key] = max(passes.get(key, 0.0), clock)

    def next_line(self, band: int, lines: dict[Tenant, list[Q]]) -> Tenant:
        """Which of `band`'s `lines` (none empty) is served next: the lowest pass."""
        return min(lines, key=self._passes[band].__getitem__)

    def served(self, band: int, key: Tenant) -> float:
        """Line `key` of `band` had a dispatch: its pass moves on by 1/weight. The new
        pass, the band's clock in that queue from now on."""
        passes = self._passes[band]
        passes[key] = moved = passes[key] + 1.0 / key.weight
        return moved

    @staticmethod
    def turns(key: Tenant, other: Tenant, before: int) -> int:
        """About how many of line `other`'s requests go before the one that has `before`
        requests ahead of it in line `key` of the same band, turns going by weight."""
        return math.ceil((before + 1) * other.weight / key.weight)

    # -- making room ---------------------------------------------------------------------
    def joined(self, item: Q) -> None:
        """`item` waits now."""
        self._waiting.setdefault(item.priority, {}).setdefault(item.tenant, []).append(item)

    def left(self, item: Q) -> None:
        """`item` waits no more (dispatched, turned away, evicted, cancelled)."""
        discard(self._waiting, item.priority, item.tenant, item)

    def victim(self, tenant: Tenant, priority: int) -> tuple[Q, Why] | None:
        """The queue is full and a request of `tenant` in band `priority` comes: the waiting
        request that gives way to it and why (see the module's docstring), or None when
        none does."""
        lowest = min(self._waiting, default=None)
        if lowest is None or lowest > priority:
            return None
        tenants = self._waiting[lowest]
        if lowest < priority:  # the newest request of the lowest band
            newest = max((line[-1] for line in tenants.values()), key=lambda w: w.queued_at)
            return newest, "shed"
        if not self.fair:
            return None
        mine = len(tenants.get(tenant, ()))
        biggest = max(tenants, key=lambda t: len(tenants[t]))
        if biggest is tenant or len(tenants[biggest]) <= mine + 1:
            return None
        return tenants[biggest][-1], "queue_full"
