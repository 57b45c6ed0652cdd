"""kv_aware's time cost (`routing.ttft`): the fit of an engine's prefill time from its own
counters, the predicted wait on made-up engine states (a hot engine with a queue loses to a
cold one exactly when the numbers say it should), the queue for a sequence slot (the
requests waiting and those sent since the scrape, at the engine's time per freed slot), a hot
prefix replicated when its holder's backlog or queue exceeds prefilling it elsewhere, and the
learning end to end on the autojump clock: a scraper reading an engine whose counters grow as
a known prefill time says."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import partial
from typing import Final

import pytest
import trio
import trio.testing

from trio_router.config import RoutingConfig, StatsConfig, parse_config
from trio_router.discovery.stats import parse_vllm_metrics, run_stats_scraper
from trio_router.emulator.engine import EmulatedEngine, EngineConfig, SamplingParams
from trio_router.emulator.profiles import load_profile
from trio_router.errors import ConfigError
from trio_router.http import UpstreamPool
from trio_router.kv.index import BlockIndex, block_keys
from trio_router.routing.policy import Policy, make_policy
from trio_router.routing.request import Decision, RequestInfo
from trio_router.routing.ttft import TtftModel
from trio_router.table import Engine, EngineState, EngineStats, Model, RoutingTable
from trio_router.testing.fake_network import FakeNetwork, FakeReply, FakeRequest

MODEL: Final = "m"
BLOCK: Final = 16
BASE: Final = 0.05  # seconds from leaving the queue to a first token, whatever the prompt...
PER_TOKEN: Final = 0.001  # ...plus this per token prefilled
SLACK: Final = 0.05  # routing.kv_ttft_slack_s


@dataclass
class Counters:
    """An engine's cumulative counters, grown by `serve` as a prefill time of `base +
    per_token * tokens` per request says (each after `queue` seconds in its queue)."""

    base: float = BASE
    per_token: float = PER_TOKEN
    prompt: float = 0.0
    hits: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    queue_sum: float = 0.0
    queue_count: float = 0.0
    waiting: float = 0.0
    running: float = 1.0
    finished: float = 0.0  # exported once a request finished (`finish`)

    def serve(self, sizes: list[tuple[int, int]], queue: float = 0.0) -> None:
        """Requests of (prompt tokens, of which cached) got their first token."""
        for prompt, cached in sizes:
            self.prompt += prompt
            self.hits += cached
            self.ttft_sum += queue + self.base + self.per_token * (prompt - cached)
            self.ttft_count += 1
            self.queue_sum += queue
            self.queue_count += 1

    def text(self) -> str:
        e2e = [("vllm:e2e_request_latency_seconds_count", self.finished)] if self.finished else []
        return "".join(
            f"{name} {value!r}\n"
            for name, value in (
                *e2e,
                ("vllm:num_requests_running", self.running),
                ("vllm:num_requests_waiting", self.waiting),
                ("vllm:prompt_tokens_total", self.prompt),
                ("vllm:prefix_cache_hits_total", self.hits),
                ("vllm:prefix_cache_queries_total", self.prompt),
                ("vllm:time_to_first_token_seconds_sum", self.ttft_sum),
                ("vllm:time_to_first_token_seconds_count", self.ttft_count),
                ("vllm:request_queue_time_seconds_sum", self.queue_sum),
                ("vllm:request_queue_time_seconds_count", self.queue_count),
            )
        )

    def stats(self, now: float) -> EngineStats:
        return EngineStats.scraped(parse_vllm_metrics(self.text()), now=now, stale_after=15.0)


# Intervals of mixed sizes: (prompt tokens, cached) per request.
MIXES: Final = (
    [(400, 0)] * 4,
    [(1000, 0), (3000, 2000)] * 2,
    [(80, 0)] * 8,
    [(2000, 0), (600, 500), (1200, 0)],
    [(5000, 4800)] * 3 + [(900, 0)],
)


def make_engine(i: int) -> Engine:
    return Engine(
        uid=f"uid-{i}",
        name=f"engine-{i}",
        url=f"http://10.0.0.{i + 1}:8000",
        state=EngineState.ROUTABLE,
        models=(Model(MODEL),),
        model_ids=frozenset({MODEL}),
    )


def fit(engine: Engine, counters: Counters, now: float, model: TtftModel | Policy) -> None:
    """`engine` scraped after each interval of MIXES (twice over), the model looking each
    time (for a policy: a decision of a one-block request)."""

    def look() -> None:
        if isinstance(model, TtftModel):
            model.rates(MODEL, [engine])
        else:
            model.choose([engine], RequestInfo(MODEL, opening="x", tokens=(1,) * BLOCK))

    engine.stats = counters.stats(now)
    look()
    for mix in (*MIXES, *MIXES):
        counters.serve(mix)
        engine.stats = counters.stats(now)
        look()


def test_the_fit_recovers_an_engines_prefill_time_from_its_counters() -> None:
    model, engine, counters = TtftModel(), make_engine(0), Counters()
    assert model.rates(MODEL, [engine]) is None  # not scraped: nothing to go on
    fit(engine, counters, 1000.0, model)
    rates = model.rates(MODEL, [engine])
    assert rates is not None
    assert rates.base == pytest.approx(BASE) and rates.per_token == pytest.approx(PER_TOKEN)
    # A request that prefills 1,000 tokens there: nothing queued, no backlog.
    estimate = model.estimate(engine, 1000, 1000.0, rates)
    assert estimate.seconds == pytest.approx(BASE + 1.0) and estimate.queue == 0.0
    # Requests all of one size do not tell the two rates apart: one rate is fitted.
    alike, engine, counters = TtftModel(), make_engine(1), Counters()
    engine.stats = counters.stats(0.0)
    alike.rates(MODEL, [engine])
    for _ in range(5):
        counters.serve([(500, 0)] * 4)
        engine.stats = counters.stats(0.0)
        alike.rates(MODEL, [engine])
    one = alike.rates(MODEL, [engine])
    assert one is not None
    assert one.base + one.per_token * 500 == pytest.approx(BASE + PER_TOKEN * 500)


def test_a_restarted_engine_and_missing_counters_teach_nothing() -> None:
    model, engine, counters = TtftModel(), make_engine(0), Counters(per_token=0.002)
    fit(engine, counters, 0.0, model)
    before = model.rates(MODEL, [engine])
    engine.stats = Counters().stats(1.0)  # restarted: every counter went back to 0
    model.rates(MODEL, [engine])
    engine.stats = EngineStats.scraped({"running": 1.0}, now=2.0, stale_after=15.0)
    assert model.rates(MODEL, [engine]) == before  # an engine that exports no histograms
    assert before is not None and before.per_token == pytest.approx(0.002)


def kv_policy(clock: list[float], index: BlockIndex, **knobs: object) -> Policy:
    config = RoutingConfig(policy="kv_aware", kv_block_size=BLOCK, **knobs)  # type: ignore[arg-type]
    return make_policy(config, clock=lambda: clock[0], rng=random.Random(1), kv_index=index)


def test_a_hot_engine_with_a_queue_loses_to_a_cold_one_exactly_when_it_costs_more() -> None:
    """The holder of a 1,024-token prefix waits 50 + 32 ms for the 32 tokens it lacks; a
    cold engine 50 + 1,056 ms for all of them. A queue at the holder (its recent requests'
    mean wait while it reports requests waiting) moves the request only once the holder's
    total exceeds the cold engine's by more than the slack (50 ms); within it, the two are
    tied, and a tie keeps the cache hits."""
    clock, index = [1000.0], BlockIndex()
    policy = kv_policy(clock, index)
    hot, cold = make_engine(0), make_engine(1)
    counters = {hot.uid: Counters(), cold.uid: Counters()}
    for engine in (hot, cold):
        fit(engine, counters[engine.uid], clock[0], policy)
    tokens = tuple(range(1024 + 32))
    request = RequestInfo(MODEL, opening="agent", tokens=tokens)
    cold_cost = BASE + PER_TOKEN * len(tokens)
    hot_cost = BASE + PER_TOKEN * 32

    def decide(queue: float) -> tuple[str, str]:
        """The decision with the holder's queue at `queue` seconds a request (no backlog:
        each decision at a later time than the last one's backlog)."""
        clock[0] += 100
        # Held, as its events say (a decision's own speculation expires in 2 s).
        index.speculate(hot.uid, block_keys(tokens, BLOCK)[:64], now=clock[0], until=math.inf)
        hot_counters = counters[hot.uid]
        hot_counters.waiting = 3
        hot_counters.serve([(100, 0)] * 4, queue=queue)  # its recent requests' queue time
        hot.stats = hot_counters.stats(clock[0])
        decision = policy.choose([hot, cold], request)
        return decision.engine.uid, decision.reason

    assert decide(0.0)[0] == hot.uid
    # Just under the cold engine's cost: still the holder's.
    assert decide(cold_cost - hot_cost - 0.06)[0] == hot.uid
    # Dearer, but within the slack: tied, and the holder keeps it.
    assert decide(cold_cost - hot_cost + SLACK - 0.01)[0] == hot.uid
    # Beyond it: the cold engine, which prefills the whole prompt.
    uid, reason = decide(cold_cost - hot_cost + SLACK + 0.01)
    assert uid == cold.uid and "cheapest" in reason
    assert f"prefill {cold_cost * 1000:.0f}" in reason
    # The queue counts only while the engine reports requests waiting: the same mean wait
    # with none waiting now, and the holder is cheapest again.
    clock[0] += 100
    counters[hot.uid].waiting = 0
    hot.stats = counters[hot.uid].stats(clock[0])
    index.speculate(hot.uid, block_keys(tokens, BLOCK)[:64], now=clock[0], until=math.inf)
    assert policy.choose([hot, cold], request).engine is hot


def burst_on_a_holder(
    *, waiting: float, requests: int
) -> tuple[list[Decision], Engine, Policy, list[Engine], list[float]]:
    """`requests` requests at one instant sharing a 1,024-token prefix that one of three
    fitted engines holds, the holder reporting `waiting` requests waiting (its queue time 0):
    (their decisions, the holder, the policy, the engines, the clock)."""
    clock, index = [1000.0], BlockIndex()
    policy = kv_policy(clock, index)
    engines = [make_engine(i) for i in range(3)]
    for engine in engines:
        fit(engine, Counters(waiting=waiting if engine is engines[0] else 0.0), clock[0], policy)
    clock[0] += 1  # the fitting decisions' backlogs drained
    holder = engines[0]
    prefix = tuple(range(1024))
    index.speculate(holder.uid, block_keys(prefix, BLOCK), now=clock[0], until=math.inf)
    chosen = [policy.choose(engines, shares_prefix(prefix, n)) for n in range(requests)]
    return chosen, holder, policy, engines, clock


def shares_prefix(prefix: tuple[int, ...], n: int) -> RequestInfo:
    """The `n`-th request of a burst: `prefix` and 32 tokens of its own."""
    tokens = prefix + tuple(range(10**6 + 32 * n, 10**6 + 32 * n + 32))
    return RequestInfo(MODEL, opening=f"agent {n}", tokens=tokens)


def test_a_hot_prefix_is_replicated_when_its_holders_backlog_exceeds_prefilling_it_elsewhere() -> (
    None
):
    """A burst of requests sharing a prefix held by one engine that reports requests
    waiting: each adds its 32 uncached tokens to the holder's backlog; the first request
    whose wait there would exceed the full prefill elsewhere by more than the slack goes to
    another engine, which then holds the prefix too: the next requests see two holders."""
    # The holder's n-th request (from 0) waits n * 32 ms of backlog and 82 ms; elsewhere
    # 1,106 ms. It stays while no more than the slack (50 ms) dearer: n <= 33.
    step, hot, cold = PER_TOKEN * 32, BASE + PER_TOKEN * 32, BASE + PER_TOKEN * 1056
    stays = math.floor((cold + SLACK - hot) / step) + 1
    assert stays == 34
    chosen, holder, policy, engines, clock = burst_on_a_holder(waiting=2, requests=stays + 1)
    assert [d.engine for d in chosen[:stays]] == [holder] * stays
    replica = chosen[stays].engine
    assert replica is not holder and chosen[stays].cached_tokens == 0  # prefilled there
    # A little later (backlogs partly drained): both hold the prefix, and the next request
    # is predicted to wait less at either than the full prefill.
    clock[0] += 0.5
    following = policy.choose(engines, shares_prefix(tuple(range(1024)), stays + 1))
    assert following.engine in (holder, replica) and following.cached_tokens == 1024
    assert following.predicted_ttft is not None
    assert following.predicted_ttft < BASE + PER_TOKEN * 1056


def test_a_holder_without_a_queue_keeps_its_prefix_whatever_the_backlog() -> None:
    """The same burst while the holder reports no requests waiting: every request stays
    there (an engine without a queue takes each into its next step; a move would only lose
    the hits), even those predicted dearer than a prefill elsewhere."""
    chosen, holder, *_ = burst_on_a_holder(waiting=0, requests=60)
    assert [d.engine for d in chosen] == [holder] * 60
    assert all(d.cached_tokens == 1024 for d in chosen)
    last = chosen[-1].predicted_ttft
    assert last is not None and last > BASE + PER_TOKEN * 1056 + SLACK  # dearer, and kept


SLOT: Final = 0.8  # seconds a request holds a sequence slot (arrival to last token, less queue)
SLOTS: Final = 16.0  # an engine's cap on sequences (max_num_seqs), as a full batch shows it


def scrape(
    engine: Engine,
    counters: Counters,
    now: float,
    *,
    running: float,
    waiting: float,
    queue: float = 0.3,
) -> None:
    """A scrape at `now`, a second after the last, of an engine whose requests hold a slot
    SLOT seconds: as many finished in that second as the slots it held then (the mean of
    the two scrapes' running requests) allow; 16 of 100 tokens got their first token after
    `queue` seconds queued (longer than their prefill, BASE + 0.1 s: a full batch)."""
    counters.finished += (counters.running + running) / 2 / SLOT
    counters.running, counters.waiting = running, waiting
    counters.serve([(100, 0)] * 16, queue=queue)
    engine.stats = counters.stats(now)


def test_the_queue_is_the_requests_ahead_at_the_engines_time_per_freed_slot() -> None:
    """An engine that has shown a full batch of 16, its requests holding a slot 0.8 s, frees
    one every 0.05 s: each request ahead of a new one, reported waiting or sent by this
    replica since the scrape, adds 0.05 s, and the slots freed since the scrape are taken
    off. While the scrape's free slots outnumber the requests sent since, the queue is empty
    (and the engine free); the next request waits for one slot."""
    model, engine, counters = TtftModel(), make_engine(0), Counters()
    now = 1000.0
    fit(engine, counters, now, model)
    per_slot = SLOT / SLOTS
    for _ in range(2):  # the second interval tells the time in a slot (the first lacks it)
        now += 1
        scrape(engine, counters, now, running=SLOTS, waiting=4)
        rates = model.rates(MODEL, [engine])
    assert rates is not None
    estimate = model.estimate(engine, 0, now, rates)
    assert estimate.queue == pytest.approx(5 * per_slot) and not estimate.free
    assert estimate.seconds == pytest.approx(5 * per_slot + BASE)
    for _ in range(3):
        model.sent(engine, 0, now, rates)
    assert model.estimate(engine, 0, now, rates).queue == pytest.approx(8 * per_slot)
    assert model.estimate(engine, 0, now + 0.1, rates).queue == pytest.approx(6 * per_slot)
    # The next scrape counts what was sent: the count starts again. 12 running of 16, none
    # waiting: four free slots.
    now += 1
    scrape(engine, counters, now, running=12, waiting=0)
    rates = model.rates(MODEL, [engine])
    assert rates is not None
    for _ in range(4):
        estimate = model.estimate(engine, 0, now, rates)
        assert estimate.queue == 0.0 and estimate.free
        model.sent(engine, 0, now, rates)
    estimate = model.estimate(engine, 0, now, rates)
    assert estimate.queue == pytest.approx(per_slot) and not estimate.free
    assert model.estimate(engine, 0, now + 2 * per_slot, rates).free  # a slot freed since


def test_an_idle_spell_keeps_the_time_per_slot() -> None:
    """A full engine that then idles, scraped all along: its time in a slot is what its
    requests took when it last served some, however long ago (the intervals without any
    weigh nothing), so a burst sent to it later queues behind its free slots at that rate."""
    model, engine, counters = TtftModel(), make_engine(0), Counters()
    now = 1000.0
    fit(engine, counters, now, model)
    for _ in range(3):
        now += 1
        scrape(engine, counters, now, running=SLOTS, waiting=4)
        rates = model.rates(MODEL, [engine])
    for _ in range(100):
        now += 1
        scrape(engine, counters, now, running=0, waiting=0)
        rates = model.rates(MODEL, [engine])
    assert rates is not None
    for _ in range(20):  # 16 free slots, then 4 ahead of the next
        model.sent(engine, 0, now, rates)
    queue = model.estimate(engine, 0, now, rates).queue
    assert queue == pytest.approx(5 * SLOT / SLOTS, rel=0.01)


def test_before_a_request_finishes_a_slot_is_held_at_least_since_the_engine_ran() -> None:
    """An engine whose batch filled (16 running, requests waiting) before any of its
    requests finished, as at start-up under load: once it has reported requests waiting at
    two scrapes in a row its batch is full, and its requests have held their slots at least
    since the first scrape that showed it running, so the time per slot grows from that
    lower bound until one finishes."""
    model, engine, counters = TtftModel(), make_engine(0), Counters()
    now = 1000.0
    fit(engine, counters, now, model)

    def scraped(running: float, waiting: float) -> None:  # it exports e2e: none finished
        counters.running, counters.waiting = running, waiting
        figures = {**parse_vllm_metrics(counters.text()), "e2e_count": 0.0}
        engine.stats = EngineStats.scraped(figures, now=now, stale_after=15.0)
        model.rates(MODEL, [engine])

    scraped(3, 0)
    now += 0.2
    scraped(SLOTS, 4)  # requests waiting: for room, or for the next step?
    rates = model.rates(MODEL, [engine])
    assert rates is not None
    assert model.estimate(engine, 0, now, rates).queue == 0.0  # not told yet
    now += 0.2
    scraped(SLOTS, 6)  # still waiting: the batch is full
    assert model.estimate(engine, 0, now, rates).queue == pytest.approx(7 * 0.4 / SLOTS)
    # 0.1 s later the same figures say more: held 0.5 s at least, less the slots freed
    # since the scrape at that rate.
    later = model.estimate(engine, 0, now + 0.1, rates).queue
    assert later == pytest.approx(7 * 0.5 / SLOTS - 0.1)


def test_an_engine_that_never_queued_has_no_queue_whatever_was_sent_to_it() -> None:
    """Its cap is not known until its batch is seen full (vLLM does not export it), so the
    requests sent since a scrape add nothing: at light load the prediction is as it was, the
    prefill alone. A request waiting at one scrape while requests waited less than a prefill
    takes is one waiting for the next step, not for room: it does not make the batch full."""
    model, engine, counters = TtftModel(), make_engine(0), Counters()
    now = 1000.0
    fit(engine, counters, now, model)
    for waiting in (0, 1):
        now += 1
        scrape(engine, counters, now, running=3, waiting=waiting, queue=0.01)
        rates = model.rates(MODEL, [engine])
    assert rates is not None
    for _ in range(100):
        model.sent(engine, 0, now, rates)
    estimate = model.estimate(engine, 0, now, rates)
    assert estimate.queue == pytest.approx(0.01) and not estimate.free  # the previous rule
    assert estimate.seconds == pytest.approx(BASE + 0.01)
    now += 1
    scrape(engine, counters, now, running=3, waiting=0, queue=0.01)
    model.rates(MODEL, [engine])
    estimate = model.estimate(engine, 0, now, rates)
    assert estimate.queue == 0.0 and estimate.free
    assert estimate.seconds == pytest.approx(BASE)


def test_a_burst_of_hits_leaves_its_holder_once_the_wait_for_a_slot_exceeds_a_cold_prefill() -> (
    None
):
    """The holder of a 1,024-token prompt last reported a full batch (16 running, none
    waiting; it has queued before, so 16 is its cap), its requests holding a slot 0.8 s:
    every request sent there since is one more ahead of the next, 0.05 s further back. A
    burst of that prompt, all of it cached there (so no prefill backlog grows), stays while
    the wait there is within the slack (50 ms) of a cold prefill elsewhere, and then moves:
    the n-th (from 0) waits (n + 1) x 50 ms for a slot and 50 ms of prefill, against
    1,074 ms on an engine with free slots; it stays while n <= 20."""
    clock, index = [1000.0], BlockIndex()
    policy = kv_policy(clock, index)
    engines = [make_engine(i) for i in range(3)]
    counters = [Counters() for _ in engines]
    for engine, its in zip(engines, counters, strict=True):
        fit(engine, its, clock[0], policy)
    holder, prefix = engines[0], tuple(range(1024))
    for waiting in (2.0, 0.0, 0.0):  # a queue once (its cap), then a full batch, none waiting
        clock[0] += 1  # the last look's backlog drained
        for engine, its in zip(engines, counters, strict=True):
            busy = engine is holder
            scrape(engine, its, clock[0], running=SLOTS if busy else 8, waiting=waiting * busy)
        if waiting:  # the model learns from what it sees when it decides: look now
            policy.choose(engines, RequestInfo(MODEL, opening="look", tokens=(2,) * BLOCK))
    index.speculate(holder.uid, block_keys(prefix, BLOCK), now=clock[0], until=math.inf)
    chosen = [
        policy.choose(engines, RequestInfo(MODEL, opening=f"agent {n}", tokens=prefix))
        for n in range(30)
    ]
    stays = 21
    assert [d.engine for d in chosen[:stays]] == [holder] * stays
    assert chosen[stays - 1].predicted_ttft == pytest.approx(BASE + stays * SLOT / SLOTS)
    replica = chosen[stays].engine
    assert replica is not holder and chosen[stays].cached_tokens == 0  # prefilled there
    # The replica holds it now and has free slots: the rest of the burst goes there.
    assert [d.engine for d in chosen[stays:]] == [replica] * (30 - stays)


def test_waits_closer_than_the_predictions_error_are_not_told_apart() -> None:
    """Once first tokens come on average 0.4 s off their predictions, a holder (reporting
    requests waiting) predicted 0.5 s slower than a cold engine keeps its prefix (the model
    cannot tell them apart); a holder 1 s slower does not."""
    clock, index = [1000.0], BlockIndex()
    policy = kv_policy(clock, index)
    hot, cold = make_engine(0), make_engine(1)
    hot_counters = Counters(waiting=1)
    for engine, counters in ((hot, hot_counters), (cold, Counters())):
        fit(engine, counters, clock[0], policy)
    tokens = tuple(range(1024 + 32))

    def choose(backlog: float) -> Decision:
        clock[0] += 100
        hot.stats = hot_counters.stats(clock[0])  # still waiting, as a fresh scrape says
        index.speculate(hot.uid, block_keys(tokens, BLOCK)[:64], now=clock[0], until=math.inf)
        if backlog:  # an earlier request's prefill still ahead at the holder, that long
            ahead = tuple(range(-1, -1 - round(backlog / PER_TOKEN), -1))
            policy.choose([hot], RequestInfo(MODEL, opening="a", tokens=ahead))
        return policy.choose([hot, cold], RequestInfo(MODEL, opening="b", tokens=tokens))

    assert choose(1.5).engine is cold  # 1.5 + 0.082 against 1.106: moved
    for n in range(200):
        decision = choose(0.0)
        assert decision.engine is hot and decision.observe_ttft is not None
        decision.observe_ttft(0.4 if n % 2 else -0.4)  # late, early: 0.4 s off either way
    assert choose(1.5).engine is hot  # 0.48 s dearer: within 2 x 0.4 s
    assert choose(2.0).engine is cold  # 0.98 s dearer: beyond it


def test_an_adapter_is_predicted_with_its_base_models_rates() -> None:
    clock, index = [1000.0], BlockIndex()
    policy = kv_policy(clock, index)
    engines = [make_engine(i) for i in range(2)]
    for engine in engines:
        engine.models = (Model(MODEL), Model("tuned", parent=MODEL))
        engine.model_ids = frozenset({MODEL, "tuned"})
        fit(engine, Counters(), clock[0], policy)  # decisions for the base model
    clock[0] += 1
    decision = policy.choose(engines, RequestInfo("tuned", tokens=tuple(range(500))))
    assert decision.predicted_ttft == pytest.approx(BASE + PER_TOKEN * 500)


def test_until_the_engines_figures_fit_kv_aware_decides_on_load() -> None:
    clock, index = [1000.0], BlockIndex()
    engines = [make_engine(i) for i in range(2)]
    decision = kv_policy(clock, index).choose(engines, RequestInfo(MODEL, tokens=(1,) * 64))
    assert "load" in decision.reason and decision.predicted_ttft is None
    # And with kv_cost = "load", whatever the figures say.
    policy = kv_policy(clock, index, kv_cost="load")
    for engine in engines:
        fit(engine, Counters(), clock[0], policy)
    decision = policy.choose(engines, RequestInfo(MODEL, tokens=(1,) * 64))
    assert "load" in decision.reason and decision.predicted_ttft is None


def test_before_the_fit_a_holder_keeps_its_prefix_until_two_scrapes_show_a_queue() -> None:
    """Before the rates are fitted, the load cost would move a prompt off a holder with 12
    requests in flight (4 above the least loaded + 8: 4 x 256 tokens dearer than prefilling
    its 960 tokens elsewhere). A holder with fresh figures keeps it while they show no queue:
    none waiting, or requests waiting at one scrape (those that arrived during a step wait
    for the next one); waiting at two scrapes in a row is a queue, and the cost decides."""
    clock, index = [1000.0], BlockIndex()
    policy = kv_policy(clock, index)
    holder, other = make_engine(0), make_engine(1)
    tokens = tuple(range(960))
    request = RequestInfo(MODEL, opening="agent", tokens=tokens)
    holder.in_flight = 12
    counters = Counters(running=12)

    def decide(waiting: float) -> Engine:
        clock[0] += 1.0
        # Held, as its events say (a decision's own speculation expires in 2 s).
        index.speculate(holder.uid, block_keys(tokens, BLOCK), now=clock[0], until=math.inf)
        counters.waiting = waiting
        holder.stats = counters.stats(clock[0])
        return policy.choose([holder, other], request).engine

    assert decide(0) is holder
    assert decide(3) is holder  # waiting at one scrape: still free
    assert decide(3) is other  # and at the next: a queue, and the load cost moves it
    assert decide(0) is holder


def test_the_time_cost_knobs_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"routing\.kv_cost"):
        parse_config({"routing": {"kv_cost": "fast"}})
    with pytest.raises(ConfigError, match=r"routing\.kv_ttft_slack_s"):
        parse_config({"routing": {"kv_ttft_slack_s": -1}})
    config = parse_config({"routing": {"kv_cost": "load", "kv_ttft_slack_s": 0.2}})
    assert config.routing.kv_cost == "load" and config.routing.kv_ttft_slack_s == 0.2


async def test_rates_are_learned_from_scrapes_and_the_backlog_drains_in_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine serving requests as `Counters` says, scraped every second: a minute
    later kv_aware predicts its first tokens at its prefill time; a decision's prefill is a
    backlog there that drains as time passes."""
    counters = Counters(base=0.08, per_token=0.0005)
    engine = make_engine(0)
    table = RoutingTable()
    table.put(engine)

    async def metrics(request: FakeRequest) -> FakeReply:
        assert request.path == "/metrics"
        return FakeReply(200, counters.text().encode())

    async def serve() -> None:
        rng = random.Random(3)
        while True:
            await trio.sleep(0.25)
            counters.serve([(rng.randrange(50, 3000), 0) for _ in range(rng.randrange(1, 4))])

    network = FakeNetwork(metrics)
    policy = make_policy(
        RoutingConfig(policy="kv_aware", kv_block_size=BLOCK),
        clock=trio.current_time,
        rng=random.Random(1),
        kv_index=BlockIndex(),
    )

    def request(n: int) -> RequestInfo:  # 2,000 tokens no engine holds
        return RequestInfo(MODEL, opening="q", tokens=tuple(range(n * 2000, n * 2000 + 2000)))

    async with network.open(), trio.open_nursery() as nursery:
        pool = UpstreamPool(
            connect_timeout=math.inf,
            read_timeout=math.inf,
            max_idle_s=300.0,
            connect=network.connect,
        )
        engine.in_flight = 2  # in use: scraped every interval
        nursery.start_soon(serve)
        nursery.start_soon(
            partial(
                run_stats_scraper,
                engine,
                table,
                pool,
                StatsConfig(interval_s=1.0, timeout_s=0.5),
                generation=0,
            )
        )
        # Decisions now and then, as traffic would make them: each learns from the figures.
        for _ in range(60):
            await trio.sleep(1)
            policy.choose([engine], RequestInfo(MODEL, opening="p", tokens=(1,)))
            await trio.sleep(1)  # its backlog (at most 0.08 + 16 x 0.0005 s) drained
        alone = 0.08 + 0.0005 * 2000
        first = policy.choose([engine], request(0))
        assert first.predicted_ttft == pytest.approx(alone, rel=0.01)
        second = policy.choose([engine], request(1))  # at once: the first's 1 s prefill first
        assert second.predicted_ttft == pytest.approx(alone + 1.0, rel=0.01)
        await trio.sleep(1.5)  # of the 2 s ahead, 0.5 s left
        third = policy.choose([engine], request(2))
        assert third.predicted_ttft == pytest.approx(alone + 0.5, rel=0.01)
        pool.close()
        nursery.cancel_scope.cancel()


async def test_an_emulated_engines_own_figures_predict_its_wait_for_a_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An emulated H100 capped at 4 sequences, sent requests faster than it serves them and
    scraped every 0.1 s: from its own /metrics alone (running, waiting, and its latency
    histograms), the queue predicted for the next request is the wait that request then has
    for its first token, to within a quarter."""
    config = EngineConfig.from_profile(load_profile("h100"), max_num_seqs=4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    model, engine = TtftModel(), make_engine(0)
    emulated = EmulatedEngine(config)
    first_token = trio.Event()

    async def request(n: int, told: trio.Event | None = None) -> None:
        generation = emulated.submit(list(range(1000 * n, 1000 * n + 64)), params)
        while True:
            tokens, reason = await generation.wait()
            if tokens and told is not None:
                told.set()
            if reason is not None:
                return

    async def scrape_every(seconds: float) -> None:
        while True:
            figures = parse_vllm_metrics(emulated.metrics_text())
            engine.stats = EngineStats.scraped(figures, now=trio.current_time(), stale_after=1)
            model.rates(MODEL, [engine])
            await trio.sleep(seconds)

    async with trio.open_nursery() as nursery:
        await nursery.start(emulated.run)
        nursery.start_soon(scrape_every, 0.1)
        for n in range(60):  # about 1.5 times what it serves
            nursery.start_soon(request, n)
            await trio.sleep(1 / 24)
        figures = parse_vllm_metrics(emulated.metrics_text())
        now = trio.current_time()
        engine.stats = EngineStats.scraped(figures, now=now, stale_after=1)
        rates = model.rates(MODEL, [engine])
        assert rates is not None and figures["waiting"] >= 10
        predicted = model.estimate(engine, 64, now, rates).seconds
        nursery.start_soon(request, 60, first_token)
        await first_token.wait()
        waited = trio.current_time() - now
        nursery.cancel_scope.cancel()
    assert waited == pytest.approx(predicted, rel=0.25)
