"""vLLM 0.32's KV-cache events as values (no I/O): the events, their batch, and the
`--kv-events-config` they are published under.

The event classes are vLLM's own msgspec structs (`vllm/distributed/kv_events.py`), field for
field and in the same order, so they encode to the same msgpack: each event a map tagged with
`"type"` (its class name), fields left out when they hold their default; a batch is the array
`[ts, [event, ...], data_parallel_rank]`. `BlockStored` carries what vLLM 0.32 fills in for a
text-only request on one full-attention KV-cache group: the blocks' hashes (uint64), the
parent's hash, their token ids, the block size, the adapter's `lora_id` and `lora_name` (None
without one), medium "GPU", one `extra_keys` entry per block (None, or `(lora_name,)` under
an adapter: vLLM publishes its extra keys untagged), `group_idx` 0 and `kv_cache_spec_kind`
"full_attention". `BlockRemoved` is one hash, medium "GPU" and `group_idx` 0.

`KvEventsConfig.parse(text)` reads the flag's JSON as `vllm serve` does (its keys; unknown
ones are errors); `for_engine` places one engine of a fleet (see `kv_publisher`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec

from ..errors import ConfigError
from .lora import LoraAdapter

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "KvEndpoints",
    "KvEventsConfig",
    "encode_batch",
    "is_bind_endpoint",
    "removed",
    "stored",
]

MEDIUM_GPU: Final = "GPU"
FULL_ATTENTION: Final = "full_attention"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of every KV-cache event (tagged: `"type": <class name>`)."""


class BlockStored(KVCacheEvent):
    """Full blocks just cached: their hashes, the parent of the first (None: the start of a
    sequence), all their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted (vLLM sends one per block)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events: `[ts, [event, ...], data_parallel_rank]` on the wire."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder: Final = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[KVCacheEvent]) -> bytes:
    """The msgpack payload of one batch, as vLLM's publisher encodes it (rank 0)."""
    batch = KVEventBatch(ts=ts, events=events, data_parallel_rank=0)  # type: ignore[arg-type]
    return _encoder.encode(batch)


def stored(
    hashes: list[int],
    parent: int | None,
    token_ids: list[int],
    size: int,
    lora: LoraAdapter | None = None,
) -> BlockStored:
    """A `BlockStored` event as vLLM 0.32 fills it for a text-only request, under `lora`
    if it runs with an adapter."""
    extra: tuple[Any, ...] | None = None if lora is None else (lora.name,)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=size,
        lora_id=None if lora is None else lora.lora_id,
        medium=MEDIUM_GPU,
        lora_name=None if lora is None else lora.name,
        extra_keys=[extra] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind=FULL_ATTENTION,
    )


def removed(block_hash: int) -> BlockRemoved:
    """A one-block `BlockRemoved` event."""
    return BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, ipc:// or inproc:// is bound; anything else connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True, kw_only=True)
class KvEventsConfig:
    """`--kv-events-config`: vLLM's `KVEventsConfig`, the same keys and defaults.

    `max_queue_size` is accepted and has no use here (the emulator publishes from its own
    loop, with no queue). In a fleet, `{host}` in `topic` stands for each engine's address
    (vLLM sends the topic as given)."""

    enable_kv_cache_events: bool = False
    publisher: str = ""  # "zmq" or "null"; "": zmq when enabled, else null (vLLM's)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("", "zmq", "null"):
            raise ConfigError(f'--kv-events-config: publisher must be "zmq" or "null": '
                              f"{self.publisher!r}")  # fmt: skip
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"--kv-events-config: not a ZMQ endpoint: {endpoint!r}")
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ConfigError("--kv-events-config: buffer_steps must be positive, hwm not negative")

    @property
    def enabled(self) -> bool:
        """Events are published (vLLM: enabled, and the publisher not "null")."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """The flag's JSON object. Raises ConfigError."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config must be a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        if unknown := raw.keys() - known.keys():
            raise ConfigError(
                f"--kv-events-config: unknown key(s) {sorted(unknown)}; expected {sorted(known)}"
            )
        for key, value in raw.items():
            kind = _JSON_TYPES[str(known[key])]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"--kv-events-config: {key} has the wrong type: {value!r}")
        return cls(**raw)

    def endpoints(
        self, index: int = 0, host: str = "", *, consecutive: bool = False
    ) -> KvEndpoints:
        """Where engine `index` of a fleet, serving at `host`, publishes. Alone (no `host`):
        the endpoints as given. In a fleet, a wildcard TCP endpoint is bound on the engine's
        own address (as a pod's wildcard is its own IP) and, with consecutive ports, at the
        port plus `index` (as vLLM offsets by data-parallel rank); ipc:// and inproc://
        endpoints get `_dp<index>` after the first engine (likewise); `{host}` in the topic
        becomes the engine's address."""
        replay = self.replay_endpoint
        return KvEndpoints(
            publish=_place(self.endpoint, index, host, consecutive=consecutive),
            bind=is_bind_endpoint(self.endpoint),
            replay=None if replay is None else _place(replay, index, host, consecutive=consecutive),
            topic=self.topic.replace("{host}", host),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KvEndpoints:
    """Where one engine publishes: its PUB endpoint (bound, or connected to a subscriber that
    binds), its replay endpoint (bound) and its topic."""

    publish: str
    bind: bool
    replay: str | None
    topic: str


_JSON_TYPES: Final[dict[str, type | tuple[type, ...]]] = {
    "bool": bool,
    "int": int,
    "str": str,
    "str | None": (str, type(None)),
}


def _place(endpoint: str, index: int, host: str, *, consecutive: bool) -> str:
    if not host:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return endpoint if index == 0 else f"{endpoint}_dp{index}"
    if not is_bind_endpoint(endpoint):
        return endpoint  # every engine connects to the one subscriber
    port = urlsplit(endpoint).port or 0
    if consecutive and port:
        port += index
    address = f"[{host}]" if ":" in host else host
    return f"tcp://{address}:{port}"
