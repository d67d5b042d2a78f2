"""The drift signal and retrain jobs over real HTTP: the served model's rolling error on the admin
API and /metrics, a retrain job asked for by an operator that fails (too few samples) and is
recorded as failed, then one that runs the real calibrate + gate path in the gateway's worker
subprocess and finishes with a registered version and the gate's decision."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Federation
from tests.e2e.test_prediction_http import SAMPLES, send_varied
from tests.support.predictor_artifact import small_artifact

pytestmark = pytest.mark.slow
TOKEN = "drift-test-admin-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def federation(start_federation, tmp_path_factory: pytest.TempPathFactory) -> Federation:
    work = tmp_path_factory.mktemp("drift")
    return start_federation(
        live=["aws-use1"],
        # This gateway runs retrain jobs (subprocesses of its interpreter): it needs the training
        # extras, as the trainer image has.
        python=sys.executable,
        env={
            "GATEWAY_ADMIN_TOKEN": TOKEN,
            "GATEWAY_PREDICTOR_DIR": str(small_artifact(work / "base")),
            "GATEWAY_PREDICTOR_POLL_S": "0.3",
            # The tiny model's random weights answer until max_tokens: every sample is cut.
            "GATEWAY_DRIFT_INCLUDE_CENSORED": "true",
            "GATEWAY_DRIFT_MIN_SAMPLES": "20",
            "GATEWAY_DRIFT_REFRESH_S": "0.3",
            "GATEWAY_RETRAIN_INCLUDE_CENSORED": "true",
            "GATEWAY_RETRAIN_MIN_SAMPLES": "40",
            "GATEWAY_RETRAIN_POLL_S": "0.2",
            "GATEWAY_RETRAIN_OUT_DIR": str(work / "jobs"),
        },
    )


def wait_for_job(client: httpx.Client, job_id: int, timeout_s: float = 180) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, object] = client.get(f"/admin/api/retrain-jobs/{job_id}").json()
        if job["state"] in ("done", "failed"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.3)


def test_predictor_drift_and_retrain_jobs(federation: Federation, tmp_path: Path) -> None:
    with httpx.Client(base_url=federation.base_url, headers=BEARER, timeout=30) as client:
        assert httpx.get(f"{federation.base_url}/admin/api/predictors").status_code == 401
        assert httpx.post(f"{federation.base_url}/admin/api/retrain-jobs",
                          json={}).status_code == 401  # fmt: skip
        assert client.post("/admin/api/retrain-jobs", json={"model": "nope"}).status_code == 404
        assert client.post("/admin/api/retrain-jobs", json={"mode": "calibrate"}).status_code == 400
        bad = client.post("/admin/api/retrain-jobs", json={"model": "tiny", "mode": "finetune"})
        assert bad.status_code == 400

        # No traffic yet: the job has nothing to learn from, and says so.
        early = client.post("/admin/api/retrain-jobs", json={"model": "tiny", "mode": "calibrate"})
        assert early.status_code == 202, early.text
        assert early.json()["state"] == "queued"
        assert early.json()["reason"] == "manual"
        failed = wait_for_job(client, early.json()["id"])
        assert failed["state"] == "failed"
        assert "samples < --min-samples 40" in str(failed["error"])

        send_varied(federation.base_url, SAMPLES)
        deadline = time.monotonic() + 20
        while True:
            (tiny,) = client.get("/admin/api/predictors").json()["models"]
            if tiny["rolling"] and tiny["rolling"]["samples"] == SAMPLES:
                break
            assert time.monotonic() < deadline, tiny
            time.sleep(0.3)
        rolling = tiny["rolling"]
        ((served,),) = federation.query("SELECT avg(completion_tokens) FROM length_samples")
        assert rolling["mean_served_tokens"] == pytest.approx(float(str(served)), abs=1e-3)
        assert rolling["served_mean_mae_tokens"] > 0
        # Each figure is rounded to 4 decimals on the wire, so compare within that rounding.
        assert rolling["mae_ratio"] == pytest.approx(
            rolling["mae_tokens"] / rolling["served_mean_mae_tokens"], abs=2e-4
        )
        assert tiny["window_version"] == tiny["serving_version"]
        assert tiny["last_job"]["id"] == early.json()["id"]
        metrics = client.get("/metrics").text
        assert f'fedllm_gateway_predictor_rolling_samples{{model="tiny"}} {SAMPLES}.0' in metrics
        flag = f'fedllm_gateway_predictor_drifted{{model="tiny"}} {float(tiny["drifted"])}'
        assert flag in metrics

        job = client.post("/admin/api/retrain-jobs", json={"model": "tiny", "mode": "calibrate"})
        assert job.status_code == 202, job.text
        done = wait_for_job(client, job.json()["id"])
        assert done["state"] == "done", done["error"]
        assert done["version"]
        assert isinstance(done["activated"], bool)
        decision = done["decision"]
        assert isinstance(decision, dict)
        assert set(decision["rivals"]) == {"active", "served_mean", "tfidf"}
        (registered,) = federation.query(
            f"SELECT model, active FROM predictor_versions WHERE version = '{done['version']}'"
        )
        assert registered == ("tiny", done["activated"])
        listed = client.get("/admin/api/retrain-jobs", params={"model": "tiny"}).json()
        assert [j["id"] for j in listed] == [done["id"], failed["id"]]
