"""`kv_aware` (`routing.kv_aware`) for LoRA adapters: a request for an adapter looks its
prompt up among the blocks the engines hold under that adapter, by the adapter's name, the
same on every engine whatever id each gave it; never among the base model's blocks or
another adapter's, which vLLM does not share with it. The index is fed the engines' events
as the subscriber decodes them (`kv.events.decode_payload`)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from trio_router.config import RoutingConfig
from trio_router.kv.events import decode_payload
from trio_router.kv.index import BlockIndex
from trio_router.routing.kv_aware import KvAwarePolicy
from trio_router.routing.policy import make_policy
from trio_router.routing.request import RequestInfo
from trio_router.table import Engine, EngineState, Model

BASE: Final = "llama"
BLOCK: Final = 16
ADAPTERS: Final = ("sql-lora", "chat-lora")


def engine(i: int, adapters: Sequence[str] = ADAPTERS) -> Engine:
    """An engine of BASE whose /v1/models lists `adapters`, in the order it loaded them."""
    models = (
        Model(BASE),
        *(Model(name, parent=BASE, root=f"/adapters/{name}") for name in adapters),
    )
    return Engine(
        uid=f"uid-{i}",
        name=f"engine-{i}",
        url=f"http://10.0.0.{i}",
        state=EngineState.ROUTABLE,
        models=models,
        model_ids=frozenset(m.id for m in models),
    )


def stored(tokens: Sequence[int], adapter: str | None, adapters: Sequence[str]) -> bytes:
    """A batch with one BlockStored event of `tokens` as vLLM 0.32 publishes it: an
    adapter's id is its place in the engine's load order (`adapters`), from 1."""
    lora_id = None if adapter is None else adapters.index(adapter) + 1
    seed = random.Random(f"{adapter}:{lora_id}")  # the engine's own hashes: opaque here
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [seed.getrandbits(64) for _ in range(len(tokens) // BLOCK)],
        "parent_block_hash": None,
        "token_ids": list(tokens),
        "block_size": BLOCK,
        "lora_id": lora_id,
        "medium": "GPU",
        "lora_name": adapter,
        "extra_keys": [None if adapter is None else [adapter]] * (len(tokens) // BLOCK),
        "group_idx": 0,
    }
    return msgspec.msgpack.encode([time.time(), [event], 0])


def kv_policy(index: BlockIndex) -> KvAwarePolicy:
    config = RoutingConfig(policy="kv_aware", kv_block_size=BLOCK, kv_cost="load")
    policy = make_policy(config, clock=lambda: 1000.0, rng=random.Random(1), kv_index=index)
    assert isinstance(policy, KvAwarePolicy)
    return policy


def test_an_adapter_request_goes_to_the_engine_holding_its_prefix_under_that_adapter() -> None:
    """The same prompt cached on four engines: for the base model on engine 0, for
    `chat-lora` on engine 1, for `sql-lora` on engine 2 (which loaded it second: id 2) and
    on engine 3 (id 1). A request for `sql-lora` goes to engine 2 or 3, and both hold all of
    it; one for the base model to engine 0; one for `chat-lora` to engine 1."""
    tokens = tuple(range(10 * BLOCK))
    orders = [ADAPTERS, ADAPTERS, ADAPTERS[::-1], ADAPTERS]
    engines = [engine(i, order) for i, order in enumerate(orders)]
    index = BlockIndex()
    for i, model in enumerate([None, "chat-lora", "sql-lora", "sql-lora"]):
        batch = decode_payload(b"kv", 0, stored(tokens, model, orders[i]))
        assert batch.skipped == 0
        index.apply(engines[i].uid, batch.events)
    policy = kv_policy(index)
    sql = policy.choose(engines, RequestInfo("sql-lora", opening="sql", tokens=tokens))
    assert sql.engine in engines[2:] and sql.cached_tokens == len(tokens)
    moved = policy.choose(engines, RequestInfo("sql-lora", tokens=tokens), {sql.engine.uid})
    assert moved.engine in engines[2:] and moved.engine is not sql.engine
    base = policy.choose(engines, RequestInfo(BASE, opening="base", tokens=tokens))
    assert base.engine is engines[0] and base.cached_tokens == len(tokens)
    chat = policy.choose(engines, RequestInfo("chat-lora", opening="chat", tokens=tokens))
    assert chat.engine is engines[1] and chat.cached_tokens == len(tokens)
    # What disaggregation asks: how much of the prompt the engine holds for the model.
    shares = {e.name: policy.cached_share(e, tokens, "sql-lora") for e in engines}
    assert shares == {"engine-0": 0.0, "engine-1": 0.0, "engine-2": 1.0, "engine-3": 1.0}
    assert policy.cached_share(engines[0], tokens, BASE) == 1.0


def test_a_request_without_tokens_follows_its_opening_under_its_own_model() -> None:
    """Without token ids a request goes where the last decision on its opening went; the
    memory of openings is per model: an adapter's request with the same opening as the
    base model's does not follow the base model's (it holds nothing of it there)."""
    tokens = tuple(range(10 * BLOCK))
    engines = [engine(i) for i in range(4)]
    index = BlockIndex()
    index.apply(engines[1].uid, decode_payload(b"kv", 0, stored(tokens, None, ADAPTERS)).events)
    index.apply(
        engines[2].uid, decode_payload(b"kv", 0, stored(tokens, "sql-lora", ADAPTERS)).events
    )
    policy = kv_policy(index)
    for model, holder in [(BASE, engines[1]), ("sql-lora", engines[2])]:
        decision = policy.choose(engines, RequestInfo(model, opening="shared", tokens=tokens))
        assert decision.engine is holder
    for model, holder in [(BASE, engines[1]), ("sql-lora", engines[2])]:
        decision = policy.choose(engines, RequestInfo(model, opening="shared"))
        assert decision.engine is holder and "where its opening last went" in decision.reason
