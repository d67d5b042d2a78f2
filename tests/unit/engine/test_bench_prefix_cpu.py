"""`python -m bench.engine.prefix --preset cpu` runs, and its prompt tokens computed are the
committed ones (bench/results/engine_prefix/engine_prefix_cpu.json): on the step clock they depend
on what the engine scheduled and cached, never on this machine's speed, so any change in them is a
change in the engine's caching."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.common import results_dir
from bench.engine.prefix import main

pytestmark = pytest.mark.slow
COMMITTED = results_dir("engine_prefix") / "engine_prefix_cpu.json"


def figures(payload: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, int]]]]:
    return {
        workload: {
            arm: [(row["offered_prompt_tokens"], row["prompt_tokens_computed"]) for row in rows]
            for arm, rows in result["arms"].items()
        }
        for workload, result in payload["workloads"].items()
    }


def test_cpu_preset_computes_the_committed_prompt_tokens(
    tmp_path: Path, gpt2_tokenizer_dir: Path, data_dir: Path
) -> None:
    main(
        [
            "--preset", "cpu", "--results-dir", str(tmp_path), "--name", "ci",
            "--model-dir", str(tmp_path / "model"), "--tokenizer-dir", str(gpt2_tokenizer_dir),
            "--traces-dir", str(data_dir / "traces"),
        ]
    )  # fmt: skip
    ran = json.loads((tmp_path / "ci.json").read_text())
    assert ran["complete"]
    assert figures(ran) == figures(json.loads(COMMITTED.read_text()))
    shared, trace = ran["workloads"]["shared"], ran["workloads"]["trace"]
    for rows in (shared["arms"]["off"], trace["arms"]["off"]):
        assert all(r["prompt_tokens_computed"] == r["offered_prompt_tokens"] for r in rows)
    assert shared["prefill_computed_over_offered"] < 0.45
    # The host tier holds what the device evicts: it computes less than the device alone.
    device_alone = trace["prefill_computed_over_offered"]["device"]
    assert trace["host_tier_computed_over_offered"] < device_alone
    assert (tmp_path / "ci.md").is_file()
    assert (tmp_path / "ci.png").is_file()
