"""bench/engine/lora_kfold_layout.py: issue 77's expand folded into the base GEMM along K, on
the CPU in float64 (exact enough to compare bit for bit where the design says the sums are the
same). A slot's B lands in its block-diagonal columns, a row of slot k gets exactly its delta,
rows without an adapter none, an evicted slot reaches no row, and a K-prefix over the slots in
use equals the GEMM over every slot's columns when the others are zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.engine.lora_kfold_gemm import main
from bench.engine.lora_kfold_layout import (
    StackShape,
    ext_columns,
    extend_weight,
    fill_rows,
    kfold_linear,
    llama_stacks,
    reference,
    split_groups,
    write_slot,
)

RANK, SLOTS, ROWS = 4, 5, 12
STACKS = llama_stacks(hidden=24, q=24, kv=8, intermediate=40)


def _setup(stack: StackShape, token_slots: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    w = rand(stack.out_features, stack.in_features)
    b = rand(SLOTS, RANK, stack.out_features)
    w_ext = extend_weight(w, stack, RANK, SLOTS)
    for slot in range(SLOTS):
        write_slot(w_ext, stack, RANK, slot, b[slot])
    x = rand(ROWS, stack.in_features)
    shrunk = rand(ROWS, stack.n * RANK)
    x_ext = torch.zeros(ROWS, ext_columns(stack, RANK, SLOTS), dtype=torch.float64)
    x_ext[:, : stack.in_features] = x
    fill_rows(x_ext, stack, RANK, shrunk, token_slots)
    return {"w": w, "b": b, "w_ext": w_ext, "x": x, "shrunk": shrunk, "x_ext": x_ext}


def test_a_slots_b_is_written_block_diagonal_into_its_own_columns() -> None:
    stack = STACKS[0]  # q/k/v: three blocks
    t = _setup(stack, torch.full((ROWS,), -1))
    w_ext, b = t["w_ext"], t["b"]
    assert w_ext.shape == (40, 24 + SLOTS * 3 * RANK)
    assert torch.equal(w_ext[:, :24], t["w"])
    first = 24 + 2 * 3 * RANK  # slot 2
    block = w_ext[:, first : first + 3 * RANK]
    assert torch.equal(block[:24, :RANK], b[2, :, :24].T)  # q rows, q's columns
    assert torch.equal(block[24:32, RANK : 2 * RANK], b[2, :, 24:32].T)  # k
    assert torch.equal(block[32:, 2 * RANK :], b[2, :, 32:].T)  # v
    off_diagonal = block.clone()
    off_diagonal[:24, :RANK] = 0
    off_diagonal[24:32, RANK : 2 * RANK] = 0
    off_diagonal[32:, 2 * RANK :] = 0
    assert not off_diagonal.any()
    # Evicted: its columns zero, the other slots' untouched.
    before = w_ext.clone()
    write_slot(w_ext, stack, RANK, 2, None)
    assert not w_ext[:, first : first + 3 * RANK].any()
    w_ext[:, first : first + 3 * RANK] = before[:, first : first + 3 * RANK]
    assert torch.equal(w_ext, before)


def test_each_row_gets_its_own_slots_delta_and_base_rows_none() -> None:
    token_slots = torch.tensor([0, 3, -1, 3, 1, -1, 4, 0, 2, -1, 1, 3])
    for stack in STACKS:
        t = _setup(stack, token_slots, seed=1)
        got = kfold_linear(t["x_ext"], t["w_ext"], stack, RANK, SLOTS)
        want = reference(t["x"], t["w"], stack, t["shrunk"], t["b"], token_slots)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        base = token_slots < 0
        # A base row's extension is all zeros: it gets the base GEMM's result and no delta.
        assert not t["x_ext"][base, stack.in_features :].any()
        torch.testing.assert_close(got[base], t["x"][base] @ t["w"].T, rtol=1e-12, atol=1e-12)


def test_a_lower_rank_adapter_keeps_its_padding_zero() -> None:
    stack = STACKS[2]  # gate/up
    t = _setup(stack, torch.zeros(ROWS, dtype=torch.long))
    write_slot(t["w_ext"], stack, RANK, 0, t["b"][0, :2])  # rank 2 of 4
    first = stack.in_features
    for j in range(stack.n):
        assert not t["w_ext"][:, first + j * RANK + 2 : first + (j + 1) * RANK].any()


def test_an_evicted_slot_reaches_no_row_even_holding_nan_before() -> None:
    """Eviction zeroes the columns: a slot's old weights (NaN here) reach no row afterwards. A
    NaN in a *resident* slot's columns would reach every row (0 * NaN): the design relies on
    the load-time checks that refuse such adapters (docs/engine.md, LoRA)."""
    stack = STACKS[1]
    token_slots = torch.tensor([0, 1] * (ROWS // 2))
    t = _setup(stack, token_slots)
    write_slot(t["w_ext"], stack, RANK, 3, torch.full((RANK, stack.out_features), float("nan")))
    assert kfold_linear(t["x_ext"], t["w_ext"], stack, RANK, SLOTS).isnan().all()
    write_slot(t["w_ext"], stack, RANK, 3, None)
    got = kfold_linear(t["x_ext"], t["w_ext"], stack, RANK, SLOTS)
    want = reference(t["x"], t["w"], stack, t["shrunk"], t["b"], token_slots)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_k_prefix_over_the_slots_in_use_equals_every_slots_columns() -> None:
    token_slots = torch.tensor([1, 0, 2, -1, 1, 0, 2, 2, -1, 0, 1, 1])  # slots 0-2 of 5
    for stack in STACKS:
        t = _setup(stack, token_slots, seed=2)
        view = t["w_ext"][:, : ext_columns(stack, RANK, 3)]
        assert view.data_ptr() == t["w_ext"].data_ptr()
        assert view.stride() == t["w_ext"].stride()  # a view: K is only its width
        prefix = kfold_linear(t["x_ext"], t["w_ext"], stack, RANK, 3)
        full = kfold_linear(t["x_ext"], t["w_ext"], stack, RANK, SLOTS)
        torch.testing.assert_close(prefix, full, rtol=1e-12, atol=1e-12)
        want = reference(t["x"], t["w"], stack, t["shrunk"], t["b"], token_slots)
        torch.testing.assert_close(prefix, want, rtol=1e-12, atol=1e-12)


def test_the_split_layout_has_no_zero_blocks_but_k_and_vs() -> None:
    """q | k+v and gate | up: each GEMM's K grows by its own projections' R a slot."""
    qkv, o, gate_up, _ = STACKS
    assert split_groups(qkv, RANK, 3) == [(0, 24, 24 + 3 * RANK), (24, 40, 24 + 3 * 2 * RANK)]
    assert split_groups(gate_up, RANK, 2) == [(0, 40, 24 + 2 * RANK), (40, 80, 24 + 2 * RANK)]
    assert split_groups(o, RANK, 5) == [(0, 24, ext_columns(o, RANK, 5))]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_gpu_measurements_script_runs_on_the_cpu(tmp_path: Path) -> None:
    """`python -m bench.engine.lora_kfold_gemm --preset cpu`: the GPU call's script on tiny
    shapes (the segmented kernels through Triton's interpreter), its files and checks."""
    pytest.importorskip("triton")
    main(["--preset", "cpu", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "lora_kfold_cpu.json").read_text())
    assert set(result["cases"]) == {"decode_2", "decode_4"}
    for case in result["cases"].values():
        assert set(case["stacks"]) == {"qkv", "o", "gate_up", "down"}
        assert all(s["ext"] > 0 and s["expand_us"] != 0 for s in case["stacks"].values())
        assert case["step_ms"]["base"] > 0
    for check in result["checks"].values():
        assert check["max_relative_error"] < 1e-5
        assert check["base_rows_bit_identical_to_base_gemm"]
        assert check["prefix_bit_identical_to_all_slots"]
        assert check["copies_in_gemm"] == []
        assert check["split_out_views_equal_fresh_gemms"]
    assert "saving" in (tmp_path / "lora_kfold_cpu.md").read_text()
