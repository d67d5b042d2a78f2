"""`python -m bench.engine.priority --preset cpu`, shortened: the whole benchmark in process on a
tiny model, checked for the shape and sanity of what it writes. The token clock makes its
figures independent of the machine's load, so the checks can say what must hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.priority import main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_short_cpu_run_writes_the_three_keys(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    main([
        "--preset", "cpu", "--window-s", "3", "--drain-s", "3", "--burst-requests", "16",
        "--model-dir", str(tmp_path / "model"), "--tokenizer-dir", str(gpt2_tokenizer_dir),
        "--results-dir", str(tmp_path / "out"), "--seeds", "0,1",
    ])  # fmt: skip
    result = json.loads((tmp_path / "out" / "priority_cpu.json").read_text())
    assert result["command"].startswith("python -m bench.engine.priority --preset cpu")
    assert "| with_batch |" in (tmp_path / "out" / "priority_cpu.md").read_text()
    assert result["complete"]
    assert [seed["seed"] for seed in result["seeds"]] == [0, 1]
    for seed in result["seeds"]:
        alone, mixed = seed["runs"]["alone"], seed["runs"]["with_batch"]
        # Every interactive request finished in both runs, none of them preempted.
        for run in (alone, mixed):
            assert run["interactive_finished"] == run["interactive_requests"] > 0
            assert run["preemptions"]["interactive"] == 0
        assert alone["batch_tokens_in_window"] == 0
        assert mixed["batch_tokens_in_window"] > 0
        assert mixed["preemptions"]["batch"] > 0  # interactive requests took their slots
        assert seed["batch_requests_queued"] * 16 > seed["idle_batch_tokens"]  # more than fits
    for key in ("interactive_ttft_p99_ratio", "interactive_tpot_p99_ratio"):
        assert 0.5 < result[f"{key}_min"] <= result[key] <= result[f"{key}_max"] < 5
    assert 0.2 < result["batch_share_of_idle"] < 3
