"""`python -m bench.engine.finetune_colocated --preset cpu`, shortened: the whole benchmark in
process on a tiny model with the site's real trainer, checked for the shape and sanity of what it
writes. It runs on the wall clock of a shared CPU, so only what must hold whatever the load is
checked: every interactive request finished in both runs, the job trained alone and under load,
and the keys are the ratios of the figures beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.engine.finetune_colocated import main
from bench.engine.finetune_job import training_jsonl

pytestmark = pytest.mark.slow


def test_the_synthetic_training_file_is_chat_jsonl() -> None:
    lines = training_jsonl(5, (8, 20), seed=1).decode().splitlines()
    assert len(lines) == 5
    for line in lines:
        roles = [m["role"] for m in json.loads(line)["messages"]]
        assert roles == ["system", "user", "assistant"]
    assert training_jsonl(5, (8, 20), seed=1) == training_jsonl(5, (8, 20), seed=1)


@pytest.mark.timeout(400)
def test_a_short_cpu_run_writes_the_keys(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    main([
        "--preset", "cpu", "--window-s", "3", "--drain-s", "4", "--job-alone-s", "2",
        "--burst-requests", "16", "--model-dir", str(tmp_path / "model"),
        "--tokenizer-dir", str(gpt2_tokenizer_dir), "--results-dir", str(tmp_path / "out"),
        "--loads", "0.6,0.3", "--seeds", "0,1",
    ])  # fmt: skip
    for load in (0.6, 0.3):
        name = f"finetune_colocated_cpu_load{load:g}"
        result = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert result["command"].startswith("python -m bench.engine.finetune_colocated --preset")
        assert (result["load"], result["mode"], result["seeds"]) == (load, "rows", [0, 1])
        assert "| with_job |" in (tmp_path / "out" / f"{name}.md").read_text()
        _check(result)


def _check(result: dict[str, Any]) -> None:
    by_seed = result["by_seed"]
    for one in by_seed.values():
        alone, mixed = one["runs"]["alone"], one["runs"]["with_job"]
        for run in (alone, mixed):
            assert run["interactive_finished"] == run["interactive_requests"] > 0
        job_alone, job_loaded = one["job"]["alone"], one["job"]["with_load"]
        assert job_alone["trained_tokens"] > 0
        assert job_loaded["trained_tokens"] > 0
        assert one["rows"]["steps_with_rows"] > 0  # trained beside serving steps
        assert one["job_tokens_per_s_vs_alone"] == pytest.approx(
            job_loaded["trained_tokens_per_s"] / job_alone["trained_tokens_per_s"]
        )
        assert one["interactive_ttft_p99_ratio"] == pytest.approx(
            mixed["ttft_p99_ms"] / alone["ttft_p99_ms"]
        )
        assert one["max_training_delay_ms"] > 0
    # Each key is its worst seed's against its goal, with the seeds' min-max beside it.
    speeds = [one["job_tokens_per_s_vs_alone"] for one in by_seed.values()]
    assert result["job_tokens_per_s_vs_alone"] == min(speeds)
    assert result["job_tokens_per_s_vs_alone_min_max"] == [min(speeds), max(speeds)]
    delays = [one["max_training_delay_ms"] for one in by_seed.values()]
    assert result["max_training_delay_ms"] == max(delays)
    peft = result["peft_alone"]
    assert peft["tokens_per_s"] > 0
    # The site's trainer alone on the loop's shape, in idle-sized units of one whole batch.
    at_peft = result["job_at_peft_step"]
    assert (at_peft["rows"], at_peft["width"]) == (peft["rows"], peft["width"])
    assert at_peft["largest_unit_tokens"] == peft["rows"] * peft["width"]
    assert at_peft["trained_tokens"] == peft["rows"] * peft["width"] * at_peft["steps"]
    assert result["trainer_vs_peft"] == pytest.approx(
        at_peft["tokens_per_s"] / peft["tokens_per_s"]
    )
