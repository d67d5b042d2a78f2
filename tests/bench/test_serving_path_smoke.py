"""The serving-path benchmark (bench/serving_path), shortened: CPU mode (the real site with the
synthetic engine, the real gateway, closed-loop streaming clients in a process of their own, two
windows of two seconds), and GPU mode's wiring on the CPU with a tiny model. Checked for the
shape and sanity of what they write, not for numbers (a shared CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.engine.harness import Progress
from bench.serving_path.cpu_mode import HEADLINE, CpuSetup, run_cpu
from bench.serving_path.report import cpu_markdown
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_a_short_cpu_run_streams_every_answer_to_its_end(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    setup = CpuSetup(streams=12, clients=1, max_tokens=16, ramp_s=0.5, warmup_s=2.0,
                     seconds=2.0, reps=2, drain_s=20.0)  # fmt: skip
    payload = run_cpu(setup, tmp_path, tiny_llama_dir, Progress())

    requests = payload["requests"]
    assert requests["sent"] > setup.streams  # each stream sent more than one request
    assert requests["finished"] == requests["sent"], payload["refusals"]
    assert (requests["refused"], requests["cut"], requests["open_at_the_end"]) == (0, 0, 0)
    assert len(payload["windows"]) == setup.reps
    assert set(HEADLINE) <= set(payload) & set(payload["ranges"])
    for window in payload["windows"]:
        assert window["delivered_tokens"] > 0
        assert window["finished"] > 0
        # What the clients received is what the engine made, give or take the answers open at
        # the windows' edges.
        assert 0.5 < window["delivered_tokens_per_s"] / window["engine_generated_tokens_per_s"] < 2
        for role in ("site", "gateway", "clients"):
            assert 0 < window[f"{role}_cpu_us_per_token"] < math.inf, role
        assert 0 < window["site_loop_busy"] <= 1.05
    # At least a token an event (one that ends inside a UTF-8 character brings no text).
    assert payload["tokens_per_chunk"] >= 1.0
    assert 0 < payload["ttft_p50_s"] <= payload["ttft_p99_s"] < 10
    assert payload["path_vs_engine_tokens"] < 1
    markdown = cpu_markdown(payload)
    assert "site CPU µs per delivered token" in markdown
    assert "`site_cpu_us_per_token` <= 10" in markdown


@pytest.mark.timeout(300)
def test_gpu_mode_runs_end_to_end_on_the_cpu(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    """GPU mode's wiring with a tiny model (`--preset cpu`), before device time is spent on it:
    one rate through the site and the gateway, then the same requests in process."""
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "bench.serving_path", "--mode", "gpu", "--preset", "cpu",
        "--rates", "4", "--duration-s", "2", "--drain-s", "15", "--name", "gpu_smoke",
        "--tokenizer-dir", str(gpt2_tokenizer_dir), "--work-dir", str(tmp_path / "work"),
        "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_smoke.json").read_text())

    assert result["complete"]
    path, engine = result["path"]["4"], result["engine"]["4"]
    assert path["requests"] == engine["requests"] == 8  # 4 req/s x 2 s
    assert path["completed"] == engine["completed"] == 8
    assert (result["refused"], result["cut"]) == ({"4": 0}, {"4": 0})
    # The same answers' tokens on both sides, over about the same span.
    assert path["output_tokens"] == engine["output_tokens"]
    assert 0.5 < result["path_vs_engine_tokens"]["4"] < 1.5
    assert 0 < result["ttft_p99_s"]["4"] < 10
    assert path["cpu_us_per_token"]["gateway"] > 0
    assert "path_vs_engine_tokens" in (out / "gpu_smoke.md").read_text()
