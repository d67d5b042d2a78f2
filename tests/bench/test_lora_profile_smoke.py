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
    for arm in ("base", "lora", "lora_8", "lora_no_adapter_rows"):
        assert result[arm]["step_ms"] > 0
        assert result[arm]["graph_replays_per_step"] == 0  # no CUDA graphs on the CPU
    assert result["step_vs_base"] == result["lora"]["step_ms"] / result["base"]["step_ms"]
    assert set(result["steps_vs_base"]) == {"lora", "lora_8", "lora_no_adapter_rows"}
    assert "Step vs base" in (tmp_path / "lora_profile_cpu.md").read_text()


def test_kernel_names_fall_into_their_groups() -> None:
    assert kernel_group("_shrink_kernel") == "lora_shrink"
    assert kernel_group("_expand_group_kernel") == "lora_expand"
    assert kernel_group("nvjet_tst_128x64_64x8_1x2_h_bz_TNT") == "gemm"
    assert kernel_group("_paged_decode_kernel") == "attention"
    assert kernel_group("void at::native::index_elementwise_kernel<128, 4>") == (
        "gather_scatter_scan"
    )
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4>") == "other"
