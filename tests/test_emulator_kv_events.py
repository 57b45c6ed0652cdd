"""KV-cache events of emulated engines over real ZMQ on loopback, as vLLM 0.32 publishes them:
the flag's JSON and its placement in a fleet, the wire (three frames, msgpack maps tagged
with "type", sequence numbers, the replay ROUTER socket, an adapter's fields), and the
router's own subscriber (kv_aware routing's block index) following emulated engines'
caches: a prefix served is found in the index under the engine that cached it, later
requests sharing it go there and hit, and an eviction or a subscription begun late is
followed too.

Everything waits on the index (`BlockIndex.wait_changed`) or on answers, never on sleeps."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final

import httpx
import msgspec
import pytest
import trio
import zmq

from trio_router import server
from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.emulator.app import serve_engine
from trio_router.emulator.engine import EmulatedEngine, EngineConfig
from trio_router.emulator.fleet import fleet_addresses, open_fleet, serve_fleet
from trio_router.emulator.kv_cache import hash_block
from trio_router.emulator.kv_events import KvEndpoints, KvEventsConfig
from trio_router.emulator.lora import LoraConfig, LoraModule
from trio_router.emulator.profiles import load_profile
from trio_router.emulator.tokens import Vocabulary
from trio_router.errors import ConfigError
from trio_router.kv.events import BlockStored, decode_payload
from trio_router.kv.index import BlockIndex, adapter_root, block_keys
from trio_router.table import RoutingTable
from trio_router.testing.harness import router_config
from trio_router.testing.vllm_engines import free_ports

LIMIT: Final = 20.0
HOSTS: Final = ["127.0.1.1", "127.0.1.2", "127.0.1.3"]
_SEQ: Final = struct.Struct(">q")
STORED_KEYS: Final = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
]


def events_config(port: int, replay_port: int = 0) -> KvEventsConfig:
    return KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}" if replay_port else None,
        topic="kv",
    )


def test_the_flag_reads_vllms_json_and_places_each_engine() -> None:
    config = KvEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv@{host}", "buffer_steps": 100}'
    )
    assert config.enabled and config.buffer_steps == 100
    assert not KvEventsConfig.parse('{"endpoint": "tcp://*:1"}').enabled  # vLLM's default
    assert not KvEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    # Alone: as given (a wildcard binds every address, as vLLM's does).
    assert config.endpoints() == KvEndpoints(
        publish="tcp://*:5557", bind=True, replay="tcp://*:5558", topic="kv@"
    )
    # In a fleet: each engine's own address, or the next port on a shared one.
    assert config.endpoints(2, "127.0.1.3") == KvEndpoints(
        publish="tcp://127.0.1.3:5557", bind=True, replay="tcp://127.0.1.3:5558",
        topic="kv@127.0.1.3",
    )  # fmt: skip
    assert config.endpoints(2, "127.0.0.1", consecutive=True).publish == "tcp://127.0.0.1:5559"
    connect = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://10.0.0.1:5557")
    assert connect.endpoints(3, "127.0.1.4") == KvEndpoints(
        publish="tcp://10.0.0.1:5557", bind=False, replay=None, topic=""
    )
    for bad, reason in [
        ("[]", "JSON object"),
        ("{", "not JSON"),
        ('{"enable_kv_cache_event": true}', "unknown key"),
        ('{"buffer_steps": "10"}', "wrong type"),
        ('{"hwm": true}', "wrong type"),
        ('{"publisher": "kafka"}', "zmq"),
        ('{"endpoint": "http://x:1"}', "not a ZMQ endpoint"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            KvEventsConfig.parse(bad)


@asynccontextmanager
async def publishing(**flags: Any) -> AsyncIterator[tuple[EngineConfig, str, str]]:
    """One engine on HOSTS[0] publishing events (blocks of 4): its config, its URL and its
    replay endpoint."""
    port, replay_port = free_ports(HOSTS[:1], 2)
    kv = events_config(port, replay_port)
    config = EngineConfig.from_profile(
        load_profile("h100"),
        time_scale=100.0,
        block_size=4,
        max_model_len=4096,
        kv_events=kv,
        **flags,
    )
    engine = EmulatedEngine(config)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            serve = partial(serve_engine, kv_endpoints=kv.endpoints(0, HOSTS[0]))
            url = await nursery.start(serve, engine, HOSTS[0], 0)
            yield config, url, f"tcp://{HOSTS[0]}:{replay_port}"
            nursery.cancel_scope.cancel()


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for every batch from `start`, as the router does (a DEALER)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", _SEQ.pack(start)])
        fd, answers = int(sock.getsockopt(zmq.FD)), []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await trio.lowlevel.wait_readable(fd)
                continue
            answers.append(frames)
            if frames[2] == _SEQ.pack(-1):
                return answers
    finally:
        context.destroy(linger=0)


async def test_the_wire_is_vllms() -> None:
    """New full blocks are announced once, as msgpack maps with vLLM 0.32's keys, in batches
    numbered from 0; a hit announces nothing; a reset goes out as AllBlocksCleared; the
    replay socket answers [b"", topic, seq, payload] per batch and ends with seq -1."""
    first, second = list(range(16, 26)), list(range(100, 108))  # 2 full blocks of 4 each
    async with publishing() as (_, url, replay_endpoint):
        async with httpx.AsyncClient(base_url=url) as client:
            for prompt in (first, first, second):  # the second is all hits: nothing new
                body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
            body = {"prompt": second, "max_tokens": 1, "ignore_eos": True}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        answers = await replay(replay_endpoint, 0)
        later = await replay(replay_endpoint, 2)
    assert [frames[:3] for frames in answers] == [
        [b"", b"kv", _SEQ.pack(0)],
        [b"", b"kv", _SEQ.pack(1)],
        [b"", b"kv", _SEQ.pack(2)],
        [b"", b"", _SEQ.pack(-1)],
    ]
    assert later == answers[2:]
    batches = [msgspec.msgpack.decode(frames[3]) for frames in answers[:3]]
    assert all(isinstance(b[0], float) and b[2] == 0 and len(b) == 3 for b in batches)
    (event,) = batches[0][1]
    assert list(event) == STORED_KEYS
    h1 = hash_block(None, first[:4])
    assert event == {
        "type": "BlockStored",
        "block_hashes": [h1, hash_block(h1, first[4:8])],
        "parent_block_hash": None,
        "token_ids": first[:8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert batches[1][1][0]["token_ids"] == second
    assert [e["type"] for e in batches[2][1]] == ["AllBlocksCleared", "BlockStored"]
    assert batches[2][1][0] == {"type": "AllBlocksCleared"}
    # The router's own decoder reads them.
    decoded = decode_payload(b"kv", 0, answers[0][3])
    assert decoded.skipped == 0 and isinstance(decoded.events[0], BlockStored)


async def test_an_adapters_blocks_name_it_and_the_routers_decoder_reads_them() -> None:
    """A request for an adapter publishes its blocks with vLLM 0.32's LoRA fields: `lora_id`
    (the adapter's id), `lora_name`, and the name as each block's extra key; the hashes are
    not the base model's for the same tokens. The router's decoder reads the event."""
    prompt = list(range(16, 25))  # 2 full blocks of 4
    lora = LoraConfig(enable_lora=True, modules=(LoraModule("sql", "/adapters/sql"),))
    async with publishing(lora=lora) as (_, url, replay_endpoint):
        async with httpx.AsyncClient(base_url=url) as client:
            for model in ("sql", None):
                body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True, "model": model}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
        answers = await replay(replay_endpoint, 0)
    (sql,), (base,) = (msgspec.msgpack.decode(frames[3])[1] for frames in answers[:2])
    assert list(sql) == STORED_KEYS
    assert (sql["lora_id"], sql["lora_name"], sql["extra_keys"]) == (1, "sql", [["sql"]] * 2)
    assert (base["lora_id"], base["lora_name"], base["extra_keys"]) == (None, None, [None] * 2)
    assert sql["token_ids"] == base["token_ids"] == prompt[:8]
    assert set(sql["block_hashes"]).isdisjoint(base["block_hashes"])
    decoded = decode_payload(b"kv", 0, answers[0][3])
    assert decoded.skipped == 0
    assert decoded.events == (
        BlockStored(
            tuple(sql["block_hashes"]), None, tuple(prompt[:8]), 4, lora_id=1, lora_name="sql"
        ),
    )
    # The router's index keeps the adapter's blocks apart from the base model's.
    index, keys = BlockIndex(), block_keys(prompt, 4)
    index.apply("e", decoded.events)
    assert index.match(keys, ["e"], 0.0) == {"e": 0}
    index.apply("e", decode_payload(b"kv", 1, answers[1][3]).events)
    assert index.match(keys, ["e"], 0.0) == {"e": 2}


def chat(system: str, question: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        "ignore_eos": True,
    }


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


@asynccontextmanager
async def kv_router(
    count: int, *, replay: bool = True, loras: Sequence[LoraConfig] = (), **flags: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, RoutingTable, BlockIndex, list[str], EngineConfig]]:
    """`count` emulated engines publishing their events (each on its own address, one port),
    and the router in static mode with kv_aware routing subscribed to them; with `loras`,
    engine i takes the LoRA flags `loras[i]`."""
    port, replay_port = free_ports(HOSTS[:count], 2)
    config = EngineConfig.from_profile(
        load_profile("h100"),
        time_scale=100.0,
        kv_events=events_config(port, replay_port if replay else 0),
        **flags,
    )
    configs = [dataclasses.replace(config, lora=lora) for lora in loras] or [config] * count
    addresses = fleet_addresses(HOSTS[0], 0, count, consecutive_ports=False)
    index, table = BlockIndex(), RoutingTable()
    routing = {"policy": "kv_aware", "kv_block_size": 16, "tokenize_timeout_s": 2.0}
    events = {"mode": "connect", "port": port, "replay_port": replay_port if replay else 0}
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve_fleet, configs, addresses)
            run = partial(
                server.run,
                router_config(urls, routing=routing, kv_events=events),
                table=table,
                kv_index=index,
                handle_signals=False,
            )
            bound = await nursery.start(run)
            while len(table.routable(config.served_model_name)) < count:
                await table.wait_changed()
            async with httpx.AsyncClient(base_url=bound[0]) as client:
                yield client, table, index, urls, config
            nursery.cancel_scope.cancel()


def held(
    table: RoutingTable, index: BlockIndex, tokens: list[int], adapter: str | None = None
) -> dict[str, int]:
    """Leading full blocks of `tokens` each engine holds (under `adapter`, if given), as its
    own events told the index (decisions not yet confirmed by events do not count)."""
    keys = block_keys(tokens, 16, parent=adapter_root(adapter))
    found = index.match(keys, [e.uid for e in table], now=math.inf)
    return {e.url: found[e.uid] for e in table}


async def until(index: BlockIndex, condition: Callable[[], bool]) -> None:
    while not condition():
        await index.wait_changed()


async def test_the_routers_index_follows_an_emulated_engines_cache() -> None:
    """A prefix served is found in the router's index under the engine that cached it, block
    for block; requests sharing it go there and hit its cache; when that engine evicts it
    (other prompts sent to it directly), the index forgets it."""
    async with kv_router(3, num_gpu_blocks=80, max_model_len=1024) as (
        client,
        table,
        index,
        _,
        config,
    ):
        model, vocab = config.served_model_name, Vocabulary(config.profile.engine.vocab_size)
        system = words("doc", 120)
        tokens = vocab.chat_ids(chat(system, "")["messages"][:1], add_generation_prompt=False)
        reply = await client.post(
            "/v1/chat/completions", json={"model": model, **chat(system, "a")}
        )
        assert reply.status_code == 200, reply.text
        owner = next(e.url for e in table if e.name == reply.headers["x-trio-router-engine"])
        blocks = len(tokens) // 16
        await until(index, lambda: held(table, index, tokens)[owner] == blocks)
        assert blocks >= 7 and sum(held(table, index, tokens).values()) == blocks
        later = set()
        for i in range(4):
            reply = await client.post(
                "/v1/chat/completions", json={"model": model, **chat(system, f"question {i}")}
            )
            later.add(reply.headers["x-trio-router-engine"])
        metrics = parse_vllm_metrics((await client.get(f"{owner}/metrics")).text)
        assert [e.url for e in table if e.name in later] == [owner]
        assert metrics["prefix_cache_hits"] >= 4 * blocks * 16
        # Other prompts sent to the owner fill its 79 blocks: the shared prefix is evicted
        # (one BlockRemoved per block) and the index follows.
        for i in range(4):
            body = {"model": model, "prompt": words(f"filler{i}-", 400), "max_tokens": 1}
            assert (await client.post(f"{owner}/v1/completions", json=body)).status_code == 200
        await until(index, lambda: held(table, index, tokens)[owner] == 0)


async def test_an_adapters_request_goes_where_its_prefix_is_cached_under_that_adapter() -> None:
    """Three engines load the adapters `sql-lora` and `chat-lora`, the second in the other
    order (there `sql-lora` has id 2). One prompt is cached on each, sent to them directly:
    for the base model on the first, for `sql-lora` on the second, for `chat-lora` on the
    third. A request for `sql-lora` through the router goes to the second, not to the holders
    of the same prompt for the base model or the other adapter; and once the third caches it
    for `sql-lora` too (id 1 there), the index finds it held under `sql-lora` on both."""
    sql, chat_lora = LoraModule("sql-lora", "/adapters/sql"), LoraModule("chat-lora", "/a/chat")
    orders = [(sql, chat_lora), (chat_lora, sql), (sql, chat_lora)]
    loras = [LoraConfig(enable_lora=True, max_loras=2, modules=order) for order in orders]
    async with kv_router(3, loras=loras, max_model_len=1024) as (
        client,
        table,
        index,
        urls,
        config,
    ):
        vocab = Vocabulary(config.profile.engine.vocab_size)
        system = words("doc", 120)
        tokens = vocab.chat_ids(chat(system, "")["messages"][:1], add_generation_prompt=False)
        blocks = len(tokens) // 16

        async def cache(url: str, model: str, adapter: str | None) -> None:
            body = {"model": model, **chat(system, "direct")}
            reply = await client.post(f"{url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            await until(index, lambda: held(table, index, tokens, adapter)[url] == blocks)

        await cache(urls[0], config.served_model_name, None)
        await cache(urls[1], "sql-lora", "sql-lora")
        await cache(urls[2], "chat-lora", "chat-lora")
        reply = await client.post(
            "/v1/chat/completions", json={"model": "sql-lora", **chat(system, "routed")}
        )
        assert reply.status_code == 200, reply.text
        routed = next(e.url for e in table if e.name == reply.headers["x-trio-router-engine"])
        await cache(urls[2], "sql-lora", "sql-lora")
        under_sql = held(table, index, tokens, "sql-lora")
    assert blocks >= 7 and routed == urls[1]
    assert under_sql == {urls[0]: 0, urls[1]: blocks, urls[2]: blocks}


async def test_a_late_subscription_learns_the_cache_from_the_replay_socket() -> None:
    """What an engine cached before the router subscribed is in its replay buffer: the
    router's subscriber asks for it as soon as it subscribes."""
    port, replay_port = free_ports(HOSTS[:1], 2)
    kv = events_config(port, replay_port)
    config = EngineConfig.from_profile(load_profile("h100"), time_scale=100.0, kv_events=kv)
    vocab = Vocabulary(config.profile.engine.vocab_size)
    prompt = words("early", 100)
    tokens = vocab.prompt_ids(prompt)
    index, table = BlockIndex(), RoutingTable()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            engine = EmulatedEngine(config)
            serve = partial(serve_engine, kv_endpoints=kv.endpoints(0, HOSTS[0]))
            url = await nursery.start(serve, engine, HOSTS[0], 0)
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"prompt": prompt, "max_tokens": 1}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            routing = {"policy": "kv_aware", "kv_block_size": 16}
            events = {"mode": "connect", "port": port, "replay_port": replay_port}
            run = partial(
                server.run,
                router_config([url], routing=routing, kv_events=events),
                table=table,
                kv_index=index,
                handle_signals=False,
            )
            await nursery.start(run)
            await until(index, lambda: held(table, index, tokens).get(url, 0) == len(tokens) // 16)
            nursery.cancel_scope.cancel()


async def test_a_killed_engine_served_again_publishes_from_sequence_0() -> None:
    """Kill and recover (a restarted pod): the fresh engine binds the same endpoints again
    (once ZMQ has released them) and numbers its batches from 0, with an empty buffer."""
    port, replay_port = free_ports(HOSTS[:1], 2)
    config = EngineConfig.from_profile(
        load_profile("h100"), time_scale=100.0, kv_events=events_config(port, replay_port)
    )
    addresses = fleet_addresses(HOSTS[0], 0, 1, consecutive_ports=False)
    endpoint = f"tcp://{HOSTS[0]}:{replay_port}"
    body = {"prompt": words("w", 40), "max_tokens": 1}
    with trio.fail_after(LIMIT):
        async with open_fleet([config], addresses) as fleet, httpx.AsyncClient() as client:
            for _ in range(2):
                reply = await client.post(f"{fleet.urls[0]}/v1/completions", json=body)
                assert reply.status_code == 200
            assert len(await replay(endpoint, 0)) == 2  # one batch (the hit adds none), the end
            fleet.kill(0)
            await fleet.restart(0)
            reply = await client.post(f"{fleet.urls[0]}/v1/completions", json=body)
            assert reply.status_code == 200
            answers = await replay(endpoint, 0)
    assert [frames[2] for frames in answers] == [_SEQ.pack(0), _SEQ.pack(-1)]
