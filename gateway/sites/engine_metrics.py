"""Reading an external engine's Prometheus metrics into the few numbers load balancing needs.

Each dialect maps the names its engine documents (looked up in the engines' docs, not guessed):

- vLLM (docs.vllm.ai, "Production Metrics"): `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (before v0.10:
  `vllm:gpu_cache_usage_perc`), `vllm:generation_tokens_total` (counter) and the info gauge
  `vllm:cache_config_info{block_size, num_gpu_blocks}` for the KV capacity.
- SGLang (docs.sglang.io, "Production Metrics", with `--enable-metrics`):
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage` (fraction of the KV
  pool), `sglang:max_total_num_tokens` (the pool), `sglang:gen_throughput` (tokens/s, a gauge)
  and `sglang:generation_tokens_total`.
- TGI (huggingface.co/docs/text-generation-inference, "Metrics"): `tgi_batch_current_size`,
  `tgi_queue_size` and `tgi_request_generated_tokens` (a histogram: its `_sum` counts tokens of
  finished requests). TGI publishes no KV usage.

Series are summed over an engine's ranks and replicas; a series labelled with another
`model_name` than the one the site serves is left out (one engine may serve several models).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.federation import MetricsDialect


class MetricsFormatError(ValueError):
    """The metrics page is not Prometheus text, or lacks the dialect's request gauges."""


@dataclass(frozen=True, slots=True)
class Dialect:
    running: str
    waiting: str
    # Fractions (0..1) of the KV cache in use, the first name present wins.
    kv_usage: tuple[str, ...] = ()
    # The KV pool in tokens, as a gauge (SGLang); vLLM's comes from its cache_config_info.
    kv_capacity: str | None = None
    generation_counter: str | None = None
    generation_rate: str | None = None


DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        generation_counter="vllm:generation_tokens_total",
    ),
    "sglang": Dialect(
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage=("sglang:token_usage",),
        kv_capacity="sglang:max_total_num_tokens",
        generation_counter="sglang:generation_tokens_total",
        generation_rate="sglang:gen_throughput",
    ),
    "tgi": Dialect(
        running="tgi_batch_current_size",
        waiting="tgi_queue_size",
        generation_counter="tgi_request_generated_tokens_sum",
    ),
}
_VLLM_CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of an engine, in the engine's own terms (None: the engine does not say)."""

    running_requests: int
    waiting_requests: int
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    generation_tokens_total: float | None = None
    generation_tokens_per_s: float | None = None


Sample = tuple[dict[str, str], float]


def _samples(text: str, model: str) -> dict[str, list[Sample]]:
    by_name: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = dict(sample.labels)
                if labels.get("model_name", model) != model:
                    continue
                by_name.setdefault(sample.name, []).append((labels, float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from exc
    return by_name


def _sum(samples: dict[str, list[Sample]], name: str | None) -> float | None:
    if name is None or name not in samples:
        return None
    return sum(value for _labels, value in samples[name])


def _first_max(samples: dict[str, list[Sample]], names: Iterable[str]) -> float | None:
    for name in names:
        if name in samples:
            return max(value for _labels, value in samples[name])
    return None


def _vllm_capacity(samples: dict[str, list[Sample]]) -> int | None:
    total = 0
    for labels, _value in samples.get(_VLLM_CACHE_INFO, []):
        try:
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue
    return total or None


def parse_engine_metrics(text: str, dialect: MetricsDialect, model: str) -> EngineMetrics:
    """Contract: the running and waiting gauges of the dialect must be present (else
    MetricsFormatError: a page without them is not this engine's, or the model is not served);
    every other figure is None when its metric is absent."""
    names = DIALECTS.get(dialect)
    if names is None:
        raise MetricsFormatError(f"no metrics dialect {dialect!r}")
    samples = _samples(text, model)
    running, waiting = _sum(samples, names.running), _sum(samples, names.waiting)
    if running is None or waiting is None:
        raise MetricsFormatError(
            f"the page has no {names.running} and {names.waiting} for model {model!r}"
        )
    capacity = _sum(samples, names.kv_capacity)
    return EngineMetrics(
        running_requests=int(running),
        waiting_requests=int(waiting),
        kv_usage=_first_max(samples, names.kv_usage),
        kv_capacity_tokens=int(capacity) if capacity else _vllm_capacity(samples),
        generation_tokens_total=_sum(samples, names.generation_counter),
        generation_tokens_per_s=_sum(samples, names.generation_rate),
    )
