"""Length prediction through the public API: every request is predicted and recorded, finished
requests become length samples, a retrained version is picked up without a restart, and a
broken artifact stops the gateway from starting."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from devtools.launch import LaunchError, readiness
from tests.support.predictor_artifact import small_artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (small) artifact; log-spaced buckets so short answers still span several."""
    return small_artifact(tmp_path_factory.mktemp("predictor") / "base")


# Enough finished requests for a calibration (30) and a gate verdict (10) after the hash split.
SAMPLES = 64


def send_varied(base_url: str, n: int) -> None:
    """Random weights answer until max_tokens: varied limits give lengths to learn."""

    def one(i: int) -> int:
        prompt = f"Write a long essay about topic {i}" if i % 2 else f"Spell word {i}"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2 + (i * 7) % 40}
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert set(pool.map(one, range(n))) == {200}


def version_of(base_url: str) -> str | None:
    predictor = readiness(base_url)["predictor"]
    assert predictor["mode"] == "active"
    return predictor["version"]


def test_predictions_samples_and_hot_swap(start_federation, artifact: Path, tmp_path) -> None:
    federation = start_federation(
        live=["aws-use1"],
        env={"GATEWAY_PREDICTOR_DIR": str(artifact), "GATEWAY_PREDICTOR_POLL_S": "0.3"},
    )
    first_version = version_of(federation.base_url)
    send_varied(federation.base_url, SAMPLES)
    rows = federation.rows("r.status = 'completed'")
    assert len(rows) == SAMPLES
    for row in rows:
        assert row["predictor_version"] == first_version
        assert 1 <= row["predicted_tokens"] <= row["max_tokens"]
        assert row["predicted_p90_tokens"] is not None
        assert row["predicted_bucket"] is not None
    samples = federation.query("SELECT completion_tokens, censored FROM length_samples")
    assert len(samples) == SAMPLES
    # Random weights mostly run to max_tokens (censored), but may draw EOS now and then.
    assert sum(bool(censored) for _, censored in samples) >= SAMPLES // 2

    retrain = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.retrain_predictor",
            "--database-url",
            federation.database_url,
            "--out",
            str(tmp_path / "v2"),
            "--mode",
            "calibrate",
            "--include-censored",
            "--min-samples",
            "40",
            "--activate",
            "always",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert retrain.returncode == 0, retrain.stderr + retrain.stdout
    assert "registered" in retrain.stdout
    assert "served_mean" in retrain.stdout  # the gate's rivals are reported
    (metrics,) = federation.query("SELECT metrics FROM predictor_versions WHERE active")
    assert '"activation"' in str(metrics)  # the gate's numbers are kept with the version
    deadline = time.monotonic() + 20
    while version_of(federation.base_url) == first_version:
        assert time.monotonic() < deadline, "the gateway did not switch to the new version"
        time.sleep(0.2)
    new_version = version_of(federation.base_url)
    response = httpx.post(
        f"{federation.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "after the swap", "max_tokens": 4},
        timeout=30,
    )
    (row,) = federation.rows(f"r.id = '{response.json()['id']}'")
    assert row["predictor_version"] == new_version != first_version


def test_a_model_is_predicted_by_its_own_predictor(start_federation, artifact, tmp_path):
    """The federation file names the model's own artifact: it predicts that model's requests, not
    the default; retraining with --model registers a version for that model alone."""
    own = small_artifact(tmp_path / "own", seed=5)
    federation = start_federation(
        live=["aws-use1"],
        env={"GATEWAY_PREDICTOR_DIR": str(artifact), "GATEWAY_PREDICTOR_POLL_S": "0.3"},
        model_options={"predictor": str(own)},
    )
    ready = readiness(federation.gateway)
    default_version = ready["predictor"]["version"]
    own_version = ready["model_predictors"]["tiny"]
    assert own_version is not None
    assert own_version != default_version
    send_varied(federation.base_url, SAMPLES)
    assert {row["predictor_version"] for row in federation.rows()} == {own_version}
    registered = dict(federation.query("SELECT version, model FROM predictor_versions"))
    assert registered == {default_version: "", own_version: "tiny"}

    retrain = subprocess.run(
        [sys.executable, "-m", "gateway.retrain_predictor", "--database-url",
         federation.database_url, "--out", str(tmp_path / "own-v2"), "--model", "tiny",
         "--mode", "calibrate", "--include-censored", "--min-samples", "40",
         "--activate", "always"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert retrain.returncode == 0, retrain.stderr + retrain.stdout
    deadline = time.monotonic() + 20
    while (ready := readiness(federation.gateway))["model_predictors"]["tiny"] == own_version:
        assert time.monotonic() < deadline, "the gateway did not switch the model's predictor"
        time.sleep(0.2)
    assert ready["predictor"]["version"] == default_version  # the default is untouched
    active = dict(federation.query("SELECT model, version FROM predictor_versions WHERE active"))
    assert active == {"": default_version, "tiny": ready["model_predictors"]["tiny"]}


def test_a_broken_artifact_stops_the_gateway_with_a_clear_message(start_federation, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(LaunchError, match="cannot load the length predictor"):
        # No live site: the gateway must stop at the predictor, before it needs one.
        start_federation(live=[], dead=("gcp-euw4",), env={"GATEWAY_PREDICTOR_DIR": str(broken)})


def test_a_broken_model_artifact_stops_the_gateway_naming_the_model(start_federation, tmp_path):
    broken = tmp_path / "broken-own"
    broken.mkdir()
    with pytest.raises(LaunchError, match="length predictor of model tiny"):
        start_federation(live=[], dead=("gcp-euw4",), model_options={"predictor": str(broken)})


def test_readyz_reports_what_predicts_the_served_models(start_federation, artifact: Path) -> None:
    """Issue 32, a newcomer's first hour: the demo serves its model's own predictor and no
    default, and /readyz said `predictor: {"mode": "fallback"}` while the gateway warned "no
    default length predictor" at every start. The mode is now whether the served models are
    predicted; the default is reported apart, and its absence is no warning when every served
    model has its own."""
    federation = start_federation(live=["aws-use1"], model_options={"predictor": str(artifact)})
    ready = readiness(federation.gateway)
    predictor, own = ready["predictor"], ready["model_predictors"]["tiny"]
    assert predictor["mode"] == "active", predictor
    assert predictor["models"] == {"tiny": own}
    assert predictor["version"] is None  # no default
    assert "no default length predictor" not in federation.gateway.log_path.read_text()
