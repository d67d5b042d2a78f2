"""bench.engine.structured_output on its CPU preset: it writes its report, its free requests'
greedy tokens are the same with and without constrained neighbours, and the client schemas it
reads without pydantic are the ones pydantic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.structured_output import client_schemas, constraints, main
from bench.structured.schemas import realistic_schemas

pytestmark = pytest.mark.slow


def test_the_schema_file_is_what_pydantic_writes() -> None:
    assert client_schemas() == json.loads(json.dumps(realistic_schemas()))


def test_cpu_preset_reports_overhead_and_identical_free_answers(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "structured_output_cpu"
    report = main(["--preset", "cpu", "--tokenizer", str(smollm2_dir), "--repeats", "1",
                   "--out", str(out)])  # fmt: skip
    assert [row["batch"] for row in report["rows"]] == [8, 16]
    for row in report["rows"]:
        assert row["free_token_identical"] == row["free_requests"] == row["batch"] // 2
        # The matched baseline runs the mixed run's batch shapes: whole free answers agree.
        assert row["free_identical_whole_answers_vs_matched"] == row["free_requests"]
        assert row["timed_steps"][1] > 0
        assert row["mask_overhead"] == row["step_ms_mixed"] / row["step_ms_matched"] - 1
        assert row["timed_steps"][0] > 0
        assert row["timed_steps"][1] > 0
        # Finished constrained answers are replaced while free rows run; their constraints
        # cycle, each compiled once, ahead of the run.
        assert row["constrained_answers"] >= row["batch"] // 2
        assert row["grammars_compiled"] == len(constraints())
        assert {"schedule", "fill masks (inline)"} <= set(row["phases_ms_per_step"]["mixed"])
        assert "fill masks (inline)" not in row["phases_ms_per_step"]["none"]
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == report["rows"]
    assert "mask overhead" in out.with_suffix(".md").read_text()
