"""Prefix-cache block ids: deterministic across processes, chained, salted, full blocks only."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedllm_contract.block_hash import (
    block_hashes,
    chain_hash,
    prompt_block_hashes,
    root_hash,
)

TOKENS = list(range(1000, 1040))


def test_only_full_blocks_get_an_id() -> None:
    assert len(prompt_block_hashes(TOKENS, 16, "m")) == 2  # 40 tokens: 2 full blocks of 16
    assert len(prompt_block_hashes(TOKENS[:32], 16, "m")) == 2  # block-aligned
    assert prompt_block_hashes(TOKENS[:15], 16, "m") == []


def test_golden_values_pin_the_encoding() -> None:
    # Changing these values changes every id a site reports: bump HASH_SCHEME instead.
    root = root_hash("smollm2", "")
    assert root == root_hash("smollm2")
    assert prompt_block_hashes([1, 2, 3, 4], 2, "smollm2") == [
        chain_hash(root, [1, 2]),
        chain_hash(chain_hash(root, [1, 2]), [3, 4]),
    ]
    assert (root, *prompt_block_hashes([1, 2, 3, 4], 2, "smollm2")) == GOLDEN


GOLDEN = (12057198497746674775, 10499746360948990771, 15445741402528765556)


def test_same_ids_in_another_process() -> None:
    code = (
        "from fedllm_contract.block_hash import prompt_block_hashes as p;"
        "print(p(list(range(1000, 1040)), 16, 'm', 'tenant-7'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(prompt_block_hashes(TOKENS, 16, "m", "tenant-7"))


def test_salt_and_model_enter_every_block() -> None:
    plain = prompt_block_hashes(TOKENS, 8, "m")
    salted = prompt_block_hashes(TOKENS, 8, "m", "key-1")
    other_model = prompt_block_hashes(TOKENS, 8, "m2")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(plain, other_model, strict=True))


def test_a_block_id_depends_on_every_token_before_it() -> None:
    changed = [*TOKENS]
    changed[3] += 1
    a, b = prompt_block_hashes(TOKENS, 8, "m"), prompt_block_hashes(changed, 8, "m")
    assert all(x != y for x, y in zip(a, b, strict=True))


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=80),
    st.integers(1, 9),
    st.integers(0, 8),
)
def test_resuming_from_a_block_continues_the_chain(
    tokens: list[int], block_size: int, start: int
) -> None:
    whole = prompt_block_hashes(tokens, block_size, "m", "s")
    start = min(start, len(whole))
    parent = root_hash("m", "s") if start == 0 else whole[start - 1]
    assert block_hashes(tokens, block_size, parent, start_block=start) == whole[start:]


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_token_ids_outside_uint32_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        prompt_block_hashes(bad * 4, 2, "m")


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0, 1)


def test_an_adapter_is_a_key_of_every_block_and_the_base_keeps_its_ids() -> None:
    base = prompt_block_hashes(TOKENS, 8, "m", "salt")
    # No adapter is the base: the same ids as before adapters existed (GOLDEN pins them too).
    assert prompt_block_hashes(TOKENS, 8, "m", "salt", adapter="") == base
    assert root_hash("smollm2", "", "") == GOLDEN[0]
    tuned = prompt_block_hashes(TOKENS, 8, "m", "salt", adapter="tenant-a")
    other = prompt_block_hashes(TOKENS, 8, "m", "salt", adapter="tenant-b")
    assert prompt_block_hashes(TOKENS, 8, "m", "salt", adapter="tenant-a") == tuned
    for ids in (tuned, other):
        assert all(a != b for a, b in zip(base, ids, strict=True))
    assert all(a != b for a, b in zip(tuned, other, strict=True))
    # An adapter named like a salt does not collide with that salt: the keys are positional.
    assert root_hash("m", "a", "") != root_hash("m", "", "a")
