"""`python -m bench.federation_real --preset cpu`, shortened: two real CPU sites of tiny models
unequal by batch limits behind the emulated wide-area delay, a real gateway per arm
(completion_cost, round_robin), open-loop streaming through the public API, then the same
requests replayed in fedsim and the side-by-side written. Checked for the shape and sanity of
what it writes, not for numbers (tiny models on a shared CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_elastic_smoke import running_under
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_short_cpu_run_writes_the_real_and_simulated_arms(
    tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    command = [
        sys.executable, "-m", "bench.federation_real", "--preset", "cpu",
        "--duration-s", "4", "--drain-s", "15", "--tokenizer-dir", str(gpt2_tokenizer_dir),
        "--work-dir", str(work), "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    real = json.loads((out / "federation_real_cpu_real.json").read_text())
    result = json.loads((out / "federation_real_cpu.json").read_text())
    markdown = (out / "federation_real_cpu.md").read_text()

    assert real["card"] == "cpu"
    assert set(real["arms"]) == {"completion_cost", "round_robin"}
    requests = real["workload"]["requests"]
    assert requests == 12  # 3 req/s x 4 s
    for site in real["sites"]:
        assert site["kv_blocks_total"] > 0
        assert site["step_cost_s"]["base"] > 0  # the engine learned its step cost
    for name, arm in real["arms"].items():
        assert arm["requests"] == requests, name
        assert arm["completed"] == requests, (name, arm["errors"])
        assert 0 < arm["goodput_rps"] <= requests / 4
        assert 0 < arm["ttft_p50_s"] <= arm["ttft_p99_s"] < math.inf
        assert sum(arm["by_site"].values()) == requests
        # Each site's busy samples as a series (empty where fewer than two fell in the cell).
        assert all(isinstance(site["timeline"], list) for site in arm["sites"].values()), name
        # Every answer's first token, as the gateway saw it, at the site that gave it.
        split = arm["ttft_split"]
        assert sum(s["gateway_firsts"] for s in split.values()) == requests, (name, split)
        assert all(s["site_mean_s"] > 0 for s in split.values() if s["site_firsts"]), split
    # Round robin alternates, so both sites served: the gateway really routed over both.
    assert set(real["arms"]["round_robin"]["by_site"]) == {"site-a", "site-b"}

    simulated = result["simulated"]
    assert set(simulated) == set(real["arms"])
    for name, arm in simulated.items():
        assert arm["requests"] == requests
        assert sum(arm["by_site"].values()) == arm["completed"]
        for metric, error in result["errors"][name].items():
            assert error is None or error >= 0, (name, metric)
    ranking = result["ranking_by_goodput"]
    assert sorted(ranking["real_order"]) == sorted(ranking["sim_order"]) == sorted(real["arms"])
    assert isinstance(ranking["rank_agrees"], bool)
    assert markdown.startswith("# federation_real_cpu\n\nCommand: `python -m bench.federation_real")
    assert "| completion_cost | goodput_rps |" in markdown
    gz = out / "federation_real_cpu_requests.json.gz"
    assert gz.stat().st_size > 100
    assert not running_under(work)
