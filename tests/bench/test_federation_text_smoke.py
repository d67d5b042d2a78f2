"""`python -m bench.federation --quick --workload text`: the predictor's share at the CPU quick
preset, whole. A served-model predictor trained without Dolly (`predictor.served_build --fast
--exclude-corpus dolly`) routes Dolly's train split through a sample-collecting gateway, the
retrain command adapts it from that gateway's database, and the sweep runs the base and the
adapted predictor side by side. Checked for the shape and sanity of what it writes; which
predictor routes better is the bench's measurement, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SHARED

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_quick_text_run_adapts_the_predictor_and_writes_a_complete_result(tmp_path: Path) -> None:
    base = tmp_path / "base"
    build = [
        sys.executable, "-m", "predictor.served_build", "--fast", "--exclude-corpus", "dolly",
        "--out", str(base), "--data-dir", str(SHARED / "datasets"),
    ]  # fmt: skip
    built = subprocess.run(build, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    trained = json.loads((base / "manifest.json").read_text())["training"]
    assert "dolly" not in trained["records_by_corpus"]
    assert trained["data"]["excluded_corpora"] == ["dolly"]
    command = [
        sys.executable, "-m", "bench.federation", "--quick", "--workload", "text",
        "--predictor-dir", str(base), "--adapt-samples", "100", "--only", "sweep",
        "--tokenizer-dir", str(SHARED / "tokenizers" / "gpt2"),
        "--data-dir", str(SHARED / "datasets"),
        "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=540, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "federation_text_cpu_quick.json").read_text())
    page = (tmp_path / "out" / "federation_text_cpu_quick.md").read_text()
    assert "The predictor adapted from served traffic" in page

    adaptation = result["adaptation"]
    assert adaptation["served_requests"] >= 60  # 100 expected, Poisson
    assert adaptation["answered"] == adaptation["served_requests"]
    adapted = Path(adaptation["adapted"])
    manifest = json.loads((adapted / "manifest.json").read_text())
    assert manifest["version"] != json.loads((base / "manifest.json").read_text())["version"]
    scores = adaptation["offline_on_test_split"]
    assert set(scores) == {"base", "adapted", "constant_mean"}
    for score in scores.values():
        assert -1.0 <= score["spearman"] <= 1.0
        assert score["mae_tokens"] >= 0.0
    # The sites replay an eighth of each answer (at most 64 tokens): a predictor that learnt
    # from their answers expects far less than the base, which learnt SmolLM2's own lengths.
    assert scores["adapted"]["mean_expected"] < scores["base"]["mean_expected"] / 2

    sweep = result["sweep"]
    assert set(sweep["goodput_vs_least_requests"]) == {
        "least_requests", "completion_cost", "completion_cost_adapted",
    }  # fmt: skip
    for arm, runs in sweep["runs"].items():
        (run,) = runs
        assert run["completed"] == run["requests"] > 0, (arm, run["errors"])
        assert sum(run["site_requests"].values()) == run["requests"]
