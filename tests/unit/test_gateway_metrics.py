"""The gateway's metrics: per-site gauges read at scrape time, event recording, predictor timing,
and separate registries per gateway."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.federation import SiteConfig
from gateway.metrics import GatewayMetrics
from gateway.prediction.service import PredictorService
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView
from gateway.sites.registry import SiteRegistry, SiteState
from tests.unit.test_prediction_service import LengthByWords

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: GatewayMetrics) -> Samples:
    """Every sample of one scrape, keyed by (sample name, labels)."""
    text = metrics.exposition().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


IDLE = LoadView(0, 0, 0, 0, 0, 0, 0, decode_tokens_per_s=42.5, iterations=0, sequence=1)


def report(**fields: Any) -> LoadView:
    return replace(IDLE, **fields)


def two_sites() -> SiteRegistry:
    """A reporting site and one that never reported; clients are real but never called."""
    return SiteRegistry(
        SiteState(
            config=SiteConfig(name, cloud, region, "127.0.0.1:1", "tiny"),
            site_id=i,
            client=GrpcSiteClient(name, "127.0.0.1:1", 1.0),
        )
        for i, (name, cloud, region) in enumerate(
            [("aws-use1", "aws", "us-east-1"), ("gcp-euw4", "gcp", "europe-west4")]
        )
    )


AWS = {"site": "aws-use1", "cloud": "aws", "region": "us-east-1"}
GCP = {"site": "gcp-euw4", "cloud": "gcp", "region": "europe-west4"}


def test_site_gauges_show_the_registry_as_it_is_when_scraped() -> None:
    async def scenario() -> tuple[Samples, Samples]:
        registry = two_sites()
        metrics = GatewayMetrics()
        metrics.watch_sites(registry.all)
        aws, gcp = registry.all()
        aws.healthy, aws.in_flight, aws.ledger_tokens = True, 3, 120
        aws.apply_report(
            report(queued_requests=2, running_requests=1, queued_prompt_tokens=50,
                   running_tokens=30, predicted_remaining_tokens=200, kv_blocks_used=4,
                   kv_blocks_total=64)
        )  # fmt: skip
        first = scrape(metrics)
        aws.ledger_tokens, gcp.healthy = 500, True  # changes after the first scrape
        second = scrape(metrics)
        await registry.close()
        return first, second

    first, second = asyncio.run(scenario())
    expected_aws = {
        "healthy": 1,
        "in_flight_requests": 3,
        "ledger_tokens": 120,
        "outstanding_tokens": 280,  # the report's 50 + 30 + 200 beats the ledger's 120
        "queued_requests": 2,
        "running_requests": 1,
        "queued_prompt_tokens": 50,
        "running_tokens": 30,
        "predicted_remaining_tokens": 200,
        "kv_blocks_used": 4,
        "kv_blocks_total": 64,
        "decode_tokens_per_second": 42.5,
    }
    for name, expected in expected_aws.items():
        assert value(first, f"fedllm_gateway_site_{name}", **AWS) == expected, name
    # The silent site has the gateway's own gauges, and no report gauges rather than zeros.
    assert value(first, "fedllm_gateway_site_healthy", **GCP) == 0
    assert value(first, "fedllm_gateway_site_outstanding_tokens", **GCP) == 0
    assert value(first, "fedllm_gateway_site_queued_requests", **GCP) is None
    # Read at scrape time: the second scrape sees the later state.
    assert value(second, "fedllm_gateway_site_ledger_tokens", **AWS) == 500
    assert value(second, "fedllm_gateway_site_outstanding_tokens", **AWS) == 500
    assert value(second, "fedllm_gateway_site_healthy", **GCP) == 1


@pytest.mark.parametrize(
    ("status", "predicted", "completion", "error_count", "error_sum"),
    [
        ("completed", 10, 25, 1, 15),
        ("completed", 40, 25, 1, 15),
        ("completed", None, 25, 0, 0),  # no prediction: nothing to compare
        ("failed", 10, 3, 0, 0),  # a broken answer says nothing about the predictor
        ("cancelled", 10, 3, 0, 0),
    ],
)
def test_a_finished_request_counts_tokens_and_prediction_error(
    status: str, predicted: int | None, completion: int, error_count: int, error_sum: int
) -> None:
    metrics = GatewayMetrics()
    metrics.finished("aws-use1", "tiny", status, (7, completion), predicted)
    samples = scrape(metrics)
    assert value(samples, "fedllm_gateway_requests_finished_total", site="aws-use1",
                 status=status) == 1  # fmt: skip
    assert value(samples, "fedllm_gateway_prompt_tokens_total", site="aws-use1") == 7
    assert value(samples, "fedllm_gateway_completion_tokens_total", site="aws-use1") == completion
    count = value(samples, "fedllm_gateway_prediction_error_tokens_count", model="tiny")
    assert (count or 0) == error_count
    assert (value(samples, "fedllm_gateway_prediction_error_tokens_sum", model="tiny") or 0) == (
        error_sum
    )


def test_routing_decisions_count_by_policy_and_site_including_none() -> None:
    metrics = GatewayMetrics()
    for site in ("a", "b", "a", None):
        metrics.routed("mico", site)
    samples = scrape(metrics)
    name = "fedllm_gateway_routing_decisions_total"
    assert value(samples, name, policy="mico", site="a") == 2
    assert value(samples, name, policy="mico", site="b") == 1
    assert value(samples, name, policy="mico", site="none") == 1


def test_gateways_in_one_process_keep_separate_counts() -> None:
    one, two = GatewayMetrics(), GatewayMetrics()  # same metric names: no collision
    one.routed("round_robin", "a")
    assert value(scrape(one), "fedllm_gateway_routing_decisions_total",
                 policy="round_robin", site="a") == 1  # fmt: skip
    assert value(scrape(two), "fedllm_gateway_routing_decisions_total",
                 policy="round_robin", site="a") is None  # fmt: skip


def predict_all(service: PredictorService, prompts: list[str]) -> None:
    async def scenario() -> None:
        service.start()
        try:
            await asyncio.gather(*(service.predict(p) for p in prompts))
        finally:
            await service.stop()

    asyncio.run(scenario())


def test_predictor_latency_is_timed_per_request_and_per_batch() -> None:
    metrics = GatewayMetrics()
    service = PredictorService(LengthByWords(), max_batch=2, max_wait_s=0.05, metrics=metrics)
    predict_all(service, ["a", "b", "c"])
    samples = scrape(metrics)
    assert value(samples, "fedllm_gateway_prediction_seconds_count") == 3
    assert value(samples, "fedllm_gateway_predictor_batch_seconds_count") == 2  # 2 + 1 prompts
    assert (value(samples, "fedllm_gateway_prediction_seconds_sum") or 0) > 0
    assert value(samples, "fedllm_gateway_prediction_fallbacks_total", reason="error") is None


@pytest.mark.parametrize(
    ("predictor", "reason"),
    [(None, "no_predictor"), (LengthByWords(fail=True), "error")],
)
def test_requests_without_a_prediction_count_as_fallbacks(
    predictor: LengthByWords | None, reason: str
) -> None:
    metrics = GatewayMetrics()
    predict_all(PredictorService(predictor, metrics=metrics), ["a", "b"])
    samples = scrape(metrics)
    assert value(samples, "fedllm_gateway_prediction_fallbacks_total", reason=reason) == 2
