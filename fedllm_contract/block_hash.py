"""Prefix-cache block ids that the gateway and every site compute alike.

A token sequence is cut into blocks of `block_size` tokens; only full blocks get an id (the
partial last block is always computed, never shared). The id of block i is a chained hash:

    root      = xxh3_64(utf-8 JSON of [HASH_SCHEME, model, cache_salt])          (base model)
    root      = xxh3_64(utf-8 JSON of [HASH_SCHEME, model, cache_salt, adapter]) (LoRA adapter)
    id(0)     = xxh3_64(tokens of block 0, seed=root)
    id(i)     = xxh3_64(tokens of block i, seed=id(i-1))

where a block's tokens are encoded as little-endian uint32. So an id names the block's tokens
*and* everything before them, the served model and the tenant's cache salt (mixed in through
the root, hence into every block of the chain, as vLLM's `cache_salt` enters its first block).
A LoRA adapter changes every layer's keys and values, so its name is one more key of the root:
no block is shared across adapters, or between an adapter and the base, while requests of one
adapter share theirs. The base's roots keep the three-item key, so its ids are those of before.
The result is the same in every process and on every machine: no Python `hash()`, no
per-process seed. xxh3 is not a cryptographic hash: a 64-bit id suffices because ids never leave
the operator's own machines (sites report them to the gateway only), and with N blocks held the
chance of any accidental collision is about N^2 / 2^65 (1e-8 at a million blocks).

Sites (site_engine/engine/core/prefix_cache.py) key their cached KV blocks by these ids; the gateway
computes the same ids from the prompt it routes, to know how much of it a site already holds.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterable, Sequence

import xxhash

HASH_SCHEME = "fedllm-xxh3-64-v1"
_MAX_TOKEN_ID = (1 << 32) - 1
_ITEM = array("I").itemsize


def root_hash(model: str, cache_salt: str = "", adapter: str = "") -> int:
    """The seed of a chain: the served model, the cache salt ("": shared by every tenant) and
    the LoRA adapter ("": the base model)."""
    parts = (
        [HASH_SCHEME, model, cache_salt, adapter] if adapter else [HASH_SCHEME, model, cache_salt]
    )
    key = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))


def _encode(token_ids: Sequence[int]) -> bytes:
    try:
        encoded = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}]") from exc
    if encoded.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte uint
        raise RuntimeError(f"array('I') is {encoded.itemsize} bytes here, the encoding needs 4")
    if sys.byteorder == "big":  # pragma: no cover - the encoding is little-endian everywhere
        encoded.byteswap()
    return encoded.tobytes()


def chain_hash(parent: int, block_token_ids: Sequence[int]) -> int:
    """The id of one full block whose predecessor's id (or the root) is `parent`."""
    return xxhash.xxh3_64_intdigest(_encode(block_token_ids), seed=parent)


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int, start_block: int = 0
) -> list[int]:
    """Ids of the full blocks of `token_ids` from block `start_block` on, chained from `parent`
    (the root for start_block 0, else the id of block start_block - 1)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    first = start_block * block_size
    full_end = first + (len(token_ids) - first) // block_size * block_size
    if full_end <= first:
        return []
    data = memoryview(_encode(token_ids[first:full_end]))
    step = block_size * _ITEM
    hashes: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    for offset in range(0, len(data), step):
        parent = digest(data[offset : offset + step], seed=parent)
        hashes.append(parent)
    return hashes


def chains_block_hashes(
    token_ids: Sequence[int], block_size: int, chains: Iterable[tuple[int, int]]
) -> list[int]:
    """Ids of the blocks of several chains at once, equal to `block_hashes` of each: `chains`
    gives each one's parent and number of blocks, in order, and `token_ids` their blocks' tokens
    one chain after the other. One encoding for all of them: a site hashes the dozens of blocks
    that fill in one step, one or two per sequence, in one pass (issue 50)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    # Slices of bytes, not of a memoryview, and the seed by position: for a 64-byte block
    # either is a good part of the cost of the hash itself.
    data = _encode(token_ids)
    step = block_size * _ITEM
    hashes: list[int] = []
    append = hashes.append
    digest = xxhash.xxh3_64_intdigest
    offset = 0
    for parent, count in chains:
        if count < 0:
            raise ValueError(f"a chain's block count must be >= 0, got {count}")
        end = offset + count * step
        if end > len(data):
            raise ValueError("the chains' blocks need more tokens than token_ids holds")
        while offset < end:
            following = offset + step
            parent = digest(data[offset:following], parent)
            append(parent)
            offset = following
    if offset != len(data):
        raise ValueError("token_ids holds tokens past the chains' blocks")
    return hashes


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, model: str, cache_salt: str = "", adapter: str = ""
) -> list[int]:
    """Ids of every full block of a prompt, from its first token."""
    return block_hashes(token_ids, block_size, root_hash(model, cache_salt, adapter))
