"""A site's metrics over a real engine (tiny random model on CPU): what MeteredEngine records,
and what the HTTP endpoint serves while the engine works and after."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from devtools.launch import free_port
from fedllm_contract.priority import Priority
from site_engine.engine.core.api import EngineRequest, EngineStats
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.metrics import EngineStatsCollector, MeteredEngine, SiteMetrics, serve_metrics
from site_engine.model_loading import LoadedModel, load_model
from site_engine.settings import SettingsError, SiteSettings

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Iterator[LoadedModel]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(tiny_llama_dir, device="cpu")
    torch.set_num_threads(previous)


def request(
    request_id: str, max_tokens: int, priority: Priority = Priority.INTERACTIVE
) -> EngineRequest:
    return EngineRequest(
        request_id,
        (1, 2, 3, 4),
        SamplingParams(max_tokens, temperature=0.0, ignore_eos=True),
        priority=priority,
    )


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def finished(samples: Samples, reason: str) -> float:
    return samples[("fedllm_site_requests_finished_total",
                    frozenset({"site": "s1", "reason": reason}.items()))]  # fmt: skip


def scalar(samples: Samples, name: str) -> float:
    return samples[(name, frozenset({"site": "s1"}.items()))]


def test_metered_engine_counts_steps_tokens_and_every_way_out(loaded: LoadedModel) -> None:
    metrics = SiteMetrics("s1")
    engine = MeteredEngine(PagedEngine(loaded, EngineConfig(max_num_seqs=2)), metrics)
    for i in range(4):
        engine.add_request(request(f"r{i}", 5))  # two run, two wait
    produced = sum(len(o.new_token_ids) for o in engine.step())
    assert len(engine.release_queued(1)) == 1  # one waiting request leaves for another site
    assert engine.abort("r0", FinishReason.CANCELLED)  # a running one is cancelled
    steps = 1
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    assert not engine.abort("r1", FinishReason.CANCELLED)  # already finished: not counted again
    samples = parse(generate_latest(metrics.registry).decode())
    assert {r.value: finished(samples, r.value) for r in FinishReason} == {
        "stop": 0, "length": 2, "cancelled": 1, "released": 1, "error": 0,
    }  # fmt: skip
    assert scalar(samples, "fedllm_site_generated_tokens_total") == produced > 0
    assert scalar(samples, "fedllm_site_step_seconds_count") == steps


class _Snapshot:
    """The engine's stats as EngineService hands them to the collector (no rates measured)."""

    def __init__(self, engine: MeteredEngine) -> None:
        self._engine = engine

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def decode_tokens_per_s(self) -> float:
        return 0.0

    def prefill_tokens_per_s(self) -> float:
        return 0.0


def by_class(samples: Samples, name: str) -> dict[str, float]:
    return {
        p.label: samples[(name, frozenset({"site": "s1", "priority": p.label}.items()))]
        for p in Priority
    }


def test_class_metrics_show_waiting_running_preempted_and_ttft_by_class(
    loaded: LoadedModel,
) -> None:
    metrics = SiteMetrics("s1")
    engine = MeteredEngine(PagedEngine(loaded, EngineConfig(max_num_seqs=2)), metrics)
    metrics.watch(_Snapshot(engine))
    engine.add_request(request("b0", 6, Priority.BATCH))
    engine.add_request(request("f0", 6, Priority.FLEX))
    engine.add_request(request("b1", 6, Priority.BATCH))  # waits: two slots
    engine.step()
    engine.add_request(request("i0", 3))  # takes the batch sequence's slot at once
    engine.step()
    samples = parse(generate_latest(metrics.registry).decode())
    assert by_class(samples, "fedllm_site_class_running_requests") == {
        "interactive": 1, "flex": 1, "batch": 0,
    }  # fmt: skip
    assert by_class(samples, "fedllm_site_class_waiting_requests") == {
        "interactive": 0, "flex": 0, "batch": 2,
    }  # fmt: skip
    assert by_class(samples, "fedllm_site_class_preemptions_total") == {
        "interactive": 0, "flex": 0, "batch": 1,
    }  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    samples = parse(generate_latest(metrics.registry).decode())
    # One first token per request; b0's came before its preemption and is not counted again.
    assert by_class(samples, "fedllm_site_time_to_first_token_seconds_count") == {
        "interactive": 1, "flex": 1, "batch": 2,
    }  # fmt: skip


def test_the_learned_step_cost_is_a_gauge_once_learned(loaded: LoadedModel) -> None:
    """Steps reported on a clock of the test's own (5 ms + 1 ms a token computed, as the
    priority bench's token clock counts them): the gauge is absent until the engine has seen
    enough steps, then shows about what that clock charges."""
    metrics = SiteMetrics("s1")
    paged = PagedEngine(loaded, EngineConfig(max_num_seqs=4, measure_step_time=False))
    engine = MeteredEngine(paged, metrics)
    metrics.watch(_Snapshot(engine))
    name = "fedllm_site_step_cost_seconds"
    assert not any(key[0] == name for key in parse(generate_latest(metrics.registry).decode()))
    for n in range(24):
        engine.add_request(request(f"r{n}", 2 + n % 7))
        if n % 3 < 2:
            continue
        while engine.has_unfinished():
            before = paged.scheduler_stats().prompt_tokens_computed
            outputs = engine.step()
            prefilled = paged.scheduler_stats().prompt_tokens_computed - before
            tokens = prefilled + sum(len(o.new_token_ids) for o in outputs)
            paged.record_step_seconds(0.005 + 0.001 * tokens)
    samples = parse(generate_latest(metrics.registry).decode())
    terms = {t: samples[(name, frozenset({"site": "s1", "term": t}.items()))] for t in TERMS}
    assert terms["base"] == pytest.approx(0.005, abs=2e-3)
    assert terms["per_token"] == pytest.approx(0.001, rel=0.3)


TERMS = ("base", "per_token", "per_context_position")


def one_running_one_waiting(samples: Samples) -> bool:
    return (
        scalar(samples, "fedllm_site_running_requests") == 1
        and scalar(samples, "fedllm_site_waiting_requests") == 1
    )


def test_endpoint_serves_live_queue_and_token_gauges(loaded: LoadedModel) -> None:
    metrics = SiteMetrics("s1")
    engine = MeteredEngine(PagedEngine(loaded, EngineConfig(max_num_seqs=1)), metrics)
    service = EngineService(engine, loaded.tokenizer)
    metrics.watch(service)
    server = serve_metrics(metrics, "127.0.0.1", free_port())
    url = f"http://127.0.0.1:{server.port}/metrics"
    service.start()

    async def run_two() -> list[int]:
        async def consume(req: EngineRequest) -> int:
            return [e async for e in service.generate(req)][-1].completion_tokens

        tasks = [asyncio.create_task(consume(request(f"q{i}", 150))) for i in range(2)]
        busy = await asyncio.to_thread(wait_for, url, one_running_one_waiting)
        assert scalar(busy, "fedllm_site_running_tokens") > 4  # the prompt and some answer
        assert scalar(busy, "fedllm_site_queued_prompt_tokens") == 4  # the waiting prompt
        assert scalar(busy, "fedllm_site_kv_blocks_used") >= 1
        return list(await asyncio.gather(*tasks))

    try:
        assert asyncio.run(run_two()) == [150, 150]
        idle = wait_for(url, lambda s: scalar(s, "fedllm_site_running_requests") == 0)
    finally:
        service.stop()
        server.stop()
    assert scalar(idle, "fedllm_site_waiting_requests") == 0
    assert scalar(idle, "fedllm_site_generated_tokens_total") == 300
    assert finished(idle, "length") == 2
    stats = service.stats()
    assert scalar(idle, "fedllm_site_iterations_total") == stats.iterations >= 300
    assert scalar(idle, "fedllm_site_kv_blocks_total") == stats.kv_blocks_total > 0
    assert scalar(idle, "fedllm_site_preemptions_total") == stats.num_preemptions
    # Two 4-token prompts looked up; no full block of 16 to share.
    assert scalar(idle, "fedllm_site_prefix_cache_queries_tokens_total") == 8
    assert scalar(idle, "fedllm_site_prefix_cache_hits_tokens_total") == 0
    assert scalar(idle, "fedllm_site_prompt_tokens_computed_total") == 8


def wait_for(url: str, condition: Callable[[Samples], bool], timeout_s: float = 60.0) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = parse(httpx.get(url, timeout=5).text)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never matched: {samples}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SITE_METRICS_PORT": "70000"}, "SITE_METRICS_PORT"),
        ({"SITE_METRICS_PORT": "9000", "SITE_PORT": "9000"}, "differ from SITE_PORT"),
        ({"SITE_METRICS_PORT": "x"}, "SITE_METRICS_PORT must be an integer"),
    ],
)
def test_bad_metrics_port_is_refused_loudly(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        SiteSettings.load({"SITE_MODEL_DIR": "m", **env})


def test_metrics_are_off_unless_a_port_is_set() -> None:
    assert SiteSettings.load({"SITE_MODEL_DIR": "m"}).metrics_port == 0
    assert (
        SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_METRICS_PORT": "9100"}).metrics_port == 9100
    )


def test_prefix_caching_settings() -> None:
    assert SiteSettings.load({"SITE_MODEL_DIR": "m"}).prefix_caching
    off = SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_PREFIX_CACHING": "false"})
    assert not off.prefix_caching
    with pytest.raises(SettingsError, match="host tier needs prefix caching"):
        SiteSettings.load(
            {"SITE_MODEL_DIR": "m", "SITE_PREFIX_CACHING": "false", "SITE_HOST_KV_CACHE_GIB": "1"}
        )
    with pytest.raises(SettingsError, match="SITE_HOST_KV_CACHE_GIB"):
        SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_HOST_KV_CACHE_GIB": "-1"})


class FixedStats:
    """A stats source that serves one snapshot, as EngineService serves its latest."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats

    def decode_tokens_per_s(self) -> float:
        return 0.0

    def prefill_tokens_per_s(self) -> float:
        return 0.0


def test_host_tier_metrics_show_its_hit_rate_bytes_and_skipped_copies() -> None:
    stats = EngineStats(
        num_waiting=0, num_running=0, queued_prompt_tokens=0, running_tokens=0,
        predicted_remaining_tokens=0, kv_blocks_used=0, kv_blocks_total=8, iterations=3,
        prefix_cache_queries=400, prefix_cache_hits=200, prefix_cache_host_hits=100,
        host_kv_bytes_offloaded=4096, host_kv_bytes_onloaded=2048,
        host_kv_blocks_skipped_budget=5, host_kv_blocks_declined=7,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("s1", FixedStats(stats)))
    samples = parse(generate_latest(registry).decode())
    assert scalar(samples, "fedllm_site_host_kv_hit_rate") == 0.25
    assert scalar(samples, "fedllm_site_host_kv_offloaded_bytes_total") == 4096
    assert scalar(samples, "fedllm_site_host_kv_onloaded_bytes_total") == 2048
    assert scalar(samples, "fedllm_site_host_kv_offload_skipped_blocks_total") == 5
    assert scalar(samples, "fedllm_site_host_kv_offload_declined_blocks_total") == 7
    idle = CollectorRegistry()
    idle.register(EngineStatsCollector("s1", FixedStats(replace(stats, prefix_cache_queries=0))))
    assert scalar(parse(generate_latest(idle).decode()), "fedllm_site_host_kv_hit_rate") == 0.0


def test_host_tier_budget_settings_are_checked() -> None:
    settings = SiteSettings.load(
        {"SITE_MODEL_DIR": "m", "SITE_HOST_KV_OFFLOAD_BYTES_PER_STEP": "1048576",
         "SITE_HOST_KV_ACTIVE_WINDOW_STEPS": "0"}
    )  # fmt: skip
    assert (settings.host_kv_offload_bytes_per_step, settings.host_kv_active_window_steps) == (
        1 << 20,
        0,
    )
    for env in ({"SITE_HOST_KV_OFFLOAD_BYTES_PER_STEP": "0"},
                {"SITE_HOST_KV_ACTIVE_WINDOW_STEPS": "-1"}):  # fmt: skip
        with pytest.raises(SettingsError, match="SITE_HOST_KV_OFFLOAD_BYTES_PER_STEP"):
            SiteSettings.load({"SITE_MODEL_DIR": "m", **env})
