"""Capacity that follows load, end to end on real processes (docs/elastic.md).

- An operator joins a running site through the admin API: it serves at once; removed, it drains
  and leaves, recorded in the database.
- The scaling controller's local actuator starts a real second CPU site when a burst's predicted
  work outgrows one site, the router gives it work as soon as it serves, and once the load falls
  back it drains it and stops its process, while requests keep arriving: nothing is lost.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from devtools.launch import ManagedProcess, spawn_site, stop_all, wait_until_serving
from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
TOKEN = "elastic-test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def completion(client: openai.OpenAI, max_tokens: int) -> tuple[str, int]:
    """One streamed answer through the openai SDK: (the site that served it, its tokens)."""
    raw = client.completions.with_raw_response.create(
        model="tiny",
        prompt="The capacity of a federation follows its load",
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    site = raw.headers["x-fedllm-site"]
    tokens = 0
    for chunk in raw.parse():
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return site, tokens


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def ready_sites(federation: Federation) -> dict[str, bool]:
    sites: dict[str, bool] = httpx.get(
        f"{federation.base_url}/admin/api/readiness", headers=ADMIN, timeout=10
    ).json()["sites"]
    return sites


@pytest.fixture(scope="module")
def extra_sites(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    Callable[[str], ManagedProcess]
]:  # fmt: skip
    started: list[ManagedProcess] = []
    work = tmp_path_factory.mktemp("extra-sites")

    def start(name: str) -> ManagedProcess:
        process = spawn_site(
            model_dir=tiny_llama_dir, site_name=name, model_name="tiny", log_dir=work
        )
        started.append(process)
        return wait_until_serving(process)

    yield start
    stop_all(started)


def test_an_operator_joins_a_site_and_removes_it_by_draining(
    start_federation: Callable[..., Federation], extra_sites: Callable[[str], ManagedProcess]
) -> None:
    federation = start_federation(live=["aws-use1"], env={"GATEWAY_ADMIN_TOKEN": TOKEN})
    newcomer = extra_sites("gcp-euw4")
    entry = {"name": "gcp-euw4", "cloud": "gcp", "region": "europe-west4", "model": "tiny",
             "endpoint": f"127.0.0.1:{newcomer.port}", "capacity_weight": 2.0}  # fmt: skip
    with httpx.Client(base_url=federation.base_url, timeout=30) as http:
        assert http.post("/admin/api/sites", json=entry).status_code == 401
        bad = http.post("/admin/api/sites", json={**entry, "model": "no-such"}, headers=ADMIN)
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_site"
        joined = http.post("/admin/api/sites", json=entry, headers=ADMIN)
        assert joined.status_code == 201, joined.text
        assert joined.json() | {"in_flight": 0} == {
            "site": "gcp-euw4", "model": "tiny", "origin": "operator", "healthy": True,
            "draining": False, "leaving": False, "in_flight": 0,
        }  # fmt: skip
        again = http.post("/admin/api/sites", json=entry, headers=ADMIN)
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "site_exists"
        assert ready_sites(federation) == {"aws-use1": True, "gcp-euw4": True}

        client = openai.OpenAI(base_url=f"{federation.base_url}/v1", api_key="unused")
        served = [completion(client, 4) for _ in range(6)]
        assert {site for site, _ in served} == {"aws-use1", "gcp-euw4"}  # round robin
        assert all(tokens == 4 for _, tokens in served)

        assert http.delete("/admin/api/sites/nowhere", headers=ADMIN).status_code == 404
        left = http.delete("/admin/api/sites/gcp-euw4", headers=ADMIN)
        assert left.status_code == 202
        assert left.json()["draining"] is True
        wait_for("the site to leave", lambda: "gcp-euw4" not in ready_sites(federation))
        assert {completion(client, 2)[0] for _ in range(3)} == {"aws-use1"}

    (enabled,) = federation.query("SELECT enabled FROM sites WHERE name = 'gcp-euw4'")[0]
    assert not enabled
    events = federation.query(
        "SELECT action, actor FROM scaling_events WHERE site = 'gcp-euw4' ORDER BY id"
    )
    assert events == [("join", "operator"), ("drain", "operator"), ("leave", "operator")]
    rows = federation.rows("s.name = 'gcp-euw4'")
    assert rows
    assert all(row["status"] == "completed" for row in rows)


def scaling_file(path: Path, model_dir: Path, prefix: str) -> Path:
    """min 1 site (the federation file's), max 2: the second one a local CPU site process. A
    small target and short waits, so that a test-sized burst outgrows one site."""
    path.write_text(
        json.dumps(
            {
                "interval_s": 0.25,
                "models": [
                    {
                        "model": "tiny",
                        "min_sites": 1,
                        "max_sites": 2,
                        "target_backlog_s": 0.3,
                        "lead_time_s": 3,
                        "rate_s": 1,
                        "in_window_s": 3,
                        "out_cooldown_s": 1,
                        "in_cooldown_s": 3,
                        "site_tokens_per_s": 200,
                        "actuator": {
                            "kind": "local",
                            "name_prefix": prefix,
                            "command": [
                                sys.executable,
                                "-m",
                                "site_engine",
                                "--model",
                                str(model_dir),
                                "--max-num-seqs",
                                "4",
                            ],
                            "slots": [{"env": {"SITE_LOG_LEVEL": "INFO"}, "args": []}],
                            "log_dir": str(path.parent / "elastic-logs"),
                            "start_timeout_s": 180,
                        },
                    }
                ],
            }
        )
    )
    return path


def running(site_name: str) -> bool:
    """A process of this site still runs on this machine."""
    wanted = f"--site-name\0{site_name}\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and wanted in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_the_local_actuator_starts_a_site_under_load_and_drains_it_after(
    start_federation: Callable[..., Federation],
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    prefix = f"el{os.getpid()}"
    elastic = f"{prefix}-0"
    federation = start_federation(
        live=["aws-use1"],
        env={
            "GATEWAY_ADMIN_TOKEN": TOKEN,
            "GATEWAY_SCALING_FILE": str(
                scaling_file(tmp_path / "scaling.json", tiny_llama_dir, prefix)
            ),
            "GATEWAY_ROUTING_POLICY": "least_latency",
            "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
        },
    )
    # The SDK's own retries stay on, as every client has them: a pooled connection the gateway
    # closed after its keep-alive is retried before it reaches it. What the gateway accepted and
    # did not answer shows in its request log, checked below (every row completed, one a request).
    client = openai.OpenAI(base_url=f"{federation.base_url}/v1", api_key="unused")
    answers: list[tuple[str, int]] = []
    failures: list[str] = []
    lock = threading.Lock()

    def one(max_tokens: int) -> None:
        try:
            answer = completion(client, max_tokens)
        except Exception as exc:  # any failure is a lost request: recorded, asserted below
            with lock:
                failures.append(repr(exc))
            return
        with lock:
            answers.append(answer)

    # Bursts until the second site serves and has answered (its start takes seconds on CPU).
    with ThreadPoolExecutor(max_workers=16) as pool:
        deadline = time.monotonic() + 240
        while not any(site == elastic for site, _ in answers):
            assert time.monotonic() < deadline, "the elastic site never served"
            list(pool.map(one, [48] * 16))
    assert failures == []
    scaling = httpx.get(f"{federation.base_url}/admin/api/scaling", headers=ADMIN).json()
    assert scaling["enabled"]
    assert scaling["models"][0]["max_sites"] == 2
    wait_for(
        "both sites healthy", lambda: ready_sites(federation) == {"aws-use1": True, elastic: True}
    )

    # The burst is over; a trickle goes on while the controller drains the second site away.
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            one(8)

    trickler = threading.Thread(target=trickle)
    trickler.start()
    try:
        wait_for("the elastic site to leave", lambda: elastic not in ready_sites(federation), 180)
        wait_for("its process to stop", lambda: not running(elastic), 60)
    finally:
        stop.set()
        trickler.join()
    assert failures == []
    assert all(tokens in (48, 8) for _, tokens in answers)

    events = federation.query(
        "SELECT action, site, actor FROM scaling_events ORDER BY id"
    )  # fmt: skip
    actions = [(action, site) for action, site, _ in events]
    assert actions[0] == ("scale_out", None), federation.gateway.log_tail(80)
    expected = [("join", elastic), ("scale_in", elastic), ("drain", elastic), ("leave", elastic)]
    assert actions[1:] == expected, federation.gateway.log_tail(80)
    rows = federation.rows()
    assert len(rows) == len(answers)
    assert all(row["status"] == "completed" for row in rows)
    assert sum(row["site_name"] == elastic for row in rows) > 0
    # The scale-out was made on the burst's arrivals as this gateway admitted them, a lead
    # ahead (the rule's 3 s: no start measured yet); the scale-in on the window's level.
    ((rate, lead, reason),) = federation.query(
        "SELECT arrival_rate, lead_s, reason FROM scaling_events WHERE action = 'scale_out'"
    )
    assert isinstance(rate, float), reason
    assert rate > 0, reason
    assert lead == 3.0, reason
    assert "arrivals" in str(reason)
    ((smoothed, reason),) = federation.query(
        "SELECT smoothed_backlog_s, reason FROM scaling_events WHERE action = 'scale_in'"
    )
    assert smoothed is not None, reason
    assert "mean with 1 site(s)" in str(reason)
    metrics = httpx.get(f"{federation.base_url}/metrics", headers=ADMIN).text
    assert 'fedllm_gateway_scaling_lead_seconds{model="tiny"}' in metrics
    assert 'fedllm_gateway_scaling_desired_sites{model="tiny"} 1.0' in metrics
    assert 'fedllm_gateway_scaling_decisions_total{action="scale_out",model="tiny"} 1.0' in metrics
    assert 'fedllm_gateway_site_changes_total{change="leave"} 1.0' in metrics
