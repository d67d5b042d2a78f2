"""Prometheus metrics through the public HTTP API, with real site processes: the gateway's
/metrics needs the admin credential and counts exactly the traffic sent; each site serves its own
queue and token gauges on its metrics port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.launch import ManagedProcess, free_port, spawn_site, start_gateway, wait_until_serving
from tests.e2e.conftest import SITE_PLACES, Federation, write_federation
from tests.e2e.test_prediction_http import artifact  # noqa: F401 (a fixture: a small real artifact)

pytestmark = pytest.mark.slow
TOKEN = "metrics-admin-token-0123456789"
SITES = ("aws-use1", "gcp-euw4")
ANSWER = 6
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Deployment:
    gateway: ManagedProcess
    sites: dict[str, ManagedProcess]
    metrics_ports: dict[str, int]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def scrape(self, token: str | None = TOKEN) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=10)

    def gateway_samples(self) -> Samples:
        response = self.scrape()
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain")
        return parse(response.text)

    def site_samples(self, site: str) -> Samples:
        return parse(httpx.get(f"http://127.0.0.1:{self.metrics_ports[site]}/metrics").text)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def site_labels(site: str) -> dict[str, str]:
    cloud, region = SITE_PLACES[site]
    return {"site": site, "cloud": cloud, "region": region}


def wait_for(read: Callable[[], Samples], ok: Callable[[Samples], bool]) -> Samples:
    deadline = time.monotonic() + 60
    while True:
        samples = read()
        if ok(samples):
            return samples
        assert time.monotonic() < deadline, "metrics never reached the expected state"
        time.sleep(0.05)


@contextmanager
def deploy(
    model_dir: Path, work: Path, site_args: dict[str, list[str]], env: dict[str, str] | None = None
) -> Iterator[Deployment]:
    """Sites (each with a metrics port and its own extra flags) and a gateway with a token."""
    ports = {name: free_port() for name in site_args}
    sites = {
        name: spawn_site(model_dir=model_dir, site_name=name, model_name="tiny", log_dir=work,
                         extra_args=["--metrics-port", str(ports[name]), *args])
        for name, args in site_args.items()
    }  # fmt: skip
    started = list(sites.values())
    try:
        for process in sites.values():
            wait_until_serving(process)
        endpoints = {name: f"127.0.0.1:{p.port}" for name, p in sites.items()}
        gateway = start_gateway(
            federation_file=write_federation(work / "federation.json", model_dir, endpoints),
            database_url=f"sqlite+aiosqlite:///{work / 'gateway.db'}",
            log_dir=work,
            expect_healthy_sites=len(sites),
            env={"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_LOAD_REPORT_INTERVAL_MS": "50",
                 **(env or {})},
        )  # fmt: skip
        started.append(gateway)
        yield Deployment(gateway, sites, ports)
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture(scope="module")
def deployment(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    work = tmp_path_factory.mktemp("metrics")
    with deploy(tiny_llama_dir, work, {name: [] for name in SITES}) as running:
        yield running


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Cookie": f"fedllm_admin={TOKEN}"},  # the raw token is not a session cookie
    ],
)
def test_metrics_need_the_admin_credential(deployment: Deployment, headers: dict[str, str]) -> None:
    response = httpx.get(f"{deployment.base_url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 401
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "admin_credential_required")
    assert "fedllm_" not in response.text


def send(deployment: Deployment, i: int, stream: bool) -> str:
    body = {"model": "tiny", "prompt": f"count {i}", "max_tokens": ANSWER, "ignore_eos": True,
            "stream": stream}  # fmt: skip
    response = httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.headers["X-Fedllm-Site"]


def test_counters_match_the_traffic_sent(deployment: Deployment) -> None:
    before = deployment.gateway_samples()
    site_before = {name: deployment.site_samples(name) for name in SITES}
    placed = [send(deployment, i, stream=i % 3 == 0) for i in range(6)]
    per_site = {name: placed.count(name) for name in SITES}
    assert all(per_site.values()), f"round robin used one site only: {placed}"
    after = deployment.gateway_samples()

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for site, count in per_site.items():
        decisions = moved("fedllm_gateway_routing_decisions_total", policy="round_robin", site=site)
        assert decisions == count
        assert moved("fedllm_gateway_requests_finished_total", site=site, status="completed") == (
            count
        )
        assert moved("fedllm_gateway_completion_tokens_total", site=site) == count * ANSWER
        assert moved("fedllm_gateway_ttft_seconds_count", site=site) == count
        # The site saw the same requests and generated the same tokens.
        site_after = deployment.site_samples(site)
        for name, labels, expected in (
            ("fedllm_site_generated_tokens_total", {}, count * ANSWER),
            ("fedllm_site_requests_finished_total", {"reason": "length"}, count),
        ):
            full = {"site": site, **labels}
            delta = value(site_after, name, **full) - value(site_before[site], name, **full)
            assert delta == expected, (site, name)
        assert value(site_after, "fedllm_site_iterations_total", site=site) >= ANSWER
        assert value(site_after, "fedllm_site_step_seconds_count", site=site) >= ANSWER
    # No predictor is configured: every request went on without a prediction.
    assert moved("fedllm_gateway_prediction_fallbacks_total", reason="no_predictor") == 6
    assert moved("fedllm_gateway_routing_decisions_total", policy="round_robin", site="none") == 0
    route = {"route": "/v1/completions", "method": "POST"}
    assert moved("fedllm_gateway_http_requests_total", status="200", **route) == 6
    assert moved("fedllm_gateway_http_request_seconds_count", **route) == 6
    # The scrape before this one was counted too, under its own route.
    assert moved("fedllm_gateway_http_requests_total", route="/metrics", method="GET",
                 status="200") == 1  # fmt: skip


def test_http_metrics_label_routes_by_template_never_by_raw_path(deployment: Deployment) -> None:
    raw_id = "batch_does_not_exist_4f1c"
    response = httpx.get(f"{deployment.base_url}/v1/batches/{raw_id}", timeout=10)
    assert response.status_code >= 400
    httpx.get(f"{deployment.base_url}/no/such/path/{raw_id}", timeout=10)
    text = deployment.scrape().text
    assert raw_id not in text
    routes = {
        dict(labels)["route"]
        for name, labels in parse(text)
        if name == "fedllm_gateway_http_requests_total"
    }
    assert any("{batch_id" in route for route in routes), routes


def test_load_gauges_move_while_a_request_runs(deployment: Deployment) -> None:
    """One long request: the gateway's and the site's gauges show it running, then idle."""
    done: list[str] = []
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 400, "ignore_eos": True}

    def long_request() -> None:
        response = httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=300)
        done.append(response.headers.get("X-Fedllm-Site", ""))

    client = threading.Thread(target=long_request)
    client.start()

    def busy_site(samples: Samples) -> str | None:
        return next(
            (s for s in SITES
             if value(samples, "fedllm_gateway_site_in_flight_requests", **site_labels(s)) == 1
             and value(samples, "fedllm_gateway_site_running_requests", **site_labels(s)) == 1),
            None,
        )  # fmt: skip

    try:
        busy = wait_for(deployment.gateway_samples, lambda s: busy_site(s) is not None)
        site = busy_site(busy)
        assert site is not None
        labels = site_labels(site)
        assert value(busy, "fedllm_gateway_site_outstanding_tokens", **labels) > 0
        assert value(busy, "fedllm_gateway_site_running_tokens", **labels) > 0
        assert value(busy, "fedllm_gateway_site_healthy", **labels) == 1
        assert value(busy, "fedllm_gateway_site_kv_blocks_used", **labels) >= 1
        site_busy = deployment.site_samples(site)
        assert value(site_busy, "fedllm_site_running_requests", site=site) == 1
        assert value(site_busy, "fedllm_site_running_tokens", site=site) > 0
    finally:
        client.join(timeout=300)
    assert done == [site]
    idle = wait_for(
        deployment.gateway_samples,
        lambda s: (
            value(s, "fedllm_gateway_site_running_requests", **labels) == 0
            and value(s, "fedllm_gateway_site_outstanding_tokens", **labels) == 0
        ),
    )
    assert value(idle, "fedllm_gateway_site_in_flight_requests", **labels) == 0
    assert value(idle, "fedllm_gateway_site_kv_blocks_total", **labels) > 0
    assert value(deployment.site_samples(site), "fedllm_site_waiting_requests", site=site) == 0


def test_offloads_are_counted_by_giver_and_taker(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Round robin gives the one-slot site a queue while the four-slot site has room: the
    released requests show on the gateway (released, restarted) and on the giver site."""
    site_args = {"aws-use1": ["--max-num-seqs", "1"], "gcp-euw4": ["--max-num-seqs", "4"]}
    env = {"GATEWAY_OFFLOAD_INTERVAL_S": "0.2"}
    with deploy(tiny_llama_dir, tmp_path, site_args, env) as running:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True}

        def post(i: int) -> None:
            response = httpx.post(
                f"{running.base_url}/v1/completions",
                json={**body, "prompt": f"offload {i}"},
                timeout=300,
            )
            assert response.json()["usage"]["completion_tokens"] == 200

        clients = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=300)
        samples = running.gateway_samples()
        giver = running.site_samples("aws-use1")
    pair = {"giver": "aws-use1", "taker": "gcp-euw4"}
    released = value(giver, "fedllm_site_requests_finished_total", site="aws-use1",
                     reason="released")  # fmt: skip
    assert released >= 1, "nothing was offloaded"
    assert value(samples, "fedllm_gateway_offload_releases_total", **pair) == released
    assert value(samples, "fedllm_gateway_offloads_total", **pair) == released
    reverse = {"giver": "gcp-euw4", "taker": "aws-use1"}
    assert value(samples, "fedllm_gateway_offloads_total", **reverse) == 0
    finished = {
        site: value(samples, "fedllm_gateway_requests_finished_total", site=site,
                    status="completed")
        for site in ("aws-use1", "gcp-euw4")
    }  # fmt: skip
    assert finished == {"aws-use1": 2 - released, "gcp-euw4": 2 + released}


def test_prediction_latency_and_error_match_the_recorded_requests(
    start_federation: Callable[..., Federation],
    artifact: Path,  # noqa: F811 (the fixture imported above)
) -> None:
    federation = start_federation(
        live=["aws-use1"],
        env={"GATEWAY_PREDICTOR_DIR": str(artifact), "GATEWAY_ADMIN_TOKEN": TOKEN},
    )
    with httpx.Client(base_url=federation.base_url, timeout=60) as client:
        for i in range(8):
            body = {"model": "tiny", "prompt": f"Explain topic {i} " * (i + 1),
                    "max_tokens": 4 + 4 * i, "ignore_eos": True}  # fmt: skip
            assert client.post("/v1/completions", json=body).status_code == 200
        response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    samples = parse(response.text)
    rows = federation.rows("r.status = 'completed'")
    assert len(rows) == 8
    errors = [
        abs(cast(int, r["predicted_tokens"]) - cast(int, r["completion_tokens"])) for r in rows
    ]
    assert value(samples, "fedllm_gateway_prediction_error_tokens_count", model="tiny") == 8
    assert value(samples, "fedllm_gateway_prediction_error_tokens_sum", model="tiny") == sum(errors)
    assert value(samples, "fedllm_gateway_prediction_seconds_count") == 8
    assert value(samples, "fedllm_gateway_predictor_batch_seconds_count") >= 1
    assert value(samples, "fedllm_gateway_prediction_fallbacks_total", reason="no_predictor") == 0


def test_failovers_count_the_requests_moved_off_a_dead_site(
    start_federation: Callable[..., Federation],
) -> None:
    # The gateway still believes the killed site healthy (long health interval): requests sent
    # there meet UNAVAILABLE and move on, which is what the failover counter counts.
    federation = start_federation(
        live=["aws-use1", "gcp-euw4"],
        env={"GATEWAY_HEALTH_INTERVAL_S": "300", "GATEWAY_ADMIN_TOKEN": TOKEN},
    )
    federation.sites["aws-use1"].kill()
    with httpx.Client(base_url=federation.base_url, timeout=30) as client:
        for i in range(4):
            body = {"model": "tiny", "prompt": f"p{i}", "max_tokens": 3}
            assert client.post("/v1/completions", json=body).status_code == 200
        samples = parse(client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text)
    moved = sum(cast(int, row["attempts"]) - 1 for row in federation.rows())
    assert moved >= 1
    assert value(samples, "fedllm_gateway_failovers_total", site="aws-use1") == moved
    assert value(samples, "fedllm_gateway_failovers_total", site="gcp-euw4") == 0
    labels = site_labels("aws-use1")
    assert value(samples, "fedllm_gateway_site_healthy", **labels) == 0
    assert value(samples, "fedllm_gateway_requests_finished_total", site="gcp-euw4",
                 status="completed") == 4  # fmt: skip
