"""`python -m bench.federation --quick`: real site engines behind the latency injector and real
gateways, open-loop streaming through the public API; the whole command, checked for the shape
and sanity of what it writes (not for specific numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.federation.options import default_tokenizer
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(330)
def test_quick_run_writes_a_complete_and_sane_result(
    tmp_path: Path, data_dir: Path, smollm2_dir: Path
) -> None:
    tokenizer = default_tokenizer() or smollm2_dir
    command = [
        sys.executable,
        "-m",
        "bench.federation",
        "--quick",
        "--no-predictor",
        "--data-dir",
        str(data_dir),
        "--tokenizer-dir",
        str(tokenizer),
        "--work-dir",
        str(tmp_path / "work"),
        "--out-dir",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=320, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "federation_cpu_quick.json").read_text())
    markdown = (tmp_path / "out" / "federation_cpu_quick.md").read_text()
    assert (tmp_path / "out" / "federation_cpu_quick.png").stat().st_size > 10_000

    assert result["command"].startswith("python -m bench.federation --quick")
    assert "CPU scale" in result["label"]
    sweep = result["sweep"]
    assert set(sweep["goodput_vs_least_requests"]) == {"least_requests", "least_latency"}
    assert sweep["goodput_vs_least_requests"]["least_requests"] in (1.0, None)
    sites = {site["name"] for site in result["sites"]}
    for arm, runs in sweep["runs"].items():
        (run,) = runs
        assert run["requests"] > 0
        assert run["completed"] == run["requests"], (arm, run["errors"])
        assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p99"] <= run["e2e_s"]["p99"]
        assert set(run["requests_per_site"]) <= sites
        assert sum(run["requests_per_site"].values()) == run["requests"]
    shares = sweep["tokens_per_capacity_share"]["least_requests"]
    assert set(shares) == sites
    timed = {row["policy"]: row for row in result["decision_time_ms"]}
    assert {"least_latency", "least_tokens_guess", "mico"} <= set(timed)
    assert "## Goodput" in markdown
    assert "least_latency" in markdown
