"""Routing policies: fairness, load awareness, session stickiness and consistency, prefix
affinity, bounded memory, forgetting removed engines, and `exclude` for every policy."""

from __future__ import annotations

import gc
import random
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_router import server
from trio_router.config import POLICIES, Config, PolicyName, RoutingConfig, parse_config
from trio_router.errors import BadRequestError, ConfigError, NoEngineError
from trio_router.kv.index import BlockIndex, block_keys
from trio_router.routing.balance import EXACT_SCAN_MAX
from trio_router.routing.policy import Policy, make_policy
from trio_router.routing.request import RequestInfo, render_opening, request_info
from trio_router.table import Engine, EngineState, EngineStats, Model, RoutingTable

MODEL = "llama"


class Clock:
    """A settable stand-in for trio.current_time (these tests run outside Trio)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(i: int, models: Sequence[str] = (MODEL,)) -> Engine:
    return Engine(
        uid=f"uid-{i:04d}",
        name=f"engine-{i}",
        url=f"http://10.0.{i // 250}.{i % 250}",
        state=EngineState.ROUTABLE,
        models=tuple(Model(m) for m in models),
        model_ids=frozenset(models),
    )


def make_table(engines: Sequence[Engine]) -> RoutingTable:
    table = RoutingTable()
    for engine in engines:
        table.put(engine)
    return table


def make(
    name: PolicyName, table: RoutingTable, clock: Clock | None = None, seed: int = 1, **knobs: Any
) -> Policy:
    """The policy `name`, subscribed to `table`'s removals as the router subscribes it."""
    policy = make_policy(
        RoutingConfig(policy=name, **knobs), clock=clock or Clock(), rng=random.Random(seed)
    )
    table.add_remove_listener(lambda engine: policy.forget(engine.uid))
    return policy


def chat(*turns: str, system: str = "You are a helpful assistant.", **knobs: Any) -> RequestInfo:
    messages = [{"role": "system", "content": system}]
    messages += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return request_info(
        {"model": MODEL, "messages": messages}, {}, RoutingConfig(policy="prefix_aware", **knobs)
    )


def text(seed: int, size: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "router", "trio", "engine"]
    out = " ".join(rng.choice(words) for _ in range(size // 4))
    return out[:size]


# -- request facts -----------------------------------------------------------------------------


def test_request_info_takes_the_session_key_from_header_then_user() -> None:
    config = RoutingConfig(session_header="X-Session-Id")
    body = {"model": MODEL, "user": "alice", "prompt": "hi"}
    assert request_info(body, {"x-session-id": "s1"}, config).session_key == "s1"
    asgi = [(b"host", b"router"), (b"X-Session-ID", b"s2")]
    assert request_info(body, asgi, config).session_key == "s2"
    assert request_info(body, {}, config).session_key == "alice"
    info = request_info({"model": MODEL, "user": 7}, [], config)
    assert info == RequestInfo(model=MODEL, session_key=None, opening=None)
    with pytest.raises(BadRequestError):
        request_info({"messages": []}, {}, config)


def test_every_turn_of_a_conversation_has_the_same_opening() -> None:
    turns = [text(i, 300) for i in range(6)]
    openings = {chat(*turns[:n]).opening for n in range(1, 7)}
    assert openings == {f"system\x1fYou are a helpful assistant.\x1euser\x1f{turns[0]}\x1e"}
    assert chat(text(99, 300)).opening not in openings  # same system prompt, another chat
    config = RoutingConfig(
        policy="prefix_aware", prefix_text_chars=8, prefix_max_chunks=1, prefix_chunk_chars=40
    )
    developer = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "rules"},
            {"role": "system", "content": "more"},
            {"role": "user", "content": "q" * 100},
            {"role": "assistant", "content": "a"},
        ],
    }
    opening = request_info(developer, {}, config).opening
    assert opening == "developer\x1frules\x1esystem\x1fmore\x1euser\x1f" + "q" * 7  # 40 chars
    text_prompt = request_info({"model": MODEL, "prompt": "0123456789"}, {}, config)
    assert text_prompt.opening == "01234567"
    embeddings = request_info({"model": MODEL, "input": "x"}, {}, config)
    assert embeddings.opening is None
    session = request_info({"model": MODEL, "prompt": "x"}, {}, RoutingConfig(policy="session"))
    assert session.opening is None  # read only for prefix_aware
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    assert render_opening(body, limit=1000, text_limit=10) == "user\x1flook<image_url:u>\x1e"


def test_rendered_openings_forms_and_bounds() -> None:
    def opening(body: dict[str, Any], limit: int = 10) -> str | None:
        return render_opening(body, limit=1000, text_limit=limit)

    assert opening({"prompt": "abc"}) == "abc"
    assert opening({"prompt": [1, 2, 3]}) == "1,2,3"
    assert opening({"prompt": ["a", "b"]}) == "a\x1eb\x1e"
    assert opening({"prompt": "x" * 100}) == "x" * 10
    assert opening({"prompt": list(range(100))}) == "0,1,2,3,4,"
    long_header = {"messages": [{"role": "system", "content": "y" * 50}] * 1000}
    assert len(render_opening(long_header, limit=120, text_limit=10) or "") == 120
    assert opening({"prompt": None}) is None
    assert opening({"prompt": ""}) == ""  # a key like any other
    assert opening({"messages": "nonsense"}) is None


# -- round robin -------------------------------------------------------------------------------


def test_round_robin_is_fair_per_model() -> None:
    engines = [make_engine(i, models=(MODEL, "other")) for i in range(2)]
    table = make_table(engines)
    policy = make("round_robin", table)
    counts: Counter[tuple[str, str]] = Counter()
    for _ in range(300):  # interleaved models must not alias each other's turn
        for model in (MODEL, "other"):
            decision = policy.choose(table.routable(model), RequestInfo(model))
            engine, why = decision.engine, decision.reason
            counts[model, engine.name] += 1
    assert len(counts) == 4 and set(counts.values()) == {150}
    assert "round robin" in why


def test_round_robin_skips_excluded() -> None:
    table = make_table([make_engine(i) for i in range(3)])
    policy = make("round_robin", table)
    chosen = {
        policy.choose(table.routable(MODEL), RequestInfo(MODEL), exclude=["uid-0001"]).engine.uid
        for _ in range(10)
    }
    assert chosen == {"uid-0000", "uid-0002"}


# -- least loaded ------------------------------------------------------------------------------


def test_least_loaded_prefers_the_idle_engine() -> None:
    engines = [make_engine(i) for i in range(5)]
    for engine in engines:
        engine.in_flight = 3
    engines[2].in_flight = 0
    table = make_table(engines)
    policy = make("least_loaded", table)
    for _ in range(50):
        decision = policy.choose(table.routable(MODEL), RequestInfo(MODEL))
        engine, why = decision.engine, decision.reason
        assert engine is engines[2], why


def test_least_loaded_spreads_equal_engines_and_prefers_light_ones_at_scale() -> None:
    engines = [make_engine(i) for i in range(4)]
    table = make_table(engines)
    policy = make("least_loaded", table)
    for _ in range(400):  # requests that stay in flight: exact scan keeps them level
        engine = policy.choose(table.routable(MODEL), RequestInfo(MODEL)).engine
        engine.in_flight += 1
    assert [e.in_flight for e in engines] == [100] * 4

    many = [make_engine(i) for i in range(10 * EXACT_SCAN_MAX)]
    for engine in many[::2]:
        engine.in_flight = 10
    table = make_table(many)
    policy = make("least_loaded", table)
    picks = Counter(
        policy.choose(table.routable(MODEL), RequestInfo(MODEL)).engine.in_flight
        for _ in range(4000)
    )
    assert picks[0] > 0.7 * 4000  # two choices: an idle one unless both draws hit busy ones


def test_least_loaded_reacts_to_scraped_queues_and_ignores_stale_ones() -> None:
    clock = Clock()
    engines = [make_engine(i) for i in range(2)]
    engines[0].stats = EngineStats.scraped(
        {"running": 6.0, "waiting": 4.0}, now=clock.now, stale_after=15.0
    )
    table = make_table(engines)
    policy = make("least_loaded", table, clock)
    for _ in range(50):
        assert policy.choose(table.routable(MODEL), RequestInfo(MODEL)).engine is engines[1]
    engines[1].stats = EngineStats.scraped({"kv_cache_usage": 0.9}, now=clock.now, stale_after=15.0)
    engines[0].stats = EngineStats.scraped({"kv_cache_usage": 0.1}, now=clock.now, stale_after=15.0)
    for _ in range(50):
        assert policy.choose(table.routable(MODEL), RequestInfo(MODEL)).engine is engines[0]
    clock.now += 15.5  # both stale: only in-flight counts, and they are equal
    chosen = Counter(
        policy.choose(table.routable(MODEL), RequestInfo(MODEL)).engine.uid for _ in range(200)
    )
    assert min(chosen.values()) > 50


def test_no_engine_error_when_nothing_is_left() -> None:
    table = make_table([make_engine(i) for i in range(2)])
    for name in POLICIES:
        policy = make(name, table)
        info = RequestInfo(MODEL, session_key="k", opening="p" * 1000)
        with pytest.raises(NoEngineError):
            policy.choose((), info)
        with pytest.raises(NoEngineError):
            policy.choose(table.routable(MODEL), info, exclude={"uid-0000", "uid-0001"})


# -- session -----------------------------------------------------------------------------------


def keys(n: int) -> list[str]:
    return [f"user-{i}" for i in range(n)]


def assignment(policy: Policy, candidates: Sequence[Engine], ks: list[str]) -> dict[str, str]:
    return {k: policy.choose(candidates, RequestInfo(MODEL, session_key=k)).engine.uid for k in ks}


def test_session_same_key_same_engine_and_keys_spread() -> None:
    table = make_table([make_engine(i) for i in range(10)])
    policy = make("session", table)
    first = assignment(policy, table.routable(MODEL), keys(10_000))
    assert assignment(policy, table.routable(MODEL), keys(10_000)) == first
    shares = Counter(first.values())
    assert len(shares) == 10 and min(shares.values()) > 600  # 1,000 each on average


def test_session_is_the_same_in_independent_instances_whatever_the_order() -> None:
    engines_a = [make_engine(i) for i in range(25)]
    engines_b = [make_engine(i) for i in range(25)]
    random.Random(7).shuffle(engines_b)
    table_a, table_b = make_table(engines_a), make_table(engines_b)
    policy_a, policy_b = make("session", table_a, seed=1), make("session", table_b, seed=2)
    ks = keys(2000)
    assert assignment(policy_a, table_a.routable(MODEL), ks) == assignment(
        policy_b, table_b.routable(MODEL), ks
    )


def test_session_moves_about_one_nth_of_keys_when_an_engine_goes_or_comes() -> None:
    n, ks = 10, keys(10_000)
    table = make_table([make_engine(i) for i in range(n)])
    policy = make("session", table)
    before = assignment(policy, table.routable(MODEL), ks)
    table.remove("uid-0003")
    after = assignment(policy, table.routable(MODEL), ks)
    moved = [k for k in ks if before[k] != after[k]]
    assert len(moved) <= 1.5 * len(ks) / n
    assert all(before[k] == "uid-0003" for k in moved)  # only the lost engine's keys move
    table.put(make_engine(3))
    assert assignment(policy, table.routable(MODEL), ks) == before  # and come back
    table.put(make_engine(n))
    grown = assignment(policy, table.routable(MODEL), ks)
    moved = [k for k in ks if before[k] != grown[k]]
    assert 0 < len(moved) <= 1.5 * len(ks) / (n + 1)
    assert all(grown[k] == f"uid-{n:04d}" for k in moved)


def test_session_after_many_removals_matches_a_fresh_instance() -> None:
    table = make_table([make_engine(i) for i in range(40)])
    policy = make("session", table)
    ks = keys(500)
    assignment(policy, table.routable(MODEL), ks)
    for i in range(30):  # enough removals to compact the ring, with decisions in between
        table.remove(f"uid-{i:04d}")
        assignment(policy, table.routable(MODEL), ks[:20])
    fresh_table = make_table([make_engine(i) for i in range(30, 40)])
    fresh = make("session", fresh_table)
    assert assignment(policy, table.routable(MODEL), ks) == assignment(
        fresh, fresh_table.routable(MODEL), ks
    )


def test_session_for_a_model_on_few_engines_matches_the_shared_ring() -> None:
    engines = [
        make_engine(i, models=(MODEL, "adapter") if i % 10 == 0 else (MODEL,)) for i in range(40)
    ]
    table = make_table(engines)
    both = make("session", table)
    assignment(both, table.routable(MODEL), keys(10))  # the ring now holds all 40 engines
    ks = keys(1000)
    adapter = {
        k: both.choose(table.routable("adapter"), RequestInfo("adapter", session_key=k)).engine.uid
        for k in ks
    }
    alone_table = make_table([make_engine(i, ("adapter",)) for i in range(0, 40, 10)])
    only = make("session", alone_table)
    alone = {
        k: only.choose(
            alone_table.routable("adapter"), RequestInfo("adapter", session_key=k)
        ).engine.uid
        for k in ks
    }
    assert adapter == alone and len(set(alone.values())) == 4


def test_session_bounded_load_spills_a_hot_session() -> None:
    engines = [make_engine(i) for i in range(10)]
    table = make_table(engines)
    policy = make("session", table)
    hot = RequestInfo(MODEL, session_key="hot")
    owner = policy.choose(table.routable(MODEL), hot).engine
    for _ in range(100):  # 100 concurrent requests of one session, none finishing
        average = sum(e.in_flight for e in engines) / len(engines)
        decision = policy.choose(table.routable(MODEL), hot)
        engine, why = decision.engine, decision.reason
        assert engine.in_flight <= 1.25 * average + 1, why
        engine.in_flight += 1
    assert owner.in_flight == max(e.in_flight for e in engines)  # the owner is used first
    assert max(e.in_flight for e in engines) <= 1.25 * 10 + 2
    assert sum(e.in_flight > 0 for e in engines) >= 5
    for engine in engines:  # once load drains, the session is back on its owner
        engine.in_flight = 0
    assert policy.choose(table.routable(MODEL), hot).engine is owner


def test_session_bounded_load_with_a_sampled_average_at_scale() -> None:
    engines = [make_engine(i) for i in range(5 * EXACT_SCAN_MAX)]
    table = make_table(engines)
    policy = make("session", table)
    for i in range(10 * len(engines)):  # ten hot sessions, 800 requests that stay in flight
        engine = policy.choose(table.routable(MODEL), RequestInfo(MODEL, f"hot-{i % 10}")).engine
        engine.in_flight += 1
    loads = sorted(e.in_flight for e in engines)
    assert loads[-1] <= 1.25 * 10 + 1 + 4  # the bound, give or take the sampling error
    assert loads[len(loads) // 2] >= 7  # the spill reached most engines


def test_session_without_key_is_least_loaded() -> None:
    engines = [make_engine(i) for i in range(3)]
    engines[0].in_flight = engines[2].in_flight = 4
    table = make_table(engines)
    policy = make("session", table)
    decision = policy.choose(table.routable(MODEL), RequestInfo(MODEL, session_key=None))
    engine, why = decision.engine, decision.reason
    assert engine is engines[1] and "no key" in why


# -- prefix aware ------------------------------------------------------------------------------


def conversation_set(
    seed: int, count: int, *, shared_system: bool, system_chars: int = 2000
) -> list[list[str]]:
    """`count` conversations of 6 turns: their own system prompts of `system_chars`, or one
    shared."""
    rng = random.Random(seed)
    shared = text(rng.randrange(1 << 30), system_chars)
    return [
        [shared if shared_system else text(rng.randrange(1 << 30), system_chars)]
        + [text(rng.randrange(1 << 30), rng.randrange(20, 400)) for _ in range(6)]
        for _ in range(count)
    ]


def turn(conversation: list[str], n: int) -> RequestInfo:
    """The nth turn (0-based) of `conversation`: its system prompt, then n + 1 user messages
    with the answers between them."""
    system, *users = conversation
    turns = [x for user in users[: n + 1] for x in (user, "answer to " + user[:30])][:-1]
    return chat(*turns, system=system)


def test_prefix_growing_conversations_keep_their_engine() -> None:
    engines = [make_engine(i) for i in range(8)]
    table = make_table(engines)
    policy = make("prefix_aware", table)
    # A short system prompt shared by all (under prefix_header_chars): the first user message
    # tells the conversations apart.
    conversations = conversation_set(1, 40, shared_system=True, system_chars=600)
    home: dict[int, str] = {}
    holding: dict[int, Engine] = {}  # each conversation's last request stays in flight
    for n in range(6):
        for c, conversation in enumerate(conversations):
            decision = policy.choose(table.routable(MODEL), turn(conversation, n))
            engine, why = decision.engine, decision.reason
            if c in holding:
                holding[c].in_flight -= 1
            holding[c] = engine
            engine.in_flight += 1
            assert engine.uid == home.setdefault(c, engine.uid), (c, n, why)
            assert "ring owner" in why
    # One system prompt for all, yet the conversations spread over the engines.
    assert len(set(home.values())) >= 6


def test_prefix_a_long_system_prompt_is_the_key_alone() -> None:
    """Requests sharing a system prompt of at least prefix_header_chars go to one engine
    whatever question follows (vLLM serves the system prompt from its cache there); a shorter
    one, or a longer threshold, keys on the question too."""
    engines = [make_engine(i) for i in range(8)]
    table = make_table(engines)
    policy = make("prefix_aware", table)
    long_system, short_system = text(7, 1500), text(8, 600)
    questions = [text(100 + i, 80) for i in range(24)]

    def homes(system: str, **knobs: Any) -> set[str]:
        chosen = set()
        for question in questions:
            decision = policy.choose(table.routable(MODEL), chat(question, system=system, **knobs))
            engine, why = decision.engine, decision.reason
            assert "ring owner" in why
            chosen.add(engine.uid)
        return chosen

    assert len(homes(long_system)) == 1
    assert len(homes(short_system)) >= 5
    assert len(homes(long_system, prefix_header_chars=4096)) >= 5


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1 << 30),
    n=st.integers(1, 12),
    shared=st.booleans(),
    loads=st.lists(st.integers(0, 12), min_size=12, max_size=12),
)
def test_prefix_independent_replicas_agree_on_every_decision(
    seed: int, n: int, shared: bool, loads: list[int]
) -> None:
    """Two policies built apart, as two replicas are (other random seeds, engines seen in
    another order), make the same choice for every request, given the same load figures; so
    does a third built fresh halfway (a restarted replica)."""
    engines = [make_engine(i) for i in range(n)]
    for engine, load in zip(engines, loads, strict=False):
        engine.in_flight = load
    first, second = make_table(engines), make_table(list(reversed(engines)))
    a, b = make("prefix_aware", first, seed=1), make("prefix_aware", second, seed=2)
    conversations = conversation_set(seed, 12, shared_system=shared)
    restarted: Policy | None = None
    for step in range(6):
        if step == 3:
            restarted = make("prefix_aware", make_table(engines), seed=3)
        for conversation in conversations:
            info = turn(conversation, step)
            choice = a.choose(first.routable(MODEL), info).engine.uid
            assert b.choose(second.routable(MODEL), info).engine.uid == choice
            if restarted is not None:
                assert restarted.choose(first.routable(MODEL), info).engine.uid == choice


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 40), lost=st.integers(0, 39), seed=st.integers(0, 1 << 30))
def test_prefix_losing_one_of_n_engines_moves_only_its_conversations(
    n: int, lost: int, seed: int
) -> None:
    engines = [make_engine(i) for i in range(n)]
    table = make_table(engines)
    policy = make("prefix_aware", table)
    rng = random.Random(seed)
    openings = [RequestInfo(MODEL, opening=text(rng.randrange(1 << 30), 300)) for _ in range(400)]
    before = [policy.choose(table.routable(MODEL), o).engine.uid for o in openings]
    gone = engines[lost % n].uid
    table.remove(gone)
    after = [policy.choose(table.routable(MODEL), o).engine.uid for o in openings]
    moved = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    assert all(before[i] == gone for i in moved)  # only the lost engine's conversations move
    assert gone not in after
    # ...and that is about 1/n of them (100 vnodes per engine: within a few times 1/n).
    assert len(moved) <= 400 * 3 / n + 10


def test_prefix_hot_opening_spreads_under_load_and_returns() -> None:
    engines = [make_engine(i) for i in range(10)]
    table = make_table(engines)
    policy = make("prefix_aware", table)
    hot = RequestInfo(MODEL, opening="one system prompt and the same question for everyone")
    owner = policy.choose(table.routable(MODEL), hot).engine
    spread = []
    for _ in range(200):  # 200 concurrent requests with one opening, none finishing
        average = sum(e.in_flight for e in engines) / len(engines)
        decision = policy.choose(table.routable(MODEL), hot)
        engine, why = decision.engine, decision.reason
        assert engine.in_flight <= 1.5 * average + 8, why
        engine.in_flight += 1
        spread.append(engine.uid)
    assert spread[:9] == [owner.uid] * 9  # the owner first, up to the bound
    assert owner.in_flight == max(e.in_flight for e in engines)
    assert sum(e.in_flight > 0 for e in engines) >= 5
    # A second replica, with the same load figures, spills the same way.
    twin = make("prefix_aware", make_table(engines), seed=7)
    assert (
        twin.choose(table.routable(MODEL), hot).engine
        is policy.choose(table.routable(MODEL), hot).engine
    )
    for engine in engines:  # once load drains, the opening is back on its owner
        engine.in_flight = 0
    assert policy.choose(table.routable(MODEL), hot).engine is owner


def test_prefix_places_an_adapters_requests_apart_from_the_base_models_and_others() -> None:
    """vLLM shares no cached blocks between LoRA adapters, nor with their base model: the
    same opening for two adapters, or for an adapter and the base model, is placed as two
    openings are (by the adapter's name and the opening), each the same on every replica.
    A base model's request is placed by its opening alone, whatever adapters its engines
    list."""
    adapters = ("sql-lora", "chat-lora")
    engines = []
    for i in range(8):
        engine = make_engine(i)
        engine.models += tuple(Model(a, parent=MODEL) for a in adapters)
        engine.model_ids |= frozenset(adapters)
        engines.append(engine)
    table, plain = make_table(engines), make_table([make_engine(i) for i in range(8)])
    policy, twin = make("prefix_aware", table), make("prefix_aware", table, seed=2)
    base_only = make("prefix_aware", plain)
    openings = [text(seed, 300) for seed in range(40)]
    placed: dict[str, list[str]] = {}
    for model in (MODEL, *adapters):
        candidates = table.routable(model)
        placed[model] = [
            policy.choose(candidates, RequestInfo(model, opening=o)).engine.uid for o in openings
        ]
        assert placed[model] == [
            twin.choose(candidates, RequestInfo(model, opening=o)).engine.uid for o in openings
        ]
    assert placed[MODEL] == [
        base_only.choose(plain.routable(MODEL), RequestInfo(MODEL, opening=o)).engine.uid
        for o in openings
    ]
    for first, second in [(MODEL, "sql-lora"), (MODEL, "chat-lora"), ("sql-lora", "chat-lora")]:
        apart = sum(x != y for x, y in zip(placed[first], placed[second], strict=True))
        assert apart >= len(openings) // 2, (first, second, apart)  # 7/8 expected
    assert len(set(placed["sql-lora"])) >= 4


def test_prefix_without_a_prompt_goes_to_the_least_loaded() -> None:
    engines = [make_engine(i) for i in range(2)]
    table = make_table(engines)
    policy = make("prefix_aware", table)
    engines[0].in_flight = 1
    decision = policy.choose(table.routable(MODEL), RequestInfo(MODEL, opening=None))
    engine, why = decision.engine, decision.reason
    assert engine is engines[1] and "no key" in why


def test_prefix_removed_engine_gets_nothing_and_a_returning_one_its_share_back() -> None:
    engines = [make_engine(i) for i in range(3)]
    table = make_table(engines)
    policy = make("prefix_aware", table)
    info = chat(text(5, 3000))
    holder = policy.choose(table.routable(MODEL), info).engine
    table.remove(holder.uid)
    second = policy.choose(table.routable(MODEL), info).engine
    assert second is not holder
    back = make_engine(int(holder.uid[4:]))  # same uid, e.g. a static engine re-added
    table.put(back)
    assert policy.choose(table.routable(MODEL), info).engine is back  # the ring is the ring


# -- every policy ------------------------------------------------------------------------------


async def test_a_replaced_policy_is_unsubscribed_and_freed() -> None:
    """What a reload does with a policy it replaces (`server.Router.apply`): `build_runtime`
    subscribes the new one and the old subscription is ended, which frees the old policy; an
    unchanged [routing] keeps the policy and its subscription."""
    table = make_table([make_engine(i) for i in range(3)])
    session = Config(routing=RoutingConfig(policy="session"))
    async with server.open_router(session, table=table) as router:
        first = router.runtime
        router.apply(session)
        assert router.runtime.policy is first.policy  # [routing] unchanged: kept
        assert router.runtime.retired(first) == (None, None)
        router.apply(Config(routing=RoutingConfig(policy="prefix_aware")))
        assert router.runtime.pool is first.pool  # proxy timeouts unchanged: the same pool
        ref = weakref.ref(first.policy)
        del first
        gc.collect()
        assert ref() is None  # its subscription ended with the reload
        current = weakref.ref(router.runtime.policy)
        gc.collect()
        assert current() is not None  # the new policy is the one subscribed now


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(POLICIES),
    n=st.integers(1, 40),
    loads=st.lists(st.integers(0, 30), min_size=40, max_size=40),
    excluded=st.sets(st.integers(0, 39)),
    key=st.none() | st.text(max_size=8),
    opening=st.none() | st.text(max_size=3000),
    warm=st.booleans(),
)
def test_every_policy_honours_exclude(
    name: PolicyName,
    n: int,
    loads: list[int],
    excluded: set[int],
    key: str | None,
    opening: str | None,
    warm: bool,
) -> None:
    engines = [make_engine(i) for i in range(n)]
    for engine, load in zip(engines, loads, strict=False):
        engine.in_flight = load
    table = make_table(engines)
    policy = make(name, table, prefix_chunk_chars=64)
    info = RequestInfo(MODEL, session_key=key, opening=opening)
    if warm:  # let affinity point at engines that will then be excluded
        for _ in range(3):
            policy.choose(table.routable(MODEL), info)
    exclude = [f"uid-{i:04d}" for i in excluded]
    allowed = {e.uid for e in engines} - set(exclude)
    if not allowed:
        with pytest.raises(NoEngineError):
            policy.choose(table.routable(MODEL), info, exclude=exclude)
        return
    for _ in range(3):
        decision = policy.choose(table.routable(MODEL), info, exclude=exclude)
        engine, why = decision.engine, decision.reason
        assert engine.uid in allowed and why


# -- config ------------------------------------------------------------------------------------


def test_policy_knobs_are_validated_and_read_from_toml() -> None:
    for bad in (
        {"session_load_factor": 0.9},
        {"session_vnodes": 0},
        {"load_kv_weight": -1.0},
        {"prefix_chunk_chars": 0},
        {"prefix_balance_rel": 0.5},
        {"prefix_text_chars": 0},
        {"prefix_cache_entries": 0},
        {"session_header": ""},
    ):
        with pytest.raises(ConfigError):
            RoutingConfig(**bad)
    config = parse_config(
        {
            "routing": {
                "policy": "prefix_aware",
                "prefix_chunk_chars": 128,
                "load_queue_weight": 1,
            },
            "stats": {"interval_s": 2, "timeout_s": 1},
        }
    )
    assert config.routing.prefix_chunk_chars == 128 and config.routing.load_queue_weight == 1.0
    assert config.stats.timeout_s == 1.0
    with pytest.raises(ConfigError, match=r"routing\.prefix_chunk_size"):
        parse_config({"routing": {"prefix_chunk_size": 1}})
    with pytest.raises(ConfigError, match=r"stats\.timeout_s"):
        parse_config({"stats": {"timeout_s": 0}})


def test_the_unused_prefix_memory_bound_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = make_table([make_engine(0)])
    make("prefix_aware", table)
    assert not caplog.records
    make("prefix_aware", table, prefix_cache_entries=5)
    assert "routing.prefix_cache_entries is no longer used" in caplog.text


def test_kv_aware_among_many_engines_weighs_only_holders_and_prefix_awares_pick() -> None:
    """Beyond EXACT_SCAN_MAX candidates, `kv_aware` weighs the engines the index says hold
    the prompt's first block against the one `prefix_aware` picks for it: a cached prefix
    goes to its holder while the holder's load costs less than prefilling elsewhere (256
    tokens per request above the least loaded + 8), an uncached one where `prefix_aware`
    would place it, an excluded holder is passed over, and replicas agree on tied holders."""
    clock = Clock()
    engines = [make_engine(i) for i in range(1000)]
    table = make_table(engines)
    candidates = table.routable(MODEL)
    assert len(candidates) > EXACT_SCAN_MAX

    def kv_policy(index: BlockIndex) -> Policy:
        config = RoutingConfig(policy="kv_aware")
        return make_policy(config, clock=clock, rng=random.Random(1), kv_index=index)

    index = BlockIndex()
    policy = kv_policy(index)
    prefix = make_policy(RoutingConfig(policy="prefix_aware"), clock=clock, rng=random.Random(1))
    tokens = tuple(range(64 * 16))  # 64 blocks of 16 tokens: 1,024 to prefill elsewhere
    holder = engines[7]
    index.speculate(holder.uid, block_keys(tokens, 16), now=clock.now, until=clock.now + 1e6)
    cached = RequestInfo(MODEL, opening="agent A", tokens=tokens)

    decision = policy.choose(candidates, cached)
    assert decision.engine is holder and decision.cached_tokens == len(tokens)
    holder.in_flight = 8 + 3  # 3 x 256 < 1,024 tokens to prefill elsewhere: still its
    assert policy.choose(candidates, cached).engine is holder
    holder.in_flight = 8 + 5  # 5 x 256 > 1,024: the prefix is prefilled on another engine
    moved = policy.choose(candidates, cached)
    assert moved.engine is prefix.choose(candidates, cached).engine is not holder
    holder.in_flight = 0
    assert policy.choose(candidates, cached, exclude={holder.uid}).engine is not holder

    clock.now += 10  # the decisions' speculative blocks have expired
    uncached = RequestInfo(MODEL, opening="agent B", tokens=tuple(range(10**6, 10**6 + 640)))
    assert policy.choose(candidates, uncached).engine is prefix.choose(candidates, uncached).engine

    # Two replicas' indexes with the same two holders: the same one is chosen by both.
    replicas = [BlockIndex(), BlockIndex()]
    for replica in replicas:
        for uid in (engines[3].uid, engines[900].uid):
            replica.speculate(uid, block_keys(tokens, 16), now=clock.now, until=clock.now + 1e6)
    chosen = {kv_policy(replica).choose(candidates, cached).engine.uid for replica in replicas}
    assert len(chosen) == 1 and chosen <= {engines[3].uid, engines[900].uid}


def test_kv_aware_sends_a_request_without_tokens_where_its_opening_last_went() -> None:
    """A request whose token ids did not come in time goes to the engine the last decision
    on its opening's token ids chose (which holds what that conversation or shared prompt
    left), not to wherever `prefix_aware` would place the opening; an opening never routed
    on tokens, and an excluded engine, fall back to `prefix_aware`."""
    clock = Clock()
    engines = [make_engine(i) for i in range(4)]
    table = make_table(engines)
    candidates = table.routable(MODEL)
    index = BlockIndex()
    policy = make_policy(
        RoutingConfig(policy="kv_aware"), clock=clock, rng=random.Random(1), kv_index=index
    )
    prefix = make_policy(RoutingConfig(policy="prefix_aware"), clock=clock, rng=random.Random(1))
    tokens = tuple(range(64 * 16))
    opening = RequestInfo(MODEL, opening="agent A")
    ring_owner = prefix.choose(candidates, opening).engine
    holder = next(e for e in engines if e is not ring_owner)
    index.speculate(holder.uid, block_keys(tokens, 16), now=clock.now, until=clock.now + 1e6)
    with_tokens = policy.choose(candidates, RequestInfo(MODEL, opening="agent A", tokens=tokens))
    assert with_tokens.engine is holder
    without = policy.choose(candidates, opening)
    assert without.engine is holder and "where its opening last went" in without.reason
    assert policy.choose(candidates, opening, exclude={holder.uid}).engine is not holder
    other = RequestInfo(MODEL, opening="agent B")
    assert policy.choose(candidates, other).engine is prefix.choose(candidates, other).engine


def test_kv_aware_spreads_a_burst_of_new_prompts_over_engines_without_pending_prefill() -> None:
    """Before the engines' figures say anything (the start of a burst: in-flight counts level
    within the slack), `kv_aware` counts the prefill it sent each engine that has not begun
    to answer (`routing.pending`): new prompts whose `prefix_aware` owner is one engine go
    to others while that one still prefills the first, a request sharing the first's prefix
    still goes to it (the prefix in prefill is its own), and once the first answer's first
    bytes are out (the decision's `started`), or `kv_speculative_ttl_s` later, the engine
    counts as free again."""
    clock = Clock()
    engines = [make_engine(i) for i in range(4)]
    candidates = make_table(engines).routable(MODEL)
    index = BlockIndex()
    policy = make_policy(
        RoutingConfig(policy="kv_aware", kv_cost="load"),
        clock=clock,
        rng=random.Random(1),
        kv_index=index,
    )
    prefix = make_policy(RoutingConfig(policy="prefix_aware"), clock=clock, rng=random.Random(1))

    def prompt(seed: int, size: int = 64 * 16) -> RequestInfo:
        start = seed * 10**6
        return RequestInfo(
            MODEL, opening=f"prompt {seed}", tokens=tuple(range(start, start + size))
        )

    # New prompts that prefix_aware places on one engine: the first, then three more.
    first = prompt(0)
    assert first.tokens is not None
    owner = prefix.choose(candidates, first).engine
    same_owner = [
        p for p in map(prompt, range(1, 400)) if prefix.choose(candidates, p).engine is owner
    ]
    assert len(same_owner) >= 3
    decided = policy.choose(candidates, first)
    assert decided.engine is owner and decided.started is not None
    spread = [policy.choose(candidates, p).engine for p in same_owner[:3]]
    assert owner not in spread and len(set(spread)) == 3  # one idle engine each
    # The first prompt's prefix with another question: to the engine prefilling it.
    follower = RequestInfo(MODEL, opening="prompt 0", tokens=(*first.tokens, 7, 8, 9))
    assert policy.choose(candidates, follower).engine is owner

    decided.started()  # the first answer's first bytes are out: its engine is free again
    decided.started()  # (once counts)
    clock.now += 0.5
    assert policy.choose(candidates, same_owner[3]).engine is owner
    clock.now += 2.0  # kv_speculative_ttl_s later: nothing of the burst is pending any more
    assert policy.choose(candidates, same_owner[4]).engine is owner


def test_kv_aware_among_many_engines_passes_a_new_prompt_over_an_engine_in_prefill() -> None:
    """Beyond EXACT_SCAN_MAX candidates a prompt no engine holds goes where `prefix_aware`
    places it unless that engine has prefill pending: then to the next engine `prefix_aware`
    would pick, which has none."""
    clock = Clock()
    engines = [make_engine(i) for i in range(200)]
    candidates = make_table(engines).routable(MODEL)
    policy = make_policy(
        RoutingConfig(policy="kv_aware"), clock=clock, rng=random.Random(1), kv_index=BlockIndex()
    )
    prefix = make_policy(RoutingConfig(policy="prefix_aware"), clock=clock, rng=random.Random(1))

    def prompt(seed: int) -> RequestInfo:
        return RequestInfo(MODEL, opening=f"prompt {seed}", tokens=tuple(range(seed, seed + 640)))

    first = prompt(0)
    owner = prefix.choose(candidates, first).engine
    others = (prompt(seed * 10**6) for seed in range(1, 10**5))
    other = next(p for p in others if prefix.choose(candidates, p).engine is owner)
    assert policy.choose(candidates, first).engine is owner
    moved = policy.choose(candidates, other)
    assert moved.engine is not owner
    assert moved.engine is prefix.choose(candidates, other, exclude={owner.uid}).engine
