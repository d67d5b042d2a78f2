"""Issue 78's parts of the federation bench, without sites: the capacity from a saturation
phase's records, the grid of seeds and loads, the deployed sizes, what the bench reads of the
gateway and the sites, and the comparison's keys."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench.federation_real.arms import (
    SAMPLED_AT,
    counter_rows,
    learned_step_cost,
    step_overhead_s,
    timeline,
    ttft_split,
)
from bench.federation_real.capacity import capacity_of, saturation_streams
from bench.federation_real.compare import compare
from bench.federation_real.federation import GATEWAY, gateway_env, parse_counters, parse_site
from bench.federation_real.grid import Cell, cell_name, cells, grid_markdown, parse_list
from bench.federation_real.metrics import Served
from bench.federation_real.presets import CPU, CapacityPlan, choose, gpu_sites, parse_layout
from bench.federation_real.sim import serving_costs, site_specs
from bench.serving_path.clients import Sent
from bench.serving_path.http_stream import Answer

EDGES = (10.0, 14.0, 18.0)


def _sent(at: float, answer: Answer, cut: bool = False) -> Sent:
    item = Sent(0, at, answer)
    item.cut = cut
    return item


def _done(first: float, end: float, events: int, tokens: int, marks: dict[int, int]) -> Answer:
    return Answer(200, first, end, events, tokens, "length", True, None, marks)


def test_the_capacity_is_the_tokens_the_windows_delivered_over_the_mean_answer() -> None:
    sent = [
        # Ended in the first window: 4 of its 10 events (40 of 100 tokens) came inside it.
        _sent(5.0, _done(5.5, 12.0, 10, 100, {0: 6})),
        # Sent inside the first window: 5 of 20 events there, 15 in the second (10 + 30 tokens).
        _sent(11.0, _done(11.5, 17.0, 20, 40, {1: 5})),
        # Cut at the stop: its 8 events count at the complete ones' 140 / 30 tokens an event.
        _sent(9.0, Answer(200, 9.5, 18.0, 8, 0, None, False, None, {0: 2, 1: 6}), cut=True),
        _sent(12.0, Answer(503, None, 12.0, 0, 0, None, False, "busy", {})),  # refused
    ]
    plan = CapacityPlan(ramp_s=1.0, settle_s=10.0, window_s=4.0, windows=2)
    capacity = capacity_of(sent, EDGES, mean_answer_tokens=10.0, streams=3, plan=plan, built=9)
    per_event = 140 / 30
    first, second = 40 + 10 + 4 * per_event, 30 + 2 * per_event
    assert capacity.window_tokens_per_s == pytest.approx((first / 4, second / 4))
    assert capacity.tokens_per_s == pytest.approx((first + second) / 8)
    assert capacity.rps == pytest.approx(capacity.tokens_per_s / 10.0)
    assert capacity.finished_rps == pytest.approx(2 / 8)  # one answer ended in each window
    assert capacity.window_finished_rps == pytest.approx((0.25, 0.25))
    assert (capacity.sent, capacity.refused, capacity.cut, capacity.built) == (4, 1, 1, 9)
    assert capacity.to_json()["plan"] == asdict(plan)
    with pytest.raises(ValueError, match="window"):
        capacity_of(sent, EDGES[:1], 10.0, 3, plan, 9)


def test_the_saturation_streams_fill_every_batch_and_stay_within_every_queue_bound() -> None:
    sites = gpu_sites(2)
    streams = saturation_streams(sites, 256)
    assert streams == 256 + 1024 + 384
    # Whichever site routing favours up to its bound, the other still has its slots full...
    assert streams - (1024 + 256) >= 256
    assert streams - (256 + 256) >= 1024
    # ...and no request needs a third queue.
    assert streams <= 256 + 1024 + 2 * 256


def test_the_gpu_preset_runs_the_sites_at_deployed_sizes_and_two_loads() -> None:
    sites = gpu_sites(2)
    assert [(s.shape, s.max_num_seqs, s.max_num_batched_tokens) for s in sites] == [
        ("llama8b", 256, 8192),
        ("llama1b", 1024, 8192),
    ]
    gpu = choose("gpu", 2)
    assert gpu.loads == (0.7, 1.1)
    assert gpu.duration_s >= 25.0
    assert gpu.arms == ("completion_cost", "least_requests", "round_robin")
    # The CPU smoke preset is as it was: a fixed rate, no capacity phase.
    assert CPU.loads == ()
    assert CPU.rate_rps == 3.0
    assert [s.max_num_seqs for s in CPU.sites] == [8, 2]


def test_the_grid_is_every_seed_at_every_load_of_the_measured_capacity() -> None:
    grid = cells((11, 12), parse_list("0.7,1.1", float), 200.0, None)
    assert [(c.seed, c.load, c.label) for c in grid] == [
        (11, 0.7, "s11_x0.7"),
        (11, 1.1, "s11_x1.1"),
        (12, 0.7, "s12_x0.7"),
        (12, 1.1, "s12_x1.1"),
    ]
    assert [round(c.rate_rps, 6) for c in grid] == [140.0, 220.0, 140.0, 220.0]
    # A cell's prompts are marked per arm and cell: two cells of a seed share no cached prefix.
    assert grid[0].marker("round_robin") != grid[1].marker("round_robin")
    assert cell_name("federation_real_h200", grid[3], gridded=True) == (
        "federation_real_h200_s12_x1.1"
    )
    assert cell_name("federation_real_cpu", Cell(0, 3.0), gridded=False) == "federation_real_cpu"
    assert cells((0,), (), None, 3.0) == [Cell(0, 3.0)]
    with pytest.raises(ValueError, match="capacity"):
        cells((0,), (0.7,), 0.0, None)
    with pytest.raises(ValueError, match="rate"):
        cells((0,), (), None, None)
    assert parse_list(None, int) == ()


def test_a_client_s_answer_is_served_by_its_ttft_and_tpot() -> None:
    done = _sent(1.0, _done(1.25, 2.25, 5, 11, {}))
    served = Served.of_sent("q1", done)
    assert served.completed
    assert served.ttft_s == pytest.approx(0.25)
    assert served.tpot_s == pytest.approx(0.1)
    cut = Served.of_sent("q2", _sent(1.0, Answer(200, 1.5, 3.0, 3, 0), cut=True))
    assert not cut.completed
    assert cut.ttft_s == pytest.approx(0.5)
    assert cut.tpot_s is None
    assert Served.of_sent("q3", None) == Served("q3", None, False, None, None, 0)


def test_the_gateway_s_counters_are_read_per_site_and_its_chunk_budget_is_passed_on() -> None:
    text = "\n".join([
        "# TYPE fedllm_gateway_routing_decisions_total counter",
        'fedllm_gateway_routing_decisions_total{policy="round_robin",site="a"} 498.0',
        'fedllm_gateway_routing_decisions_total{policy="round_robin",site="b"} 502.0',
        'fedllm_gateway_routing_decisions_total{policy="round_robin",site="none"} 3.0',
        'fedllm_gateway_routing_decisions_created{policy="round_robin",site="a"} 1.7e9',
        'fedllm_gateway_requests_finished_total{site="a",status="completed"} 253.0',
        'fedllm_gateway_requests_finished_total{site="b",status="completed"} 747.0',
        'fedllm_gateway_offloads_total{giver="a",taker="b"} 245.0',
        'fedllm_gateway_failovers_total{site="a"} 1.0',
    ])  # fmt: skip
    counters = parse_counters(text)
    assert counter_rows(counters, "routing_decisions") == {"a": 498, "b": 502, "none": 3}
    assert counter_rows(counters, "requests_finished") == {"a/completed": 253, "b/completed": 747}
    assert counter_rows(counters, "offloads") == {"a/b": 245}
    assert len(counters) == 6  # the created gauge and the other counters are not read
    assert gateway_env(GATEWAY)["GATEWAY_STREAM_CHUNKS_PER_S"] == "8000.0"


def _arms() -> dict[str, dict[str, Any]]:
    keys = ("goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
    return {
        "cc": dict.fromkeys(keys, 1.0) | {"goodput_rps": 30.0, "by_site": {"a": 2}},
        "rr": dict.fromkeys(keys, 1.0) | {"goodput_rps": 20.0, "by_site": {"a": 1, "b": 1}},
    }


def test_the_comparison_carries_issue_78_s_keys_and_the_sites_counts() -> None:
    real, sim = _arms(), _arms()
    sim["cc"] |= {"goodput_rps": 33.0, "ttft_p50_s": 1.3}
    result = compare(real, sim)
    assert result["goodput_error"] == {"cc": pytest.approx(0.1), "rr": 0.0}
    assert result["ttft_p50_error"] == {"cc": pytest.approx(0.3), "rr": 0.0}
    assert result["same_ranking"] is True
    assert result["by_site"]["rr"]["real"]["by_site"] == {"a": 1, "b": 1}
    table = grid_markdown([result | {"real_run": {"arms": real, "cell": "s1_x1.1"},
                                     "simulated": sim}])  # fmt: skip
    # TTFT p99 ties (1.0 for both arms): both named.
    assert "| s1_x1.1 | cc | cc | cc = rr | cc = rr | yes | no |" in table


def test_the_twin_s_serving_costs_can_follow_the_gateway_cpu_the_run_measured() -> None:
    arm = {"requests": 1000, "chunks": 20_000, "delivered_tokens": 300_000}
    modelled = 1000 * 1e-3 + 20_000 * 50e-6 + 300_000 * 0.2e-6
    record = {"arms": {"cc": arm | {"cpu_s": {"gateway": 3 * modelled}}}}
    costs, scale = serving_costs(record, "measured")
    assert scale == pytest.approx(3.0)
    assert costs is not None
    assert costs.request_s == pytest.approx(3e-3)
    assert serving_costs(record, "none") == (None, 0.0)
    assert serving_costs(record, "bench")[1] == 1.0


def test_the_twin_can_step_with_each_site_s_learned_cost_at_the_cell_s_load() -> None:
    key = "fedllm_site_step_cost_seconds{%s}"
    samples = [{key % "base": b, key % "per_token": 1e-5, key % "per_context_position": 0.0}
               for b in (0.004, 0.006, 0.005)]  # fmt: skip
    learned = learned_step_cost(samples)
    assert learned == {"base": 0.005, "per_token": 1e-5, "per_context_position": 0.0}
    assert learned_step_cost([]) == {}
    sites = [
        {"name": s.name, "shape": s.shape, "one_way_ms": s.one_way_ms, "context": s.context,
         "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
         "kv_blocks_total": 4096, "learned_step_cost_s": learned}
        for s in gpu_sites(2)
    ]  # fmt: skip
    record = {"card": "h200", "sites": sites}
    unused = Path("unused")
    learned_specs = site_specs(record, unused, "learned")
    assert all(math.isclose(s.step.base_s, 0.005) for s in learned_specs)
    fitted = site_specs(record, Path("bench/results/sim/step_models.json"), "fitted")
    assert fitted[0].step.base_s != 0.005
    assert [s.max_num_seqs for s in fitted] == [256, 1024]


def test_the_step_overhead_is_the_busy_time_a_step_beyond_engine_step() -> None:
    """Between two samples: 1,000 steps of 4 ms in engine.step(), 8,000 tokens of which 400
    first tokens, decoded at 1,520 tokens a second of busy time: 5 ms a step busy, 1 ms of it
    outside engine.step()."""

    def sample(steps: float, stepped: float, generated: float, firsts: float) -> dict[str, float]:
        return {
            "fedllm_site_step_seconds_count": steps,
            "fedllm_site_step_seconds_sum": stepped,
            "fedllm_site_generated_tokens_total": generated,
            "fedllm_site_time_to_first_token_seconds_count": firsts,
            "fedllm_site_decode_tokens_per_second": 1520.0,
        }

    samples = [sample(100, 0.4, 800, 40), sample(1100, 4.4, 8800, 440)]
    assert step_overhead_s(samples) == pytest.approx(0.001)
    assert step_overhead_s(samples[:1]) == 0.0
    # A site whose steps account for all its busy time adds nothing (never below 0).
    assert step_overhead_s([samples[0], sample(1100, 9.0, 8800, 440)]) == 0.0


def test_the_timeline_gives_each_interval_its_steps_batch_and_tokens() -> None:
    """Issue 78: per pair of busy samples, the batch then and the steps between."""

    def sample(at: float, steps: float, stepped: float, running: float) -> dict[str, float]:
        return {
            SAMPLED_AT: at,
            "fedllm_site_step_seconds_count": steps,
            "fedllm_site_step_seconds_sum": stepped,
            "fedllm_site_generated_tokens_total": 300 * steps,
            "fedllm_site_running_requests": running,
            "fedllm_site_waiting_requests": 2.0,
        }

    samples = [sample(2.0, 100, 0.5, 300), sample(4.0, 350, 2.5, 900), sample(6.0, 350, 2.5, 1)]
    assert timeline(samples) == [
        {"t_s": 4.0, "running": 900, "waiting": 2.0, "steps": 250, "step_s_mean": 0.008,
         "generated_tokens": 75_000},
        {"t_s": 6.0, "running": 1, "waiting": 2.0, "steps": 0, "step_s_mean": None,
         "generated_tokens": 0},
    ]  # fmt: skip
    assert timeline(samples[:1]) == []


def test_the_first_token_s_wait_is_split_by_where_each_vantage_point_saw_it() -> None:
    """Issue 78: the clients', the gateway's and the site's mean TTFT per site over a cell;
    the site's histogram has a row per priority class, summed."""
    gateway = parse_counters("\n".join([
        "# TYPE fedllm_gateway_ttft_seconds histogram",
        'fedllm_gateway_ttft_seconds_bucket{le="1.0",site="a"} 3.0',
        'fedllm_gateway_ttft_seconds_sum{site="a"} 2.4',
        'fedllm_gateway_ttft_seconds_count{site="a"} 4.0',
    ]))  # fmt: skip
    site = "\n".join([
        'fedllm_site_time_to_first_token_seconds_sum{priority="interactive",site="a"} 1.0',
        'fedllm_site_time_to_first_token_seconds_count{priority="interactive",site="a"} 5.0',
        'fedllm_site_time_to_first_token_seconds_sum{priority="batch",site="a"} 0.5',
        'fedllm_site_time_to_first_token_seconds_count{priority="batch",site="a"} 1.0',
        'fedllm_site_running_requests{site="a"} 3.0',
    ])  # fmt: skip
    after = {"a": parse_site(site)}
    assert after["a"]["fedllm_site_time_to_first_token_seconds_count"] == 6.0
    before = {"a": {"fedllm_site_time_to_first_token_seconds_sum": 0.3,
                    "fedllm_site_time_to_first_token_seconds_count": 2.0}}  # fmt: skip
    served = [Served("q0", "a", True, 1.0, 0.01, 5), Served("q1", "a", True, 2.0, 0.01, 5),
              Served("q2", None, False, None, None, 0)]  # fmt: skip
    assert ttft_split(gateway, before, after, served) == {
        "a": {"client_mean_s": 1.5, "clients": 2.0, "gateway_mean_s": pytest.approx(0.6),
              "gateway_firsts": 4.0, "site_mean_s": pytest.approx(0.3), "site_firsts": 4.0}
    }  # fmt: skip
    # A cell where the site gave no first token: no mean, not a zero.
    assert ttft_split({}, after, after, [])["a"]["site_mean_s"] is None


def test_a_layout_puts_the_named_sites_on_the_gpus_in_order() -> None:
    """`--gpu-sites llama1b@150`: the 1B site alone at its federation's delay, on GPU 0."""
    (alone,) = choose("gpu", None, parse_layout("llama1b@150")).sites
    assert (alone.name, alone.shape, alone.one_way_ms, alone.gpu) == (
        "site0-1b",
        "llama1b",
        150.0,
        0,
    )
    assert alone.max_num_seqs == 1024
    both = gpu_sites(2, parse_layout("llama1b@150, llama8b@5"))
    assert [(s.name, s.shape, s.one_way_ms, s.gpu) for s in both] == [
        ("site0-1b", "llama1b", 150.0, 0),
        ("site1-8b", "llama8b", 5.0, 1),
    ]
    assert gpu_sites(2) == gpu_sites(2, parse_layout("llama8b@5,llama1b@150"))
    for bad in ("", "llama70b@5", "llama1b", "llama1b@-1", "llama1b@far"):
        with pytest.raises(ValueError, match="GPU site"):
            parse_layout(bad)
