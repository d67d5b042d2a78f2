"""parse_engine_metrics against the metric names and shapes the engines document."""

from __future__ import annotations

import pytest

from gateway.sites.engine_metrics import MetricsFormatError, parse_engine_metrics

# vLLM before v0.10 (docs v0.5-v0.9): the KV fraction was vllm:gpu_cache_usage_perc.
OLD_VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 2.0
vllm:num_requests_running{model_name="other"} 9.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.5
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="llama"} 1234.0
"""
TGI = """# TYPE tgi_queue_size gauge
tgi_queue_size 4
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 7
# TYPE tgi_request_generated_tokens histogram
tgi_request_generated_tokens_bucket{le="+Inf"} 3
tgi_request_generated_tokens_sum 300
tgi_request_generated_tokens_count 3
"""
SGLANG_TWO_RANKS = """sglang:num_running_reqs{model_name="q",dp_rank="0"} 2
sglang:num_running_reqs{model_name="q",dp_rank="1"} 3
sglang:num_queue_reqs{model_name="q",dp_rank="0"} 1
sglang:num_queue_reqs{model_name="q",dp_rank="1"} 0
sglang:token_usage{model_name="q",dp_rank="0"} 0.2
sglang:token_usage{model_name="q",dp_rank="1"} 0.6
"""


def test_older_vllm_names_and_other_models_left_out() -> None:
    m = parse_engine_metrics(OLD_VLLM, "vllm", "llama")
    assert (m.running_requests, m.waiting_requests, m.kv_usage) == (2, 1, 0.5)
    assert m.generation_tokens_total == 1234.0
    assert m.kv_capacity_tokens is None  # no cache_config_info on the page


def test_tgi_has_queue_and_batch_but_no_kv() -> None:
    m = parse_engine_metrics(TGI, "tgi", "anything")
    assert (m.running_requests, m.waiting_requests) == (7, 4)
    assert m.kv_usage is None
    assert m.generation_tokens_total == 300


def test_ranks_are_summed_and_the_fullest_kv_counts() -> None:
    m = parse_engine_metrics(SGLANG_TWO_RANKS, "sglang", "q")
    assert (m.running_requests, m.waiting_requests, m.kv_usage) == (5, 1, 0.6)


@pytest.mark.parametrize(
    ("text", "dialect", "model", "message"),
    [
        (OLD_VLLM, "sglang", "llama", "no sglang:num_running_reqs"),
        (OLD_VLLM, "vllm", "not-served", "for model 'not-served'"),
        ("<html>not metrics</html>", "vllm", "llama", "not Prometheus text|no vllm"),
        (OLD_VLLM, "none", "llama", "no metrics dialect"),
    ],
)
def test_a_page_without_the_dialects_gauges_is_refused(text, dialect, model, message) -> None:
    with pytest.raises(MetricsFormatError, match=message):
        parse_engine_metrics(text, dialect, model)
