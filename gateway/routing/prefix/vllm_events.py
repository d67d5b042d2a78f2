"""vLLM's KV cache events (vllm/distributed/kv_events.py), translated into the prefix index's
input: CacheEventBatches of *our* block ids.

vLLM publishes `KVEventBatch{ts, events}` (msgpack, through msgspec: each struct either
array-like, `[tag, field, ...]`, or a map with a "type" tag, depending on the version) with
`BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys, group_idx, ...}`, `BlockRemoved{block_hashes, medium, group_idx}` and
`AllBlocksCleared`. Its hashes are its own (seeded per process unless PYTHONHASHSEED is set), so,
as llm-d's index does, a stored block's id is recomputed from its token ids: ours chain from the
parent's id of ours, which is looked up by vLLM's parent hash; the first block of a chain is
seeded by (model, cache salt), the salt being the first block's extra key (vLLM mixes
`cache_salt` into the first block only).

What cannot be translated is left out, which only ever makes the index under-claim: a block whose
parent we never saw (after a restart of the gateway, or beyond what a replay brought), LoRA
blocks (another cache namespace), blocks with other extra keys (multimodal inputs: our ids do not
cover them), KV groups other than the first (hybrid models), and tiers other than GPU and CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from fedllm_contract.block_hash import block_hashes, root_hash
from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
    Tier,
)

EngineHash = int | bytes
# Field order of the array-like encodings (vLLM appends fields at the end across versions).
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_TIERS = {"GPU": Tier.DEVICE, "CPU": Tier.HOST}


class MalformedEvents(ValueError):
    """A payload that is not a KV event batch of vLLM's."""


class VllmEventTranslator:
    """One vLLM publisher's events -> our CacheEventBatches, numbered 1, 2, ... per epoch; the
    first batch after `restart()` is a snapshot (it replaces what the index knew: vLLM has no
    snapshot of its own, so what was stored before is unknown, and unclaimed)."""

    def __init__(self, model: str, block_size: int, max_blocks: int) -> None:
        self._model = model
        self.block_size = block_size
        self._max_blocks = max_blocks
        self._ours: OrderedDict[EngineHash, int] = OrderedDict()
        self._epoch = 0
        self._sequence = 0
        self._restart = True
        self.skipped = 0  # events (or blocks of them) that could not be translated

    def restart(self) -> None:
        """What follows does not continue what came before (a publisher restart, a lost batch
        no replay brought back): the next batch starts a new epoch and replaces the index."""
        self._restart = True
        self._ours.clear()

    def translate(self, payload: bytes) -> CacheEventBatch:
        """Contract: the batch's events as ours, in order; MalformedEvents for a payload that is
        not a KV event batch."""
        events: list[CacheEvent] = []
        for raw in _events_of(payload):
            tag, fields = _tagged(raw)
            if tag == "BlockStored":
                stored = self._stored(fields)
                if stored is not None:
                    events.append(stored)
            elif tag == "BlockRemoved":
                removed = self._removed(fields)
                if removed is not None:
                    events.append(removed)
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                self.skipped += 1
        snapshot, self._restart = self._restart, False
        if snapshot:
            self._epoch, self._sequence = self._epoch + 1, 0
        self._sequence += 1
        return CacheEventBatch(
            self._epoch, self.block_size, self._sequence, tuple(events), snapshot=snapshot
        )

    def _stored(self, fields: Mapping[str, Any]) -> BlocksStored | None:
        tier = _tier(fields)
        hashes, tokens = fields.get("block_hashes"), fields.get("token_ids")
        size = fields.get("block_size")
        if (
            tier is None
            or fields.get("lora_id") is not None
            or fields.get("lora_name") is not None
            or fields.get("group_idx") not in (None, 0)
            or size != self.block_size
            or not isinstance(hashes, list)
            or not isinstance(tokens, list)
            or len(tokens) != self.block_size * len(hashes)
        ):
            self.skipped += 1
            return None
        parent = fields.get("parent_block_hash")
        salt = _salt(fields.get("extra_keys"), first=parent is None)
        if salt is None:
            self.skipped += 1
            return None
        if parent is None:
            seed, our_parent = root_hash(self._model, salt), CHAIN_START
        else:
            known = self._ours.get(_key(parent))
            if known is None:  # a parent we never saw: not matchable
                self.skipped += 1
                return None
            seed = our_parent = known
        ours = block_hashes(tokens, self.block_size, seed)
        for engine_hash, our_id in zip(hashes, ours, strict=True):
            self._remember(_key(engine_hash), our_id)
        return BlocksStored(tuple(ours), our_parent, tier)

    def _removed(self, fields: Mapping[str, Any]) -> BlocksRemoved | None:
        tier = _tier(fields)
        hashes = fields.get("block_hashes")
        if tier is None or fields.get("group_idx") not in (None, 0) or not isinstance(hashes, list):
            self.skipped += 1
            return None
        ours = [self._ours.get(_key(h)) for h in hashes]
        known = tuple(our for our in ours if our is not None)
        return BlocksRemoved(known, tier) if known else None

    def _remember(self, engine_hash: EngineHash, our_id: int) -> None:
        # A mapping is a fact about content (the same hash is the same tokens after the same
        # prefix), never wrong while the publisher lives: kept until the bound pushes it out.
        ours = self._ours
        ours[engine_hash] = our_id
        ours.move_to_end(engine_hash)
        while len(ours) > self._max_blocks:
            ours.popitem(last=False)


def _events_of(payload: bytes) -> Sequence[Any]:
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedEvents(f"not msgpack: {exc}") from exc
    events = batch.get("events") if isinstance(batch, dict) else None
    if isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    if not isinstance(events, list):
        raise MalformedEvents("not a KV event batch (no events)")
    return events


def _tagged(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        return tag, dict(zip(_FIELDS.get(tag, ()), raw[1:], strict=False))
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return raw["type"], raw
    raise MalformedEvents(f"not a KV cache event: {raw!r:.80}")


def _tier(fields: Mapping[str, Any]) -> Tier | None:
    medium = fields.get("medium")
    return _TIERS.get("GPU" if medium is None else str(medium).upper())


def _key(engine_hash: Any) -> EngineHash:
    if isinstance(engine_hash, int | bytes):
        return engine_hash
    raise MalformedEvents(f"a block hash is an int or bytes, got {engine_hash!r:.40}")


def _salt(extra_keys: Any, *, first: bool) -> str | None:
    """The cache salt of a stored chain ("" without one); None when the blocks carry extra keys
    our ids do not cover. Only a chain's first block may carry one: exactly the salt."""
    if extra_keys is None:
        return ""
    if not isinstance(extra_keys, list):
        return None
    salt = ""
    for i, keys in enumerate(extra_keys):
        if keys is None:
            continue
        only_a_salt = isinstance(keys, list) and len(keys) == 1 and isinstance(keys[0], str)
        if not (i == 0 and first and only_a_salt):
            return None
        salt = keys[0]
    return salt
