"""vLLM's KV-cache events as they come off the wire (no I/O here).

An engine started with `--kv-events-config` publishes, over ZMQ PUB, one message per batch of
events: three frames, the topic, an 8-byte big-endian sequence number (per publisher, from 0,
one per batch) and a msgpack payload `[timestamp, [event, ...], data_parallel_rank]`. vLLM
0.32 encodes each event as a map with a "type" key; older releases sent positional arrays
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, ...]`). Both are read. Block hashes are uint64 integers by default (the low 8
bytes of the engine's digest) or byte strings; either is only an opaque name for a block.

A LoRA adapter's blocks carry its name (`lora_name`, the name requests use as their model)
and its id (`lora_id`, which vLLM 0.32 marks deprecated). The id is the engine's load order
of its adapters, so one adapter can have different ids on two engines; the name is the same
everywhere. Both are read; an event may carry either, both or neither (older releases sent
only the id).

`decode_message(frames)` returns the batch with its events, and how many events it skipped
(malformed or of an unknown type): a bad event is skipped and counted, never fatal.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = [
    "AllBlocksCleared",
    "Batch",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "MalformedMessage",
    "decode_message",
]

BlockHash = int | bytes
_SEQ: Final = struct.Struct(">q")
_decode: Final = msgspec.msgpack.Decoder().decode


class MalformedMessage(ValueError):
    """A message that is not a KV-event batch at all (wrong frames, not msgpack)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine has just filled and cached: `token_ids` holds the tokens of all of
    them, `block_size` each; `parent` is the engine's hash of the block before the first
    (None: the first is the start of a sequence). A LoRA adapter's blocks name it
    (`lora_name`) and carry its id on that engine (`lora_id`); a base model's have neither."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine has evicted (one event per block, tail first, in vLLM 0.32)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was emptied (a reset)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    topic: bytes
    seq: int
    events: tuple[Event, ...]
    skipped: int  # events that were malformed or of an unknown type


def decode_message(frames: list[bytes]) -> Batch:
    """One published message: [topic, seq, payload]. MalformedMessage if it is not a batch;
    events inside it that cannot be read are skipped and counted."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise MalformedMessage(f"expected 3 frames with an 8-byte sequence, got {len(frames)}")
    topic, seq_bytes, payload = frames
    (seq,) = _SEQ.unpack(seq_bytes)
    return decode_payload(topic, seq, payload)


def decode_payload(topic: bytes, seq: int, payload: bytes) -> Batch:
    try:
        batch = _decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"payload is not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise MalformedMessage("payload is not [timestamp, [events], ...]")
    events: list[Event] = []
    skipped = 0
    for raw in batch[1]:
        event = _event(raw)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return Batch(topic, seq, tuple(events), skipped)


def _hashes(value: Any) -> tuple[BlockHash, ...] | None:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        return None
    return tuple(value)


def _event(raw: Any) -> Event | None:
    """One event from its map or positional form, or None if it cannot be read."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _POSITIONAL.get(kind)
        if names is None:
            return None
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        return None
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        hashes = _hashes(fields.get("block_hashes"))
        return None if hashes is None else BlockRemoved(hashes)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(fields: dict[str, Any]) -> BlockStored | None:
    hashes = _hashes(fields.get("block_hashes"))
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    parent = fields.get("parent_block_hash")
    lora = fields.get("lora_id")
    lora_name = fields.get("lora_name")
    if (
        hashes is None
        or not isinstance(tokens, list)
        or not all(isinstance(t, int) for t in tokens)
        or not isinstance(size, int)
        or size <= 0
        or len(tokens) != len(hashes) * size
        or not (parent is None or isinstance(parent, int | bytes))
        or not (lora is None or isinstance(lora, int))
        or not (lora_name is None or isinstance(lora_name, str))
    ):
        return None
    return BlockStored(hashes, parent, tuple(tokens), size, lora, lora_name or None)


# Field order of the positional (array-like) encoding of older vLLM releases (vLLM's
# `BlockStored` declares its fields in this order, `medium` and `lora_name` added later).
_POSITIONAL: Final = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}
