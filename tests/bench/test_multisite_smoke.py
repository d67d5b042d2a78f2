"""`python -m bench.multisite --quick`: real site processes behind real gateways, the whole
command, checked for the shape and sanity of what it writes (not for specific numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow
MICO_COLUMNS = {"rr_iter", "tok_static", "mico"}


@pytest.mark.timeout(280)
def test_quick_run_writes_a_complete_and_sane_result(
    tmp_path: Path, data_dir: Path, gpt2_tokenizer_dir: Path
) -> None:
    command = [
        sys.executable,
        "-m",
        "bench.multisite",
        "--quick",
        "--no-predictor",
        "--data-dir",
        str(data_dir),
        "--tokenizer-dir",
        str(gpt2_tokenizer_dir),
        "--work-dir",
        str(tmp_path / "work"),
        "--out-dir",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=270, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "multisite_quick.json").read_text())
    markdown = (tmp_path / "out" / "multisite_quick.md").read_text()

    assert result["command"].startswith("python -m bench.multisite --quick")
    assert result["machine"]["cpus"] >= 1
    assert result["predictions"]["mode"] == "none"
    (row,) = result["table1"]
    assert (row["sites"], row["max_batch"], row["queries"]) == (2, 4, 16)
    assert set(row["ratio_vs_rr_static"]) >= MICO_COLUMNS
    assert all(value > 0 for value in row["ratio_vs_rr_static"].values())
    assert set(row["kv_cumulative_reduction"]) >= MICO_COLUMNS
    for run in row["runs"]:
        assert run["completed"] == run["queries"] == 16, run["errors"]
        assert run["makespan_iterations"] > 0
        assert run["kv_token_iterations"] > 0
        assert run.get("hold_leaked", 0) == 0  # the batch columns run without the hold
        assert 1.0 <= run["imbalance"] <= 2.0  # two sites: max/mean is at most 2
        served = sum(site["queries_served"] for site in run["per_site"].values())
        assert served == 16
    # Every replayed answer had exactly its reference length, in every configuration.
    assert all(r["completion_tokens"] == result["workload"]["answer_tokens"] for r in row["runs"])
    assert set(result["kv_cumulative_reduction"]) >= MICO_COLUMNS
    assert result["decision_p99_ms"] > 0
    assert {d["policy"] for d in result["decision_times"]} >= {"round_robin", "mico"}
    assert result["bad_input"]["checks"][0]["status"] == 503
    assert result["bad_input"]["all_passed"], result["bad_input"]
    assert "Table 1" in markdown
    assert "Iterations are the primary time unit" in markdown
