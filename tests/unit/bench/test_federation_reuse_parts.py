"""Parts of the prefix-reuse benchmark (bench/federation): prompts that survive text, the trace
and shared-prefix workloads, each arm's own marker, the knee's next rate, the hit rates."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench.federation.hit_rate import measured_hit_rate, prefix_counters, simulated_hit_rate
from bench.federation.knee import next_rate
from bench.federation.metrics import RunSummary
from bench.federation.prefix_workloads import (
    MARKER_TOKENS,
    Shape,
    for_run,
    read_trace,
    reusable_share,
    shared_prefix_requests,
    trace_requests,
)
from bench.federation.text_tokens import WordTokens
from bench.federation.workload import Request
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineStats
from site_engine.metrics import EngineStatsCollector
from tests.conftest import SHARED


@pytest.fixture(scope="module")
def words() -> WordTokens:
    tokenizer = load_tokenizer(SHARED / "tokenizers" / "gpt2")
    return WordTokens.of(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        tokenizer.decode,
        len(tokenizer),
    )


def test_word_tokens_survive_text(words: WordTokens) -> None:
    import random

    ids = words.draw(random.Random(3), 500)
    assert tuple(words.encode_text(words.text(ids))) == ids


def trace_file(tmp_path: Path) -> Path:
    """Two conversations (first blocks 1 and 7) and a stranger, over 10 s of trace time."""
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 40, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 700, "output_length": 8, "hash_ids": [7, 8]},
        {"timestamp": 5000, "input_length": 1536, "output_length": 40, "hash_ids": [1, 2, 3]},
        {"timestamp": 10000, "input_length": 512, "output_length": 4, "hash_ids": [9]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


SHAPE = Shape(block_tokens=16, max_prompt_tokens=40, max_answer_tokens=20, answer_scale=0.5,
              system_tokens=32)  # fmt: skip


def test_trace_requests_keep_the_traces_blocks_and_compress_its_time(
    tmp_path: Path, words: WordTokens
) -> None:
    records = read_trace(trace_file(tmp_path))
    requests = trace_requests(records, words, rate_rps=10.0, duration_s=1.0, seed=0, shape=SHAPE)
    assert len(requests) == 4  # whole conversations until 10 x 1 requests: all of them
    assert [r.at_s for r in requests] == [0.0, 0.2, 0.5, 1.0]  # 10 s of trace in 1 s
    first, second, third, fourth = (r.prompt_token_ids for r in requests)
    # 1,024 / 512 x 16 = 32 tokens; the third (48) is cut at the cap less the marker (36)
    assert (len(first), len(second), len(third), len(fourth)) == (32, 22, 36, 16)
    assert third[:32] == first  # blocks 1 and 2 again: the same tokens
    assert second[:16] != first[:16]
    assert [r.answer_tokens for r in requests] == [20, 4, 20, 2]
    assert all(tuple(words.encode_text(r.prompt_text or "")) == r.prompt_token_ids
               for r in requests)  # fmt: skip
    assert reusable_share(requests, 16) == pytest.approx(32 / (32 + 22 + 36 + 16))


def test_a_lower_rate_takes_fewer_whole_conversations(tmp_path: Path, words: WordTokens) -> None:
    records = read_trace(trace_file(tmp_path))
    few = trace_requests(records, words, rate_rps=1.0, duration_s=1.0, seed=0, shape=SHAPE)
    assert 1 <= len(few) < 4
    firsts = {r.prompt_token_ids[:16] for r in few}
    assert len(few) in (1, 2) or len(firsts) < len(few)  # a conversation comes whole


def test_shared_prefix_turns_resend_the_first_turn_behind_one_system_prompt(
    words: WordTokens,
) -> None:
    questions = [("What is a cat?", "And a dog?"), ("Name a river.", "A longer one?")]
    shape = Shape(16, 200, 10, 1.0, 32)
    requests = shared_prefix_requests(questions, [5, 9], words, 4.0, 3.0, 0, shape)
    assert len(requests) >= 2
    by_session: dict[str | None, list[Request]] = {}
    for request in requests:
        by_session.setdefault(request.session, []).append(request)
    system = requests[0].prompt_token_ids[:32]
    for turns in by_session.values():
        one, two = sorted(turns, key=lambda r: r.source)
        assert (one.source, two.source) == ("mt_bench_turn1", "mt_bench_turn2")
        assert two.prompt_token_ids[: len(one.prompt_token_ids)] == one.prompt_token_ids
        assert one.prompt_token_ids[:32] == system
        assert one.at_s < two.at_s
        assert tuple(words.encode_text(two.prompt_text or "")) == two.prompt_token_ids


def test_each_arm_runs_the_same_requests_behind_its_own_marker(words: WordTokens) -> None:
    base = [Request("r1", "x", (5, 6), 3, 0.5, prompt_text=None, session="s")]
    a, b = for_run(base, words, "a-1"), for_run(base, words, "b-1")
    assert a[0].prompt_token_ids[MARKER_TOKENS:] == b[0].prompt_token_ids[MARKER_TOKENS:] == (5, 6)
    assert a[0].prompt_token_ids[:MARKER_TOKENS] != b[0].prompt_token_ids[:MARKER_TOKENS]
    assert (a[0].id, a[0].session, a[0].at_s, a[0].answer_tokens) == ("a-1-r1", "a-1-s", 0.5, 3)


def run(rate: float, holds: bool) -> RunSummary:
    return RunSummary("arm", rate, 1.0, 1, 1, 0.1, 0.1, 2.5 if not holds else 0.1, 0.1, 0.1,
                      0.01, 0.01, 1.0, 1.0, {}, {})  # fmt: skip


@pytest.mark.parametrize(
    ("runs", "rate"),
    [
        ([], None),
        ([run(4, True), run(8, False)], 6.0),
        ([run(4, True), run(6, True), run(8, False)], 7.0),
        ([run(4, False)], 2.0),
        ([run(4, True), run(8, True)], 12.0),  # never missed: 1.5x past
        ([run(4, True), run(6, False), run(8, True)], 5.0),  # held above a miss: noise
        ([run(4, True), run(4.01, False)], None),  # the midpoint was run
    ],
)
def test_the_knee_is_bisected(runs, rate) -> None:
    assert next_rate(runs) == rate


METRICS = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{site="a"} 1000.0
vllm:prefix_cache_hits_total{site="a"} 250.0
fedllm_site_running_requests{site="a"} 0.0
"""


def test_prefix_counters_and_measured_hit_rate() -> None:
    assert prefix_counters(METRICS) == (1000.0, 250.0)
    both = METRICS + 'fedllm_site_prefix_cache_queries_tokens_total{site="a"} 1000.0\n'
    assert prefix_counters(both) == (1000.0, 250.0)  # one count, not two
    assert prefix_counters("fedllm_site_running_requests 1\n") is None
    rates = measured_hit_rate({"a": (1000.0, 250.0), "b": None}, {"a": (3000.0, 1250.0), "b": None})
    assert rates == {"a": 0.5, "b": None}


def test_simulated_hit_rate_counts_runs_from_the_first_block() -> None:
    prompt = tuple(range(64))

    def at(t: float, ids: tuple[int, ...]) -> Request:
        return Request(f"r{t}", "x", ids, 1, t)

    served = [("a", at(0, prompt)), ("a", at(1, prompt)), ("b", at(2, prompt)),
              ("a", at(3, (99, *prompt[1:])))]  # fmt: skip
    rates = simulated_hit_rate(served, {"a": 1000, "b": 1000})
    assert rates["a"] == pytest.approx(64 / (3 * 64), abs=1e-4)  # 2nd hits whole, 4th not
    assert rates["b"] == 0.0
    small = simulated_hit_rate(served[:2], {"a": 32})  # 2 blocks fit: the first 2 of 4 stay
    assert small["a"] == pytest.approx(32 / 128, abs=1e-4)


def test_prefix_counters_read_our_sites_metrics_port() -> None:
    """What the benchmark scrapes: a site's own exposition (it reported "n/a" on the H100 run,
    when the parser knew only vLLM's spelling)."""
    source = SimpleNamespace(
        stats=lambda: EngineStats(0, 0, 0, 0, 0, 0, 10, 3, prefix_cache_queries=900,
                                  prefix_cache_hits=600, prefix_cache_host_hits=100),
        decode_tokens_per_s=lambda: 0.0,
        prefill_tokens_per_s=lambda: 0.0,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("a", source))
    assert prefix_counters(generate_latest(registry).decode()) == (900.0, 600.0)


def test_the_bench_profiles_load_from_a_federation_file(tmp_path: Path) -> None:
    from bench.federation.cluster import ARMS, BENCH_PROFILES, profile_entry
    from gateway.federation import load_federation

    document = {
        "models": [{"name": "m", "tokenizer": str(SHARED / "tokenizers" / "gpt2")}],
        "sites": [
            {
                "name": "a",
                "cloud": "aws",
                "region": "us-east-1",
                "endpoint": "127.0.0.1:1",
                "model": "m",
            }
        ],
        "routing_profiles": [profile_entry(p) for p in BENCH_PROFILES],
    }
    path = tmp_path / "federation.json"
    path.write_text(json.dumps(document))
    loaded = {p.name: p for p in load_federation(path).routing_profiles}
    assert (
        set(loaded)
        == {p.name for p in BENCH_PROFILES}
        == {"completion_cost_own", "completion_cost_balanced", "completion_cost_queues"}
    )
    assert "slot_room" not in [f.name for f in loaded["completion_cost_queues"].filters]
    own = loaded["completion_cost_own"]
    assert ARMS["completion_cost_own"].policy == "completion_cost_own"
    assert [s.param_map for s in own.scorers if s.name == "completion_cost"] == [
        {"others_weight": 0.0}
    ]
