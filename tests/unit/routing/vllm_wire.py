"""vLLM's KV event wire format, for the tests: the msgspec structs of vllm/distributed/kv_events.py
(array-like, as vLLM 0.9-0.11 sends them, or as maps with a "type" tag, as later versions do),
and an engine that caches blocks under hashes of its own (not ours) and says so in those events.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

_STORED = [
    ("block_hashes", list[int | bytes]),
    ("parent_block_hash", int | bytes | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
]
# Fields later versions added (map form only here).
_STORED_LATER = [
    ("lora_name", str | None, None),
    ("extra_keys", list[tuple[Any, ...] | None] | None, None),
    ("group_idx", int | None, None),
]
_REMOVED = [("block_hashes", list[int | bytes]), ("medium", str | None)]


def _family(array_like: bool) -> dict[str, type[msgspec.Struct]]:
    """The event structs as one vLLM version encodes them (array-like or maps)."""
    options: dict[str, Any] = {"array_like": array_like, "omit_defaults": True, "gc": False}
    later = [] if array_like else _STORED_LATER
    return {
        "batch": msgspec.defstruct("EventBatch", [("ts", float), ("events", list[Any])], **options),
        "stored": msgspec.defstruct("BlockStored", [*_STORED, *later], tag=True, **options),
        "removed": msgspec.defstruct("BlockRemoved", _REMOVED, tag=True, **options),
        "cleared": msgspec.defstruct("AllBlocksCleared", [], tag=True, **options),
    }


ARRAY, MAP = _family(True), _family(False)


def all_blocks_cleared() -> Any:
    return ARRAY["cleared"]()


def encode(events: Sequence[Any], array_like: bool = True) -> bytes:
    return msgspec.msgpack.encode((ARRAY if array_like else MAP)["batch"](1.0, list(events)))


def engine_hash(parent: int | bytes | None, tokens: Sequence[int], as_bytes: bool) -> int | bytes:
    """A hash of the engine's own: sha256 over (parent, tokens), not our chained xxh3."""
    digest = hashlib.sha256(repr((parent, list(tokens))).encode()).digest()
    return digest if as_bytes else int.from_bytes(digest[-8:], "big")


@dataclass
class VllmEngine:
    """Caches prompts in blocks of `block_size` under its own hashes and emits vLLM's events."""

    block_size: int = 16
    as_bytes: bool = False
    array_like: bool = True
    cached: dict[tuple[int, ...], int | bytes] = field(default_factory=dict)

    def store(self, tokens: Sequence[int], salt: str | None = None, medium: str | None = None,
              start_block: int = 0, lora: int | None = None) -> Any:  # fmt: skip
        """The event for the prompt's full blocks from `start_block` on (the earlier ones are
        cached already, as vLLM stores only newly computed blocks)."""
        size = self.block_size
        full = len(tokens) // size
        chain: list[int | bytes] = []
        for i in range(full):
            prefix = tuple(tokens[: (i + 1) * size])
            if prefix not in self.cached:
                parent = chain[-1] if chain else None
                block = tokens[i * size : (i + 1) * size]
                self.cached[prefix] = engine_hash(parent, block, self.as_bytes)
            chain.append(self.cached[prefix])
        hashes = chain[start_block:]
        first_parent = chain[start_block - 1] if start_block else None
        stored_tokens = list(tokens[start_block * size : full * size])
        if self.array_like:
            return ARRAY["stored"](hashes, first_parent, stored_tokens, size, lora, medium)
        extra: list[tuple[Any, ...] | None] = [None] * len(hashes)
        if salt and start_block == 0 and hashes:
            extra[0] = (salt,)
        return MAP["stored"](
            hashes, first_parent, stored_tokens, size, lora, medium, None, extra or None
        )

    def hashes_of(self, tokens: Sequence[int]) -> list[int | bytes]:
        size = self.block_size
        return [self.cached[tuple(tokens[: (i + 1) * size])] for i in range(len(tokens) // size)]

    def removed(self, hashes: Sequence[int | bytes], medium: str | None = None) -> Any:
        return (ARRAY if self.array_like else MAP)["removed"](list(hashes), medium)
