"""The prefill each engine has been sent by this replica and has not begun to answer, in
prompt tokens, for `kv_aware` (docs/routing.md, "A burst of new prompts").

A request's uncached prompt tokens are pending on its engine from the decision until the
answer's first bytes reach the client (`Pending.add`'s release, which the serving path calls
then), or until `until`, whichever comes first: an attempt that fails before its first byte,
or an answer taken apart from the client (a prefill step), is not released, so every entry
ends by itself. Before the engines' figures have fitted their prefill times (`routing.ttft`)
these tokens are the only sign of an engine busy with a long prefill: a burst of requests for
new prompts arrives before any engine reports one, and its in-flight counts are level.

Pure and synchronous; memory: an entry per request awaiting its first byte, and a heap item
per decision of the last `until - now` (each decision's span), dropped once past its end
(every call drops those first).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

__all__ = ["Pending"]


@dataclass(slots=True)
class Pending:
    """Per engine uid: the tokens of its pending requests (see the module's docstring)."""

    _tokens: dict[str, int] = field(default_factory=dict)  # uid -> their sum (> 0)
    _entries: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (uid, tokens)
    _ends: list[tuple[float, int]] = field(default_factory=list)  # (until, id), a heap
    _ids: count[int] = field(default_factory=count)

    def add(self, uid: str, tokens: int, *, now: float, until: float) -> Callable[[], None]:
        """`tokens` to prefill were sent to `uid`: pending until the returned release is
        called (once or more: only the first counts) or until `until`."""
        self._prune(now)
        if tokens <= 0:
            return _nothing
        entry = next(self._ids)
        self._entries[entry] = (uid, tokens)
        self._tokens[uid] = self._tokens.get(uid, 0) + tokens
        heapq.heappush(self._ends, (until, entry))
        return lambda: self._end(entry)

    def of(self, uid: str, now: float) -> int:
        """The tokens pending on `uid` at `now`."""
        self._prune(now)
        return self._tokens.get(uid, 0)

    def forget(self, uid: str) -> None:
        """`uid` is gone: its entries count no more."""
        self._tokens.pop(uid, None)
        for entry in [e for e, (owner, _) in self._entries.items() if owner == uid]:
            del self._entries[entry]

    def _end(self, entry: int) -> None:
        found = self._entries.pop(entry, None)
        if found is None:
            return
        uid, tokens = found
        left = self._tokens.get(uid, 0) - tokens
        if left > 0:
            self._tokens[uid] = left
        else:
            self._tokens.pop(uid, None)

    def _prune(self, now: float) -> None:
        ends = self._ends
        while ends and ends[0][0] <= now:
            self._end(heapq.heappop(ends)[1])


def _nothing() -> None:
    """The release of an entry of no tokens."""
