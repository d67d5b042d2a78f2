"""`python -m bench.federation --quick --workload trace`: the prefix-reuse benchmark's CPU quick
preset, whole (real sites behind the latency injector, real gateways, the Mooncake trace's
conversations replayed as text), checked for the shape and sanity of what it writes.

Which arm reuses more is not asserted here: 36 requests on two shared cores are not a
measurement. Unloaded, completion_cost's simulated hit rate was 0.59-0.65 against
least_requests' 0.27-0.29; with the CPU busy (as beside another test file in CI) its prefill
rates are calibrated on a contended machine, its queue terms grow and it spreads the
conversations as a balancer should: 0.43-0.56 against 0.34-0.43, and 0.498 against 0.508 in one
clean-clone CI run. Where a conversation's next turn goes is asserted deterministically in
tests/e2e/test_prefix_routing_http.py; the benchmark's comparisons are the GPU runs'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SHARED

pytestmark = pytest.mark.slow
TRACE = SHARED / "datasets" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"


@pytest.mark.timeout(480)
def test_quick_trace_run_writes_a_complete_result(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "bench.federation", "--quick", "--workload", "trace",
        "--no-predictor", "--only", "sweep",
        "--tokenizer-dir", str(SHARED / "tokenizers" / "gpt2"),
        "--trace-file", str(TRACE),
        "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=470, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "federation_trace_cpu_quick.json").read_text())
    assert (tmp_path / "out" / "federation_trace_cpu_quick.md").read_text().count("|") > 50

    assert result["workload"] == "trace"
    sweep = result["sweep"]
    arms = {"least_requests", "prefix_affinity", "completion_cost"}
    assert set(sweep["goodput_vs_least_requests"]) == arms
    assert set(result["goodput_vs_best_peer"]) == {"completion_cost"}
    for site in result["sites"]:  # what each site said of itself, and its measured prefill rate
        assert site["kv_blocks"] > 0
        assert site["prefill_tokens_per_s"] > 0
    for arm, runs in sweep["runs"].items():
        (run,) = runs
        assert run["completed"] == run["requests"] > 0, (arm, run["errors"])
        assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p90"] <= run["ttft_s"]["p99"]
        assert sum(run["site_requests"].values()) == run["requests"]
        assert 0.0 <= run["hit_rate_simulated"]["all"] <= 1.0
    hits = {arm: runs[0]["hit_rate_simulated"]["all"] for arm, runs in sweep["runs"].items()}
    assert all(hit > 0.0 for hit in hits.values()), hits  # the trace's turns share prefixes
    (workload,) = result["workloads"].values()
    assert workload["reusable_share_unbounded"] > 0.3
