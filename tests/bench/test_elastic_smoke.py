"""`python -m bench.elastic --preset cpu`, shortened: real site engines and gateways, the
autoscaled arm's gateway starting its second site through the local actuator, open-loop
streaming through the public API; the whole command, checked for the shape and sanity of what it
writes (not for numbers: tiny models on a shared CPU, where a starting site slows the other)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.loadgen.models import default_tokenizer
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_a_short_run_writes_a_complete_and_sane_result(
    tmp_path: Path, data_dir: Path, smollm2_dir: Path
) -> None:
    tokenizer = default_tokenizer() or smollm2_dir
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "bench.elastic", "--preset", "cpu",
        "--arms", "autoscaled", "static2", "--unit-rps", "4", "--phase-s", "3", "8", "4",
        "--data-dir", str(data_dir), "--tokenizer-dir", str(tokenizer),
        "--work-dir", str(tmp_path / "work"), "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "elastic_cpu.json").read_text())
    assert (out / "elastic_cpu.png").stat().st_size > 10_000
    markdown = (out / "elastic_cpu.md").read_text()

    assert result["commands"][0].startswith("python -m bench.elastic --preset cpu")
    assert result["unit_rps"] == 4
    assert [p["multiple"] for p in result["phases"]] == [1, 3, 1]
    assert set(result["arms"]) == {"autoscaled", "static2"}
    for name, arm in result["arms"].items():
        assert arm["requests"] == result["workload"]["requests"] > 0
        assert arm["lost"] == 0, (name, arm["lost_errors"])
        assert arm["completed"] + arm["cut_off_at_drain"] == arm["requests"]
        assert 0 <= arm["slo_attainment"] <= 1
        assert arm["site_seconds"] > 0
        assert [p["multiple"] for p in arm["phases"]] == [1, 3, 1]
        assert arm["timeline"]
    static2 = result["arms"]["static2"]
    assert max(sample[1] for sample in static2["timeline"]) == 2  # both sites alive
    assert static2["scaling_events"] == []
    auto = result["arms"]["autoscaled"]
    assert min(sample[1] for sample in auto["timeline"]) >= 1
    # The key figures are there, derived from the arms, with their goals.
    assert result["lost_requests"] == 0
    assert result["gpu_seconds_vs_static2"] == pytest.approx(
        auto["site_seconds"] / static2["site_seconds"], abs=1e-3
    )
    assert set(result["goals_met"]) == {
        "slo_attainment_vs_static2", "gpu_seconds_vs_static2", "lost_requests",
        "scale_out_to_serving_s",
    }  # fmt: skip
    actions = [event["action"] for event in auto["scaling_events"]]
    if "join" in actions:  # the second site served before the run ended (seconds on a busy CPU)
        assert actions.index("scale_out") < actions.index("join")
        assert result["scale_out_to_serving_s"] > 0
    assert "## Keys" in markdown
    assert "autoscaled" in markdown
    # Every site process is gone with its arm, the one the gateway started included.
    assert not running_under(tmp_path / "work")


def running_under(folder: Path) -> list[str]:
    """Command lines of processes that name `folder` (the benchmark's models live there)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if str(folder).encode() in cmdline:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found
