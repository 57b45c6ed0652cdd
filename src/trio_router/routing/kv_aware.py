"""`kv_aware`: each request to the engine that already holds the longest prefix of it, as the
engines' own KV-cache events say (`kv.index.BlockIndex`), unless waiting there costs more
than prefilling it elsewhere.

For every candidate the policy counts the leading blocks of the request's token ids it holds.
A request for a LoRA adapter (a model the candidates' `/v1/models` list with a parent) counts
the blocks they hold under that adapter (`kv.index.adapter_root`, keyed by the adapter's
name, the same on every engine whatever id it has there): vLLM shares no blocks between
adapters, or between an adapter and its base model.
With `kv_cost = "ttft"` (the default) the holders of the most of the prompt with a free
sequence slot (fresh figures showing no request waiting, and this replica having sent them
since fewer requests than they had free slots, `routing.ttft`) are the only contenders while
there are any (an engine without a queue starts a request in its next step, as another
would: moving would only lose the hits). Each contender's cost is its predicted wait for the
request's first token (`routing.ttft`: its queue, the requests waiting there and those this
replica sent it since its last scrape, each at the engine's time per freed slot; this
replica's prefill backlog there; and the prefill of the tokens it does not hold, at rates
fitted from the engines' own figures); waits closer than the predictions'
error (or `kv_ttft_slack_s`) are tied, and a tie goes to the engine holding the most of the
prompt. Until the rates are fitted, and with `kv_cost = "load"`:

    cost = uncached prompt tokens + max(0, pending - cached)
           + kv_load_tokens * max(0, load - least load - kv_load_slack)

where load is the router's usual figure (in-flight requests, and the engine's own running
and waiting requests and KV-cache usage while they are fresh): small load differences cost
nothing, so replicas, which see different in-flight counts, still agree; and `pending` the
prefill this replica sent the engine that has not begun to answer (`routing.pending`), less
the prompt tokens the engine holds for this request (a prefix it is computing for an earlier
request is one this request needs anyway): at the start of a burst, before any engine has
reported a figure, it spreads new prompts over the engines not prefilling one. Either way a hot
prefix stays on its engine until waiting there costs more than prefilling it again, and then
the next engine takes it and holds it too. Remaining ties, among them every request whose
prefix no engine holds, are broken by `prefix_aware` on the request's opening: the same
engine on every replica. The blocks of each decision are counted as held by its engine for
`kv_speculative_ttl_s`, until the engine's own events say so, so that a burst of requests
with a new prefix agrees on one engine.

A request without token ids (the engines were not asked in time, or it is not a chat or
completions request) goes where the last decision on its opening's token ids for the same
model went (a bounded memory of recent openings), else where `prefix_aware` places it. Pure
and synchronous, like every policy.

With more than `EXACT_SCAN_MAX` candidates the decision touches only the engines that hold the
prompt's first block (the index's own lookup) and one engine that holds none of it: the one
`prefix_aware` places the request on (its ring and load bound), which is where the exact rule
sends an uncached prompt when loads are level, and when that one has prefill pending the next
one `prefix_aware` would pick. The cost of a decision is then the same at 20
engines as at 5,000. Ties among holders go to the holder that rendezvous hashing of the
request's opening picks, the same on every replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from ..config import RoutingConfig
from ..errors import NoEngineError
from ..kv.index import BlockIndex, adapter_root, block_keys
from ..table import Engine
from .affinity import PrefixAwarePolicy, opening_hash
from .balance import EXACT_SCAN_MAX, LoadGauge, no_engine
from .pending import Pending
from .request import Decision, RequestInfo, adapter_of, is_adapter
from .ttft import Estimate, Rates, TtftModel

__all__ = ["KvAwarePolicy", "KvTuning"]

# Predicted waits closer than this many times the predictions' recent mean absolute error are
# not told apart (about the 90th percentile of the error, were it normal).
ERROR_MARGIN: Final = 2.0
# Openings remembered with the engine their last decision chose, for requests of the same
# conversation or shared prompt whose token ids do not come in time (about 100 bytes each).
RECENT_OPENINGS: Final = 65536


@dataclass(frozen=True, slots=True, kw_only=True)
class KvTuning:
    """kv_aware's knobs: the `routing.kv_*` keys of a config (`of`)."""

    cost: str  # "ttft" (the predicted wait for a first token) or "load"
    ttft_slack_s: float  # predicted waits at least this close are tied
    load_tokens: float  # the load cost: tokens per unit of load above the floor...
    load_slack: float  # ...which is this far above the least loaded contender's load
    block_size: int  # assumed until the engines' events tell theirs
    speculative_ttl_s: float  # a decision's blocks count as held by its engine this long

    @classmethod
    def of(cls, config: RoutingConfig) -> KvTuning:
        return cls(
            cost=config.kv_cost,
            ttft_slack_s=config.kv_ttft_slack_s,
            load_tokens=config.kv_load_tokens,
            load_slack=config.kv_load_slack,
            block_size=config.kv_block_size,
            speculative_ttl_s=config.kv_speculative_ttl_s,
        )


class KvAwarePolicy:
    """See the module's docstring; `tuning`: its knobs."""

    name = "kv_aware"
    needs_request_info = True
    needs_tokens = True

    def __init__(
        self, index: BlockIndex, gauge: LoadGauge, ties: PrefixAwarePolicy, tuning: KvTuning
    ) -> None:
        self._index, self._gauge, self._ties = index, gauge, ties
        self._load_tokens, self._slack = tuning.load_tokens, tuning.load_slack
        self._block_size, self._ttl = tuning.block_size, tuning.speculative_ttl_s
        self._ttft = TtftModel() if tuning.cost == "ttft" else None
        self._ttft_slack = tuning.ttft_slack_s
        self._pending = Pending()  # the prefill each engine was sent and has not begun to answer
        # model -> (its candidates, index.block_sizes_learned, their block size)
        self._block_sizes: dict[str, tuple[Sequence[Engine], int, int]] = {}
        # The engine each recent opening's last decision on token ids chose (oldest first):
        # where a request of that opening without token ids goes.
        self._openings: OrderedDict[tuple[str, int], str] = OrderedDict()

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> Decision:
        tokens = request.tokens
        if tokens is None:
            return self._without_tokens(candidates, request, exclude)
        if len(candidates) > EXACT_SCAN_MAX:
            return self._choose_among_many(candidates, request, exclude, tokens)
        usable = [e for e in candidates if e.uid not in exclude]
        if not usable:
            raise no_engine(request.model, candidates)
        index = self._index
        block = index.block_size(e.uid for e in usable) or self._block_size
        keys = block_keys(tokens, block, parent=_root(request.model, candidates))
        now = self._gauge.now()
        matched = index.match(keys, (e.uid for e in usable), now)
        costs = self._costs(request.model, usable, matched, block, len(tokens), now)
        tied = costs.tied(usable, now)
        if len(tied) == 1:
            engine, how = tied[0], "cheapest"
        else:
            others = [e.uid for e in usable if e not in tied]
            engine = self._ties.choose(usable, request, others).engine
            how = f"{len(tied)} tied: prefix_aware"
        return self._decided(request, engine, keys, block, costs, how, now)

    def _choose_among_many(
        self,
        candidates: Sequence[Engine],
        request: RequestInfo,
        exclude: Collection[str],
        tokens: Sequence[int],
    ) -> Decision:
        """The same rule, over the engines holding the prompt's first block and the engine
        `prefix_aware` would pick among the others (see the module's docstring)."""
        index = self._index
        block = self._candidates_block_size(request.model, candidates)
        keys = block_keys(tokens, block, parent=_root(request.model, candidates))
        now = self._gauge.now()
        by_uid = self._ties.by_uid(request.model, candidates)
        holders = (
            [by_uid[uid] for uid in index.holders(keys[0], now) if uid in by_uid] if keys else []
        )
        holders = [e for e in holders if e.uid not in exclude]
        held = {e.uid for e in holders}
        fresh = self._fresh(candidates, request, _Either(exclude, held), now)
        if not fresh and not holders:
            raise no_engine(request.model, candidates)
        matched = index.match(keys, held, now) if holders else {}
        contenders = [*holders, *fresh]
        costs = self._costs(request.model, contenders, matched, block, len(tokens), now)
        tied = costs.tied(contenders, now)
        if fresh_tied := [e for e in fresh if e in tied]:
            engine = min(fresh_tied, key=lambda e: costs.by_uid[e.uid])
            how = "nothing cheaper cached: prefix_aware"
        elif len(tied) == 1:
            engine, how = tied[0], "cheapest"
        else:
            opening = request.opening or ""
            engine = max(tied, key=lambda e: opening_hash(f"{e.uid}\0{opening}"))
            how = f"{len(tied)} tied: rendezvous"
        how = f"{how}; {len(holders)} holder(s) of {len(candidates)}"
        return self._decided(request, engine, keys, block, costs, how, now)

    def _fresh(
        self,
        candidates: Sequence[Engine],
        request: RequestInfo,
        exclude: Collection[str],
        now: float,
    ) -> list[Engine]:
        """The engines holding none of the prompt that a decision among many candidates
        weighs: the one `prefix_aware` places the request on and, when that one has prefill
        pending (`routing.pending`), the next one it would (the costs choose: a burst of new
        prompts spreads over idle engines, as the exact rule spreads it)."""
        ties = self._ties
        try:
            first = ties.choose(candidates, request, exclude).engine
        except NoEngineError:
            return []
        if not self._pending.of(first.uid, now):
            return [first]
        try:
            second = ties.choose(candidates, request, _Either(exclude, (first.uid,))).engine
        except NoEngineError:
            return [first]
        return [first, second]

    def _without_tokens(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str]
    ) -> Decision:
        """A request whose token ids are not known: to the engine the last decision for its
        opening chose (it holds what the conversation or shared prompt left there), if it is
        still a candidate; else where `prefix_aware` places it."""
        if request.opening and (uid := self._openings.get(_opening_key(request))):
            engine = self._ties.by_uid(request.model, candidates).get(uid)
            if engine is not None and uid not in exclude:
                return Decision(engine, "kv_aware: no tokens; where its opening last went")
        tie = self._ties.choose(candidates, request, exclude)
        return Decision(tie.engine, f"kv_aware: no tokens; {tie.reason}")

    def _remember(self, request: RequestInfo, engine: Engine) -> None:
        """`engine` is where the request's opening last went (`RECENT_OPENINGS` kept)."""
        if not request.opening:
            return
        key = _opening_key(request)
        openings = self._openings
        openings[key] = engine.uid
        openings.move_to_end(key)
        if len(openings) > RECENT_OPENINGS:
            openings.popitem(last=False)

    def _costs(
        self,
        model_name: str,
        contenders: Sequence[Engine],
        matched: dict[str, int],
        block: int,
        prompt: int,
        now: float,
    ) -> _Costs:
        """Each contender's cost: its predicted wait for a first token, in seconds, once the
        engines' figures have fitted their prefill times (`routing.ttft`); else, and with
        `kv_cost = "load"`, uncached tokens plus the load term (see the module's
        docstring)."""
        model = self._ttft
        keep = model is not None  # the time cost: a holder without a queue keeps its prompt
        if model is not None:  # adapters run on their base model's weights: one fit
            model_name = adapter_of(model_name, contenders[0]) or model_name
        rates = model.rates(model_name, contenders) if model is not None else None
        if model is not None and rates is not None:
            estimates = {
                e.uid: model.estimate(e, prompt - matched.get(e.uid, 0) * block, now, rates)
                for e in contenders
            }
            by_uid = {uid: estimate.seconds for uid, estimate in estimates.items()}
            tolerance = max(self._ttft_slack, ERROR_MARGIN * model.error(model_name))
            return _Costs(by_uid, tolerance, prompt, matched, keep, estimates, rates, model_name)
        load_of, pending = self._gauge.of, self._pending.of
        loads = {e.uid: load_of(e, now) for e in contenders}
        floor = min(loads.values()) + self._slack
        by_uid = {}
        for e in contenders:
            cached = min(prompt, matched.get(e.uid, 0) * block)
            # the prefill sent there and not begun to answer, beyond this prompt's own prefix
            # (which a holder may be computing: the request waits for that anywhere)
            ahead = max(0, pending(e.uid, now) - cached)
            load = self._load_tokens * max(0.0, loads[e.uid] - floor)
            by_uid[e.uid] = prompt - cached + ahead + load
        queued = model.queued if model is not None else _never
        return _Costs(by_uid, 0.0, prompt, matched, keep, loads=loads, queued=queued)

    def _decided(
        self,
        request: RequestInfo,
        engine: Engine,
        keys: Sequence[int],
        block: int,
        costs: _Costs,
        how: str,
        now: float,
    ) -> Decision:
        """The decision for `engine`: the prompt's blocks (`keys`) are counted as held there
        from now on (speculatively, until its events say so), with the time cost the prefill
        it was sent counts in its backlog, and its opening remembered as gone there."""
        self._index.speculate(engine.uid, keys, now=now, until=now + self._ttl)
        self._remember(request, engine)
        blocks = costs.matched.get(engine.uid, 0)
        prompt = costs.prompt
        cached = min(blocks * block, prompt)
        started = self._pending.add(engine.uid, prompt - cached, now=now, until=now + self._ttl)
        estimate = costs.estimates.get(engine.uid)
        if estimate is not None and self._ttft is not None and costs.rates is not None:
            self._ttft.sent(engine, prompt - cached, now, costs.rates)
            figure = (
                f"first token in {estimate.seconds * 1000:.0f} ms predicted (queue "
                f"{estimate.queue * 1000:.0f}, backlog {estimate.backlog * 1000:.0f}, prefill "
                f"{estimate.prefill * 1000:.0f}; others within "
                f"{costs.tolerance * 1000:.0f} ms are tied)"
            )
        else:
            figure = f"load {costs.loads[engine.uid]:.3g}"
        return Decision(
            engine,
            f"kv_aware: {blocks}/{len(keys)} blocks of {block} cached, {figure} ({how})",
            cached_tokens=cached,
            prompt_tokens=prompt,
            predicted_ttft=None if estimate is None else estimate.seconds,
            observe_ttft=(
                None
                if estimate is None or self._ttft is None
                else partial(self._ttft.observed, costs.model)
            ),
            started=started,
        )

    def _candidates_block_size(self, model: str, candidates: Sequence[Engine]) -> int:
        """The block size the candidates report (the first known), looked up once per
        candidates sequence and block size the index learns."""
        learned = self._index.block_sizes_learned
        cached = self._block_sizes.get(model)
        if cached is not None and cached[0] is candidates and cached[1] == learned:
            return cached[2]
        size = self._index.block_size(e.uid for e in candidates) or self._block_size
        self._block_sizes[model] = (candidates, learned, size)
        return size

    def cached_share(self, engine: Engine, tokens: Sequence[int], model: str) -> float:
        """The share of the prompt `tokens` for `model` whose leading blocks `engine` holds
        (0..1); an adapter's, under that adapter."""
        if not tokens:
            return 0.0
        block = self._index.block_size([engine.uid]) or self._block_size
        keys = block_keys(tokens, block, parent=_root(model, [engine]))
        if not keys:
            return 0.0
        matched = self._index.match(keys, [engine.uid], self._gauge.now())[engine.uid]
        return matched / len(keys)

    def forget(self, uid: str) -> None:
        self._ties.forget(uid)
        self._pending.forget(uid)
        if self._ttft is not None:
            self._ttft.forget(uid)


def _never(uid: str) -> bool:
    """No engine is known to queue (`kv_cost = "load"`: no scrapes are learned from)."""
    return False


def _root(model: str, candidates: Sequence[Engine]) -> int:
    """The parent key of the first block of a request for `model` among `candidates`: the
    adapter's root when `model` is a LoRA adapter there, else the base model's."""
    return adapter_root(model if is_adapter(model, candidates) else None)


def _opening_key(request: RequestInfo) -> tuple[str, int]:
    """The request's opening, for the model it names, as the memory of recent openings keys
    it: one adapter's conversation holds nothing of another's, nor of the base model's."""
    assert request.opening is not None
    return request.model, opening_hash(request.opening)


@dataclass(frozen=True, slots=True)
class _Costs:
    """The contenders' costs, by uid, and what the decision reports of them. Costs within
    `tolerance` of the cheapest are tied. With the time cost (`keep_holders`), a holder of the
    most of the prompt with a free slot keeps it."""

    by_uid: dict[str, float]
    tolerance: float
    prompt: int
    matched: dict[str, int]  # leading blocks of the prompt each contender holds
    keep_holders: bool  # the time cost's rule for holders without a queue applies
    estimates: dict[str, Estimate] = field(default_factory=dict)  # the time cost's parts
    rates: Rates | None = None  # the time cost's fitted rates
    model: str = ""  # ...of this model
    loads: dict[str, float] = field(default_factory=dict)  # the load cost's loads
    # before the fit: whether an engine's last two scrapes showed a queue (by uid)
    queued: Callable[[str], bool] = _never

    def tied(self, contenders: Sequence[Engine], now: float) -> list[Engine]:
        """The contenders within `tolerance` of the cheapest; with the time cost, of those,
        the ones holding the most of the prompt (the model cannot tell their waits apart:
        keep the cache hits). With the time cost, only the holders of the most of the prompt
        with a free slot (`Estimate.free`; before the fit, fresh figures, not the second in
        a row to show requests waiting) contend, if there are any: an engine without a
        queue takes a request into its next step, as any other engine would, so leaving it
        would only lose the hits (docs/routing.md, "When a hot prefix moves")."""
        matched, by_uid, estimates = self.matched, self.by_uid, self.estimates
        if self.keep_holders and (most := max(matched.get(e.uid, 0) for e in contenders)):
            free = [
                e
                for e in contenders
                if matched.get(e.uid, 0) == most
                and (
                    estimates[e.uid].free
                    if estimates
                    else e.stats.fresh(now) and not self.queued(e.uid)
                )
            ]
            contenders = free or contenders
        best = min(by_uid[e.uid] for e in contenders)
        tied = [e for e in contenders if by_uid[e.uid] <= best + self.tolerance]
        if estimates:
            most = max(matched.get(e.uid, 0) for e in tied)
            tied = [e for e in tied if matched.get(e.uid, 0) == most]
        return tied


class _Either(Collection[str]):
    """The union of two collections of uids, without copying either (membership only)."""

    def __init__(self, first: Collection[str], second: Collection[str]) -> None:
        self._first, self._second = first, second

    def __contains__(self, uid: object) -> bool:
        return uid in self._first or uid in self._second

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (uid for uid in self._second if uid not in self._first)

    def __len__(self) -> int:
        return sum(1 for _ in self)
