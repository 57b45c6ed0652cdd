"""KV-aware routing (`kv/`, `routing.kv_aware`): the event decoder, the block index, and the
router in front of fake engines whose prefix caches publish vLLM's KV-cache events over real
ZMQ (`trio_router.testing.fake_kv`), each with its own secret block hash.

The end-to-end tests wait on the block index (`BlockIndex.wait_changed`), never on sleeps."""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.testing
import zmq

from trio_router.config import KvEventsConfig
from trio_router.http import UpstreamPool
from trio_router.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedMessage,
    decode_message,
)
from trio_router.kv.index import BlockIndex, adapter_root, block_keys
from trio_router.kv.subscriber import KvEvents
from trio_router.table import Engine, RoutingTable
from trio_router.testing import FakeEngine
from trio_router.testing.fake_kv import FakeKvCache, open_fake_kv
from trio_router.testing.fake_replies import prompt_tokens
from trio_router.testing.harness import CHAT, LIMIT, Router, open_router, sample
from trio_router.testing.vllm_engines import free_port

B: Final = 4  # the fake caches' block size
HOSTS: Final = ["127.0.1.1", "127.0.1.2", "127.0.1.3"]


def message(events: list[Any], seq: int = 0, topic: bytes = b"kv") -> list[bytes]:
    return [topic, struct.pack(">q", seq), msgspec.msgpack.encode([time.time(), events, 0])]


# -- the wire format --------------------------------------------------------------------------
def test_both_encodings_decode_and_bad_events_are_skipped() -> None:
    tokens = list(range(8))
    as_maps = [
        {
            "type": "BlockStored",
            "block_hashes": [2**64 - 1, b"\x01" * 32],
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None, None],
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 4},
    ]
    as_arrays = [
        ["BlockStored", [5, 6], 4, tokens, 4, None, "GPU"],
        ["BlockRemoved", [5], "GPU"],
        ["AllBlocksCleared"],
        ["Unknown", 1],
        "not an event",
    ]
    maps = decode_message(message(as_maps, seq=9))
    arrays = decode_message(message(as_arrays))
    assert maps.seq == 9 and maps.skipped == 2
    assert maps.events == (
        BlockStored((2**64 - 1, b"\x01" * 32), None, tuple(tokens), 4),
        BlockRemoved((7,)),
        AllBlocksCleared(),
    )
    assert arrays.skipped == 2
    assert arrays.events == (
        BlockStored((5, 6), 4, tuple(tokens), 4),
        BlockRemoved((5,)),
        AllBlocksCleared(),
    )
    for bad in ([b"kv", b"\x00"], [b"kv", struct.pack(">q", 0), b"\xc1"]):
        with pytest.raises(MalformedMessage):
            decode_message(bad)


# -- the block index --------------------------------------------------------------------------
def test_the_index_chains_an_engines_blocks_through_its_own_hashes() -> None:
    index = BlockIndex()
    tokens = list(range(12))  # three blocks
    keys = block_keys(tokens, B)
    index.apply("a", [BlockStored((101, 102), None, tuple(tokens[:8]), B)])
    index.apply("a", [BlockStored((103,), 102, tuple(tokens[8:]), B)])  # chained on 102
    index.apply("b", [BlockStored((7,), None, tuple(tokens[:4]), B)])
    assert index.match(keys, ["a", "b", "c"], now=0.0) == {"a": 3, "b": 1, "c": 0}
    assert index.block_size(["c", "a"]) == B
    # Stored twice (vLLM re-stores a block a generation refills): removed twice to go.
    index.apply("b", [BlockStored((7,), None, tuple(tokens[:4]), B)])
    index.apply("b", [BlockRemoved((7,))])
    assert index.match(keys, ["b"], now=0.0) == {"b": 1}
    result = index.apply("b", [BlockRemoved((7,)), BlockRemoved((99,))])
    assert result.skipped == 1 and index.match(keys, ["b"], now=0.0) == {"b": 0}
    # Eviction tail first; an unknown parent cannot be chained.
    index.apply("a", [BlockRemoved((103,))])
    assert index.match(keys, ["a"], now=0.0) == {"a": 2}
    assert index.apply("c", [BlockStored((1,), 424242, tuple(tokens[:4]), B)]).skipped == 1
    index.apply("a", [AllBlocksCleared()])
    assert index.blocks("a") == 0 and index.blocks() == 0


def test_an_adapters_name_and_id_are_decoded_from_either_encoding() -> None:
    """vLLM 0.32 publishes an adapter's blocks with its name (`lora_name`) after its id
    (`lora_id`, deprecated) and `medium`; older releases sent only the id. Each is read where
    there is one, and a name that is not a string makes the event unreadable."""
    tokens = list(range(8))
    stored = {"type": "BlockStored", "parent_block_hash": None, "token_ids": tokens}
    as_maps = [
        stored
        | {
            "block_hashes": [1, 2],
            "block_size": 4,
            "lora_id": 1,
            "medium": "GPU",
            "lora_name": "sql-lora",
            "extra_keys": [["sql-lora"], ["sql-lora"]],
        },
        stored | {"block_hashes": [3, 4], "block_size": 4, "lora_id": 2},  # no name: older
        stored | {"block_hashes": [5, 6], "block_size": 4, "lora_name": "sql-lora"},
        stored | {"block_hashes": [7, 8], "block_size": 4, "lora_id": 1, "lora_name": 7},
    ]
    as_arrays = [
        ["BlockStored", [1, 2], None, tokens, 4, 2, "GPU", "sql-lora", [["sql-lora"]] * 2],
        ["BlockStored", [3, 4], None, tokens, 4, 3],
        ["BlockStored", [5, 6], None, tokens, 4, None, "GPU", None],
    ]
    maps = decode_message(message(as_maps))
    arrays = decode_message(message(as_arrays))
    assert maps.skipped == 1
    assert [(e.lora_id, e.lora_name) for e in maps.events if isinstance(e, BlockStored)] == [
        (1, "sql-lora"),
        (2, None),
        (None, "sql-lora"),
    ]
    assert arrays.skipped == 0
    assert [(e.lora_id, e.lora_name) for e in arrays.events if isinstance(e, BlockStored)] == [
        (2, "sql-lora"),
        (3, None),
        (None, None),
    ]


def test_an_adapters_blocks_are_keyed_by_its_name_whatever_its_id_on_each_engine() -> None:
    """An adapter has the id of its load order on each engine: `sql-lora` is 1 on "a" and 2
    on "b". Both hold the prompt under `sql-lora` (its name's root, chained on through the
    engines' own hashes); neither holds it for the base model ("c" does) or for the adapter
    "other" that has id 1 on "d"; an engine that publishes only the id ("e", older vLLM) has
    its adapter blocks kept apart from everyone's."""
    index = BlockIndex()
    tokens = tuple(range(12))  # three blocks
    for uid, lora_id, name in [
        ("a", 1, "sql-lora"),
        ("b", 2, "sql-lora"),
        ("c", None, None),
        ("d", 1, "other"),
        ("e", 1, None),
    ]:
        index.apply(uid, [BlockStored((101, 102), None, tokens[:8], B, lora_id, name)])
        index.apply(uid, [BlockStored((103,), 102, tokens[8:], B, lora_id, name)])
    uids = ["a", "b", "c", "d", "e"]
    sql = block_keys(tokens, B, parent=adapter_root("sql-lora"))
    assert index.match(sql, uids, now=0.0) == {"a": 3, "b": 3, "c": 0, "d": 0, "e": 0}
    base = block_keys(tokens, B)
    assert block_keys(tokens, B, parent=adapter_root(None)) == base
    assert index.match(base, uids, now=0.0) == {"a": 0, "b": 0, "c": 3, "d": 0, "e": 0}
    other = block_keys(tokens, B, parent=adapter_root("other"))
    assert index.match(other, uids, now=0.0) == {"a": 0, "b": 0, "c": 0, "d": 3, "e": 0}
    index.apply("b", [BlockRemoved((103,))])
    assert index.match(sql, uids, now=0.0)["b"] == 2


def test_speculative_blocks_count_until_they_expire() -> None:
    index = BlockIndex()
    keys = block_keys(list(range(16)), B)
    index.speculate("a", keys[:2], now=0.0, until=2.0)
    assert index.match(keys, ["a", "b"], now=1.0) == {"a": 2, "b": 0}
    index.speculate("b", keys[:1], now=1.5, until=3.0)
    assert index.match(keys, ["a", "b"], now=2.5) == {"a": 0, "b": 1}
    index.speculate("b", keys[:1], now=5.0, until=6.0)  # prunes what expired
    assert index.match(keys, ["a", "b"], now=5.5) == {"a": 0, "b": 1}


def test_an_engine_beyond_its_block_bound_is_cleared() -> None:
    index = BlockIndex(max_blocks=2)
    tokens = tuple(range(12))
    assert index.apply("a", [BlockStored((1, 2, 3), None, tokens, B)]).cleared
    assert index.blocks("a") == 0


# -- the router in front of fake engines with KV events ---------------------------------------
def chat(system: str, question: str = "go") -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    }


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


@asynccontextmanager
async def open_kv_router(
    count: int = 2,
    *,
    capacity: int = 64,
    replay: bool = False,
    stats: dict[str, Any] | None = None,
    **routing: Any,
) -> AsyncIterator[tuple[Router, list[FakeKvCache], BlockIndex]]:
    port = free_port(HOSTS[:count])
    replay_port = free_port(HOSTS[:count]) if replay else 0
    caches = [
        FakeKvCache(port=port, replay_port=replay_port, block_size=B, capacity=capacity)
        for _ in range(count)
    ]
    engines = [FakeEngine(name=f"e{i}", kv=cache) for i, cache in enumerate(caches)]
    index = BlockIndex()
    async with open_router(
        engines,
        kv_index=index,
        routing={"policy": "kv_aware", "kv_block_size": B, **routing},
        kv_events={"mode": "connect", "port": port, "replay_port": replay_port},
        stats=stats or {"interval_s": 0.0},
    ) as router:
        yield router, caches, index


async def until(index: BlockIndex, condition: Callable[[], bool]) -> None:
    while not condition():
        await index.wait_changed()


async def send(router: Router, body: dict[str, Any]) -> str:
    answer = await router.client.post(CHAT, json=body)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-trio-router-engine"]


def holder(router: Router, index: BlockIndex, body: dict[str, Any]) -> dict[str, int]:
    """Leading blocks of `body`'s prompt each engine holds, as its own events told the
    router's index (what routing just sent there, not yet confirmed, does not count)."""
    keys = block_keys(prompt_tokens(body), B)
    held = index.match(keys, [e.uid for e in router.table], now=math.inf)
    return {e.name: held[e.uid] for e in router.table}


async def test_a_shared_prefix_goes_where_the_first_request_left_it() -> None:
    with trio.fail_after(LIMIT):
        async with open_kv_router() as (router, caches, index):
            system = words("doc", 40)
            first = await send(router, chat(system, "a"))
            owner = caches[int(first.split(":")[0][-1]) - 1]
            await until(index, lambda: index.blocks() >= len(prompt_tokens(chat(system))) // B)
            later = {await send(router, chat(system, f"question {i}")) for i in range(4)}
            predicted = await router.metric(
                "trio_router_kv_predicted_cached_tokens_total", engine=first
            )
            other = {await send(router, chat(words("other", 40), "a"))}
    assert later == {first}  # every one to the engine that cached the system prompt
    assert owner.hits >= 4 * 40  # and it served the shared prefix from its cache
    assert predicted == owner.hits  # as the router expected, block for block
    assert other  # a new prefix still routes


async def test_the_time_cost_learns_from_the_engines_figures_and_exports_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engines export vLLM's TTFT and queue-time histograms and token counters, scraped
    every 0.2 s while requests go to them: once the intervals between scrapes have fitted the
    rates, each decision predicts a first token (the decision log says when), and the error
    of each streamed answer's prediction is in trio_router_kv_ttft_prediction_error_seconds,
    per engine."""
    caplog.set_level(logging.DEBUG, logger="trio_router.serving.failover")

    def predicted() -> list[str]:
        return [r.getMessage() for r in caplog.records if "first token in" in r.getMessage()]

    with trio.fail_after(LIMIT):
        async with open_kv_router(stats={"interval_s": 0.2, "timeout_s": 1.0}) as (
            router,
            _caches,
            _index,
        ):
            warm = 0
            while not predicted():  # requests until scrapes between them have fitted it
                await send(router, chat(words(f"warm{warm}-", 12)))
                warm += 1
            engines = [e.name for e in router.table]

            async def observed() -> float:
                return sum(
                    [
                        await router.metric(
                            "trio_router_kv_ttft_prediction_error_seconds_count", engine=name
                        )
                        for name in engines
                    ]
                )

            before, caplog_before = await observed(), len(predicted())
            for i in range(4):  # streamed: their first bytes are their first tokens
                await send(router, chat(words(f"timed{i}-", 12)) | {"stream": True})
            streamed = await observed()
            for i in range(2):  # whole answers: predicted, but their first bytes are no timing
                await send(router, chat(words(f"whole{i}-", 12)))
            after = await observed()
    assert warm >= 8  # a fit needs 8 first tokens
    assert len(predicted()) - caplog_before == 6, caplog.text
    assert streamed - before == 4 and after == streamed


async def test_eviction_and_a_cleared_cache_move_traffic_and_a_restart_drops_the_engine() -> None:
    with trio.fail_after(LIMIT):
        async with open_kv_router(capacity=24) as (router, caches, index):
            system = words("doc", 40)  # 10+ blocks
            name = await send(router, chat(system))
            at = next(i for i, e in enumerate(router.table) if e.name == name)
            await until(index, lambda: holder(router, index, chat(system))[name] >= 10)
            # Evicted: the engine's cache fills with other prompts.
            caches[at].serve(prompt_tokens(chat(words("filler", 100))))
            await until(index, lambda: holder(router, index, chat(system))[name] == 0)
            # Cached again, then cleared (vLLM's /reset_prefix_cache).
            caches[at].serve(prompt_tokens(chat(system)))
            await until(index, lambda: holder(router, index, chat(system))[name] >= 10)
            caches[at].reset()
            await until(index, lambda: holder(router, index, chat(system))[name] == 0)
            # Restarted: its sequence starts again at 0, and what it held is forgotten.
            caches[at].serve(prompt_tokens(chat(system)))
            await until(index, lambda: holder(router, index, chat(system))[name] >= 10)
            caches[at].restart()
            caches[at].serve(prompt_tokens(chat(words("fresh", 8))))
            await until(index, lambda: holder(router, index, chat(system))[name] == 0)
            resets = await router.metric("trio_router_kv_resets_total", engine=name)
    assert resets >= 2  # AllBlocksCleared and the restart


async def test_a_sequence_gap_is_filled_by_a_replay() -> None:
    with trio.fail_after(LIMIT):
        async with open_kv_router(replay=True) as (router, _, index):
            # A first batch from the engine that served it: its stream is known.
            name = await send(router, chat(words("warm", 8)))
            engine = next(e for e in router.table if e.name == name)
            await until(index, lambda: index.blocks(engine.uid) > 0)
            cache = router.engine_named(name).kv
            assert cache is not None
            cache.drop_next = 1  # this batch is numbered but never sent
            lost = chat(words("lost", 40))
            cache.serve(prompt_tokens(lost))
            cache.serve(prompt_tokens(chat(words("after", 8))))  # the gap shows here
            await until(index, lambda: holder(router, index, lost)[name] >= 10)
            gaps = await router.metric("trio_router_kv_gaps_total", engine=name)
            replays = await router.metric("trio_router_kv_replays_total", engine=name)
    assert (gaps, replays) == (1, 1)


async def test_a_removed_engine_leaves_the_index() -> None:
    with trio.fail_after(LIMIT):
        async with open_kv_router() as (router, _, index):
            await send(router, chat(words("doc", 40)))
            await until(index, lambda: index.blocks() > 0)
            for engine in list(router.table):
                router.table.remove(engine.uid)
            assert index.blocks() == 0


async def test_without_tokens_in_time_it_routes_by_prefix_and_counts_the_fallback() -> None:
    engines = [FakeEngine(name=f"e{i}", ttft_s=0.0) for i in range(2)]
    with trio.fail_after(LIMIT):
        async with open_router(
            engines,
            routing={"policy": "kv_aware", "tokenize_timeout_s": 0.001},
        ) as router:
            for engine in engines:
                engine.gate = trio.Event()  # /tokenize (and everything) waits
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, router, chat(words("doc", 40)))
                # The chat reaches an engine only once the router gave up on its tokens.
                async with trio.open_nursery() as waiting:

                    async def until_chat(engine: FakeEngine) -> None:
                        await engine.wait_until(lambda: bool(engine.requests_to(CHAT)))
                        waiting.cancel_scope.cancel()

                    for engine in engines:
                        waiting.start_soon(until_chat, engine)
                for engine in engines:
                    assert engine.gate is not None
                    engine.gate.set()
            text = (await router.client.get("/metrics")).text
    assert sample(text, "trio_router_tokenize_fallbacks_total", reason="timeout") == 1


async def test_a_new_subscription_learns_what_the_engine_published_before_it() -> None:
    """With a replay endpoint, a subscriber asks for the engine's history as soon as the
    publisher has its subscription: blocks cached before the router started (or published
    before the subscription took effect) are known with no new event."""
    port, replay_port = free_port(HOSTS[:1]), free_port(HOSTS[:1])
    cache = FakeKvCache(port=port, replay_port=replay_port, block_size=B)
    table = RoutingTable()
    engine = Engine(uid="e", name="e", url=f"http://{HOSTS[0]}:8000")
    table.put(engine)
    index = BlockIndex()
    config = KvEventsConfig(mode="connect", port=port, replay_port=replay_port)
    events = KvEvents(index, config, table)
    tokens = prompt_tokens(chat(words("before", 20)))
    with trio.fail_after(LIMIT):
        async with open_fake_kv(cache, HOSTS[0], port, replay_port=replay_port):
            cache.serve(tokens)  # published while nobody listens
            async with trio.open_nursery() as nursery:
                pool = UpstreamPool(connect_timeout=1.0, read_timeout=1.0)
                nursery.start_soon(events.run_engine, engine, 0, pool)
                await until(index, lambda: index.blocks("e") > 0)
                # The blocks are applied before the replay's end comes: the replay is done
                # once it is counted (re-checked whenever every task waits).
                while not (counters := events.counters["e"]).replays + counters.replay_failures:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                nursery.cancel_scope.cancel()
    events.close()
    keys = block_keys(tokens, B)
    assert index.match(keys, ["e"], now=math.inf)["e"] == len(keys)
    assert events.counters["e"].replays == 1 and events.counters["e"].gaps == 0


def stored(n: int, *, first: bool = False) -> list[Any]:
    """A batch storing one block of B tokens, hash n + 1, its parent the block before (none
    for the first of a chain)."""
    return [
        {
            "type": "BlockStored",
            "block_hashes": [n + 1],
            "parent_block_hash": None if first or n == 0 else n,
            "token_ids": list(range(n * B, (n + 1) * B)),
            "block_size": B,
            "lora_id": None,
            "medium": "GPU",
        }
    ]


async def test_a_replay_ends_on_the_engines_silence_not_its_length(
    mock_clock: trio.testing.MockClock,
) -> None:
    """`replay_timeout_s` is how long the engine may stay silent during a replay: a long
    replay that keeps coming is applied whole however long it takes (vLLM keeps 10,000
    batches), and one that stops for longer is given up (counted) and the live stream
    carries on. Virtual time moves when the test says (or, to end a hang, after LIMIT real
    seconds with nothing happening)."""
    port, replay_port = free_port(HOSTS[:1]), free_port(HOSTS[:1])
    table = RoutingTable()
    engine = Engine(uid="e", name="e", url=f"http://{HOSTS[0]}:8000")
    table.put(engine)
    index = BlockIndex()
    config = KvEventsConfig(
        mode="connect", port=port, replay_port=replay_port, replay_timeout_s=2.0
    )
    events = KvEvents(index, config, table)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher, replays = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    publisher.bind(f"tcp://{HOSTS[0]}:{port}")
    replays.bind(f"tcp://{HOSTS[0]}:{replay_port}")
    replays_fd = int(replays.getsockopt(zmq.FD))

    async def request() -> tuple[bytes, int]:
        while True:
            try:
                identity, _, start = replays.recv_multipart(zmq.NOBLOCK)
                return identity, struct.unpack(">q", start)[0]
            except zmq.Again:
                await trio.lowlevel.wait_readable(replays_fd)

    def reply(identity: bytes, n: int) -> None:
        replays.send_multipart([identity, b"", *message(stored(n), n)])

    # Virtual time moves when the test says, and on its own only once nothing has happened
    # for LIMIT real seconds (a hang): then to the next deadline, in the end fail_after's.
    mock_clock.autojump_threshold = LIMIT
    try:
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                pool = UpstreamPool(connect_timeout=1.0, read_timeout=1.0)
                nursery.start_soon(events.run_engine, engine, 0, pool)
                identity, start = await request()  # the new subscription's history
                assert start == 0
                began = trio.current_time()
                for n in range(5):  # 1.5 s between batches: 7.5 s in all
                    reply(identity, n)
                    await until(index, partial(has_blocks, index, n + 1))
                    mock_clock.jump(1.5)
                replays.send_multipart([identity, b"", b"", struct.pack(">q", -1), b""])
                publisher.send_multipart(message(stored(5), 5))  # live, after the replay
                await until(index, lambda: index.blocks("e") == 6)
                assert trio.current_time() - began > config.replay_timeout_s
                counters = events.counters["e"]
                assert (counters.replays, counters.replay_failures) == (1, 0)

                publisher.send_multipart(message(stored(7, first=True), 7))  # a gap: 6 asked
                identity, start = await request()
                assert start == 6
                reply(identity, 6)
                await until(index, lambda: index.blocks("e") == 7)
                mock_clock.jump(2.5)  # and then nothing more
                await trio.testing.wait_all_tasks_blocked()
                assert counters.replay_failures == 1
                # Given up: the entries are rebuilt from the batch that showed the gap on.
                assert index.blocks("e") == 1
                publisher.send_multipart(message(stored(8), 8))
                await until(index, lambda: index.blocks("e") == 2)
                nursery.cancel_scope.cancel()
    finally:
        events.close()
        context.destroy(linger=0)


def has_blocks(index: BlockIndex, count: int) -> bool:
    return index.blocks("e") == count


async def until_either(engines: list[FakeEngine], predicate: Callable[[], bool]) -> None:
    """Until `predicate()` holds, re-checked whenever any of `engines` observes something."""
    async with trio.open_nursery() as nursery:

        async def watch(engine: FakeEngine) -> None:
            await engine.wait_until(predicate)
            nursery.cancel_scope.cancel()

        for engine in engines:
            nursery.start_soon(watch, engine)


async def test_an_engine_prefilling_a_new_prompt_is_passed_over_until_its_answer_begins() -> None:
    """Both engines hold their answers (a gate each), so no prefill the router sent has begun
    to answer: new prompts go to the engine not busy with the long one, a request sharing the
    long prompt's prefix goes to the engine prefilling it, and once that engine's answers are
    out (their first bytes passed on) a new prompt goes there again."""
    port = free_port(HOSTS[:2])
    caches = [FakeKvCache(port=port, replay_port=0, block_size=B, capacity=256) for _ in "ab"]
    gates = [trio.Event(), trio.Event()]
    engines = [
        FakeEngine(name=f"e{i}", kv=cache, gate=gate, gate_tokenizer=False)
        for i, (cache, gate) in enumerate(zip(caches, gates, strict=True))
    ]
    answered = {name: trio.Event() for name in ("long", "follower")}
    engine_of: dict[str, str] = {}

    async def ask(name: str, body: dict[str, Any]) -> None:
        engine_of[name] = await send(router, body)
        if name in answered:
            answered[name].set()

    def chats() -> list[int]:  # the chats each engine was sent (held at its gate)
        return [len(e.requests_to(CHAT)) for e in engines]

    def sent(count: int) -> bool:
        return sum(chats()) == count

    with trio.fail_after(LIMIT):
        async with (
            open_router(
                engines,
                kv_index=BlockIndex(),
                routing={"policy": "kv_aware", "kv_block_size": B},
                kv_events={"mode": "connect", "port": port, "replay_port": 0},
                stats={"interval_s": 0.0},
            ) as router,
            trio.open_nursery() as nursery,
        ):
            system = words("long", 200)
            nursery.start_soon(ask, "long", chat(system))
            await until_either(engines, partial(sent, 1))
            busy = chats().index(1)
            for k in range(3):
                nursery.start_soon(ask, f"short {k}", chat(words(f"short{k}-", 20)))
                await until_either(engines, partial(sent, 2 + k))
            spread = chats()
            nursery.start_soon(ask, "follower", chat(system, "another question"))
            await until_either(engines, partial(sent, 5))
            followed = chats()[busy]
            gates[busy].set()  # its answers go out: its prefill is done
            for event in answered.values():
                await event.wait()
            nursery.start_soon(ask, "after", chat(words("after", 100)))
            await until_either(engines, partial(sent, 6))
            after = chats()[busy]
            gates[1 - busy].set()
    assert spread[busy] == 1 and spread[1 - busy] == 3  # the new prompts: to the idle engine
    assert followed == 2  # the long prompt's prefix: to the engine prefilling it
    assert after == 3  # its prefill done, the engine takes a new prompt again
    assert engine_of["follower"] == engine_of["long"] == engine_of["after"]
