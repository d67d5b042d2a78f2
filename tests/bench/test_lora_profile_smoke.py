"""`python -m bench.engine.lora_profile --preset cpu`: the profile script's own run on a tiny
model (no GPU kernels to list there), checked for the files and keys the GPU run writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.lora_profile import kernel_group, main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_cpu_run_writes_both_arms(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    main([
        "--preset", "cpu", "--steps", "2", "--profile-steps", "1",
        "--tokenizer-dir", str(gpt2_tokenizer_dir), "--results-dir", str(tmp_path),
    ])  # fmt: skip
    result = json.loads((tmp_path / "lora_profile_cpu.json").read_text())
    assert result["command"].startswith("python -m bench.engine.lora_profile --preset cpu")
    for arm in ("base", "lora", "lora_2", "lora_no_adapter_rows"):
        assert result[arm]["step_ms"] > 0
        assert result[arm]["graph_replays_per_step"] == 0  # no CUDA graphs on the CPU
    base = result["base"]["step_ms"]
    # The keys, by adapters in the step (the CPU preset: 4 and 2).
    assert result["step_vs_base"] == {
        "4": result["lora"]["step_ms"] / base,
        "2": result["lora_2"]["step_ms"] / base,
    }
    assert set(result["steps_vs_base"]) == {"lora", "lora_2", "lora_no_adapter_rows"}
    # No LoRA kernel runs on the CPU (the PyTorch path): no fraction, but the bytes are there.
    assert result["lora_kernel_bandwidth_fraction"] == {"4": None, "2": None}
    assert result["lora_kernel_bandwidth"]["4"]["bytes_per_step"] > 0
    assert result["copy_bytes_per_s"] > 0
    assert "Step vs base" in (tmp_path / "lora_profile_cpu.md").read_text()


@pytest.mark.timeout(600)
def test_a_cpu_kernels_only_run_checks_the_kernels(tmp_path: Path) -> None:
    """--kernels-only on the CPU: the kernels through Triton's interpreter, decode- and
    prefill-sized steps, their deltas against the PyTorch reference, each stack timed against
    its bytes."""
    pytest.importorskip("triton")
    main(["--kernels-only", "--preset", "cpu", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "lora_kernels_cpu.json").read_text())
    assert set(result["cases"]) == {"decode_4", "prefill_2"}
    for case in result["cases"].values():
        assert case["max_relative_error"] < 1e-4
        assert len(case["stacks"]) == 4
        assert all(stack["bytes"] > 0 and "shrink_us" in stack for stack in case["stacks"].values())
        assert case["layer_us"]["median"] > 0
    text = (tmp_path / "lora_kernels_cpu.md").read_text()
    assert "## decode_4" in text
    assert "max relative error" in text


def test_kernel_names_fall_into_their_groups() -> None:
    assert kernel_group("_shrink_kernel") == "lora_shrink"
    assert kernel_group("_expand_group_kernel") == "lora_expand"
    assert kernel_group("nvjet_tst_128x64_64x8_1x2_h_bz_TNT") == "gemm"
    assert kernel_group("_paged_decode_kernel") == "attention"
    assert kernel_group("void at::native::index_elementwise_kernel<128, 4>") == (
        "gather_scatter_scan"
    )
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4>") == "other"
