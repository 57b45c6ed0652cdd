"""`kv_aware`: each request to the engine that already holds the longest prefix of it, as the
engines' own KV-cache events say (`kv.index.BlockIndex`), balanced against load.

For every candidate the policy counts the leading blocks of the request's token ids it holds,
and takes the cheapest by

    cost = uncached prompt tokens + kv_load_tokens * max(0, load - least load - kv_load_slack)

where load is the router's usual figure (in-flight requests, and the engine's own running
and waiting requests and KV-cache usage while they are fresh). Small load differences cost
nothing, so replicas, which see different in-flight counts, still agree; a hot prefix stays
on its engine until that engine is busier than the others by more than the slack, and then
spreads by what it costs to prefill it again. Ties, among them every request whose prefix no
engine holds, are broken by `prefix_aware` on the request's opening: the same engine on every
replica. The blocks of each decision are counted as held by its engine for
`kv_speculative_ttl_s`, until the engine's own events say so, so that a burst of requests
with a new prefix agrees on one engine.

A request without token ids (the engines were not asked in time, or it is not a chat or
completions request) is routed by `prefix_aware`. Pure and synchronous, like every policy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..kv.index import BlockIndex, block_keys
from ..table import Engine
from .affinity import PrefixAwarePolicy
from .balance import LoadGauge, no_engine
from .request import Decision, RequestInfo

__all__ = ["KvAwarePolicy"]


class KvAwarePolicy:
    """See the module's docstring."""

    name = "kv_aware"
    needs_request_info = True
    needs_tokens = True

    def __init__(
        self,
        index: BlockIndex,
        gauge: LoadGauge,
        ties: PrefixAwarePolicy,
        *,
        load_tokens: float,
        slack: float,
        block_size: int,
        speculative_ttl: float,
    ) -> None:
        self._index, self._gauge, self._ties = index, gauge, ties
        self._load_tokens, self._slack = load_tokens, slack
        self._block_size, self._ttl = block_size, speculative_ttl

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> Decision:
        tokens = request.tokens
        if tokens is None:
            tie = self._ties.choose(candidates, request, exclude)
            return Decision(tie.engine, f"kv_aware: no tokens; {tie.reason}")
        usable = [e for e in candidates if e.uid not in exclude]
        if not usable:
            raise no_engine(request.model, candidates)
        index = self._index
        block = index.block_size(e.uid for e in usable) or self._block_size
        keys = block_keys(tokens, block)
        now = self._gauge.now()
        matched = index.match(keys, (e.uid for e in usable), now)
        load_of = self._gauge.of
        loads = {e.uid: load_of(e, now) for e in usable}
        floor = min(loads.values()) + self._slack
        prompt = len(tokens)
        costs = {
            uid: prompt - matched[uid] * block + self._load_tokens * max(0.0, load - floor)
            for uid, load in loads.items()
        }
        best = min(costs.values())
        tied = {uid for uid, cost in costs.items() if cost == best}
        if len(tied) == 1:
            (uid,) = tied
            engine = next(e for e in usable if e.uid == uid)
            how = "cheapest"
        else:
            engine = self._ties.choose(
                usable, request, [e.uid for e in usable if e.uid not in tied]
            ).engine
            how = f"{len(tied)} tied: prefix_aware"
        blocks = matched[engine.uid]
        index.speculate(engine.uid, keys, now=now, until=now + self._ttl)
        return Decision(
            engine,
            f"kv_aware: {blocks}/{len(keys)} blocks of {block} cached, load "
            f"{loads[engine.uid]:.3g} ({how})",
            cached_tokens=min(blocks * block, prompt),
            prompt_tokens=prompt,
        )

    def cached_share(self, engine: Engine, tokens: Sequence[int]) -> float:
        """The share of the prompt `tokens` whose leading blocks `engine` holds (0..1)."""
        if not tokens:
            return 0.0
        block = self._index.block_size([engine.uid]) or self._block_size
        keys = block_keys(tokens, block)
        if not keys:
            return 0.0
        matched = self._index.match(keys, [engine.uid], self._gauge.now())[engine.uid]
        return matched / len(keys)

    def forget(self, uid: str) -> None:
        self._ties.forget(uid)
