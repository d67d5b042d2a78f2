"""The federation bench's parts without sites: the delay proxy on loopback, the workload both
sides replay, the per-arm figures, the comparison, and the simulated replay's sites."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.federation_real.compare import compare, ranking, relative_error
from bench.federation_real.metrics import Served, summary
from bench.federation_real.presets import CPU, gpu_sites
from bench.federation_real.sim import (
    served_step_scale,
    served_token_floor_s,
    simulate,
    site_specs,
)
from bench.federation_real.wan import Route, serve
from bench.federation_real.workload import (
    FIRST_ID,
    MARKER_TOKENS,
    WorkloadSpec,
    build,
    fingerprint,
    marked,
)
from devtools.launch import free_port
from fedsim.federation import Slo

TRACE = Path(__file__).resolve().parent / "federation_real_trace.jsonl"


def _spec(source: str = "sharegpt", **kw: object) -> WorkloadSpec:
    base: dict[str, object] = {
        "source": source, "rate_rps": 5.0, "duration_s": 4.0, "seed": 0, "vocab": 1000,
        "length_scale": 1 / 16, "max_prompt_tokens": 128, "max_answer_tokens": 64,
        "block_tokens": 8,
    }  # fmt: skip
    return WorkloadSpec(**(base | kw))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _echo_behind_delay(one_way_ms: float) -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    listen = free_port()
    proxy = asyncio.create_task(serve([Route("site", listen, target, one_way_ms)]))
    await asyncio.sleep(0.2)
    try:
        yield listen
    finally:
        proxy.cancel()
        server.close()


def test_the_delay_holds_each_direction_for_its_one_way_time_and_keeps_order() -> None:
    async def scenario() -> tuple[float, bytes]:
        async with _echo_behind_delay(60.0) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            began = time.perf_counter()
            for part in (b"a", b"b", b"c"):
                writer.write(part)
                await writer.drain()
            got = b""
            while len(got) < 3:
                got += await reader.read(16)
            elapsed = time.perf_counter() - began
            writer.close()
            return elapsed, got

    elapsed, got = asyncio.run(scenario())
    assert got == b"abc"
    assert elapsed >= 0.12  # there and back: two one-way delays


def test_a_route_must_name_four_fields_and_a_delay_of_zero_or_more() -> None:
    assert Route.parse("s:1:2:7.5") == Route("s", 1, 2, 7.5)
    for bad in ("s:1:2", "s:1:2:-1", "s:x:2:1"):
        with pytest.raises(Exception, match=r"--route|delay"):
            Route.parse(bad)


def test_the_same_spec_builds_the_same_requests_and_another_seed_others() -> None:
    first, again = build(_spec()), build(_spec())
    assert fingerprint(first) == fingerprint(again)
    assert fingerprint(build(_spec(seed=1))) != fingerprint(first)
    assert len(first) == 20  # 5 req/s x 4 s
    assert all(FIRST_ID <= t < 999 for r in first for t in r.prompt_token_ids)
    assert all(len(r.prompt_token_ids) <= 128 - MARKER_TOKENS for r in first)
    assert [r.at_s for r in first] == sorted(r.at_s for r in first)


def test_each_arm_gets_its_own_marker_in_front_of_the_same_prompts() -> None:
    requests = build(_spec())
    a, b = marked(requests, "round_robin", 1000), marked(requests, "completion_cost", 1000)
    assert a[0].prompt_token_ids[MARKER_TOKENS:] == requests[0].prompt_token_ids
    assert a[0].prompt_token_ids[:MARKER_TOKENS] != b[0].prompt_token_ids[:MARKER_TOKENS]
    assert a[3].prompt_token_ids[:MARKER_TOKENS] == a[0].prompt_token_ids[:MARKER_TOKENS]


def test_a_trace_shares_token_ids_where_it_shares_blocks_and_keeps_its_arrival_shape() -> None:
    requests = build(_spec(str(TRACE), rate_rps=1.0, length_scale=1 / 64, block_tokens=8))
    assert len(requests) == 4
    # Lines 1 and 2 of the trace share their first block (hash id 7): the same 8 ids.
    assert requests[0].prompt_token_ids[:8] == requests[1].prompt_token_ids[:8]
    assert requests[0].prompt_token_ids[:8] != requests[2].prompt_token_ids[:8]
    assert requests[0].at_s == 0.0
    assert requests[-1].at_s == pytest.approx(4.0)


def test_a_missing_trace_or_rate_is_refused() -> None:
    with pytest.raises(FileNotFoundError):
        build(_spec("/nonexistent/trace.jsonl"))
    with pytest.raises(ValueError, match="rate"):
        build(_spec(rate_rps=0.0))


def test_goodput_counts_requests_within_both_bounds_over_the_window() -> None:
    slo = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
    served = [
        Served("a", "s1", True, 0.5, 0.05, 10),
        Served("b", "s1", True, 1.5, 0.05, 10),  # TTFT over
        Served("c", "s2", True, 0.5, 0.2, 10),  # TPOT over
        Served("d", "s2", True, 0.2, None, 1),  # one token: TPOT does not apply
        Served("e", None, False, None, None, 0),  # never answered
    ]
    figures = summary(served, slo, 2.0, {"s1": 100, "s2": 100}, {"s1": 50, "s2": 0})
    assert figures["goodput_rps"] == 1.0  # a and d, over 2 s
    assert figures["slo_attainment"] == 0.4
    assert figures["completed"] == 4
    assert figures["ttft_p50_s"] == 0.5
    assert figures["prefix_hit_share"] == 0.25
    assert figures["by_site"] == {"s1": 2, "s2": 2}
    assert figures["slo_p99_met"] is False


def test_errors_goals_and_ranking() -> None:
    assert relative_error(10.0, 11.5) == pytest.approx(0.15)
    assert relative_error(0.0, 0.0) == 0.0
    assert relative_error(0.0, 1.0) is None
    assert relative_error(1.0, math.inf) is None
    keys = ("goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
    real = {"cc": dict.fromkeys(keys, 1.0) | {"goodput_rps": 30.0},
            "rr": dict.fromkeys(keys, 1.0) | {"goodput_rps": 20.0}}  # fmt: skip
    sim = {"cc": dict.fromkeys(keys, 1.2) | {"goodput_rps": 33.0},
           "rr": dict.fromkeys(keys, 1.5) | {"goodput_rps": 25.0}}  # fmt: skip
    result = compare(real, sim)
    assert result["goals"]["met"]["cc"] == {"goodput_rps": True, "ttft_p50_s": True}
    assert result["goals"]["met"]["rr"] == {"goodput_rps": False, "ttft_p50_s": False}
    assert result["all_goals_met"] is False
    assert result["ranking_by_goodput"]["rank_agrees"] is True
    flipped = ranking({"cc": 30.0, "rr": 20.0}, {"cc": 20.0, "rr": 30.0})
    assert flipped["rank_agrees"] is False
    assert flipped["rank_contradicted"] is True
    tied = ranking({"cc": 30.0, "rr": 29.9}, {"cc": 30.0, "rr": 20.0})
    assert tied["rank_agrees"] is False
    assert tied["rank_contradicted"] is False


def _record(card: str, spec: WorkloadSpec, arms: tuple[str, ...]) -> dict[str, object]:
    requests = build(spec)
    sites = gpu_sites(2) if card != "cpu" else CPU.sites
    return {
        "card": card,
        "sites": [
            {
                "name": s.name,
                "shape": s.shape,
                "one_way_ms": s.one_way_ms,
                "max_num_seqs": s.max_num_seqs,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "context": s.context,
                "kv_blocks_total": 4096,
                "step_cost_s": {"base": 0.002, "per_token": 1e-4, "per_context_position": 0.0},
            }
            for s in sites
        ],
        "slo": {"ttft_p99_s": 2.0, "tpot_p99_s": 0.1},
        "drain_s": 30.0,
        "workload_spec": spec.to_json(),
        "workload": {"fingerprint": fingerprint(requests)},
        "arms": {arm: {} for arm in arms},
    }


def test_the_simulated_sites_are_the_real_ones() -> None:
    record = _record("h100", _spec(), ("round_robin",))
    specs = site_specs(record, Path("bench/results/sim/step_models.json"))
    assert [s.name for s in specs] == ["site0-8b", "site1-1b"]
    assert [s.rtt_s for s in specs] == [0.01, 0.3]  # twice the one-way delay
    assert [s.num_blocks for s in specs] == [4096, 4096]  # the real sites' blocks
    assert [s.model.name for s in specs] == ["llama8b", "llama1b"]
    assert all(s.async_scheduling for s in specs)
    cpu = site_specs(_record("cpu", _spec(), ("round_robin",)), Path("unused"))
    assert cpu[0].step.base_s == 0.002
    assert not cpu[0].async_scheduling


def test_a_learned_step_source_takes_each_arm_s_own_cost_first() -> None:
    """On a shared CPU one arm's steps are not another's: the arm's learned cost, else the
    cell's."""
    record = _record("cpu", _spec(), ("round_robin", "completion_cost"))
    own = {"base": 0.005, "per_token": 2e-4, "per_context_position": 1e-6}
    site_a: dict[str, object] = {"learned_step_cost_s": own}
    arm = {"sites": {"site-a": site_a, "site-b": {"steps": 3}}}
    specs = site_specs(record, Path("unused"), "learned", arm=arm)
    assert (specs[0].step.base_s, specs[0].step.per_decode_row_s) == (0.005, 2e-4)
    assert specs[0].step.per_kv_token_s == 1e-6
    assert specs[1].step.base_s == 0.002  # no cost of the arm's: the cell's
    assert site_specs(record, Path("unused"), "learned")[0].step.base_s == 0.002
    # The service's loop's time outside engine.step() goes on every step.
    site_a["step_overhead_s"] = 0.001
    assert site_specs(record, Path("unused"), "learned", arm=arm)[0].step.base_s == 0.006


def test_the_replay_runs_every_arm_on_the_same_requests_and_refuses_other_ones() -> None:
    record = _record(
        "h100", _spec(vocab=50257, length_scale=0.25), ("round_robin", "completion_cost")
    )
    out, info = simulate(record)
    assert info["serving"] == "bench"
    assert info["step_source"] == "fitted"
    assert set(out) == {"round_robin", "completion_cost"}
    assert out["round_robin"]["requests"] == out["completion_cost"]["requests"] == 20
    # Round robin alternates over the two sites; the replay really routed.
    assert out["round_robin"]["by_site"] == {"site0-8b": 10, "site1-1b": 10}
    record["workload"] = {"fingerprint": "0" * 16}
    with pytest.raises(ValueError, match="fingerprint"):
        simulate(record)


def test_a_trace_run_takes_whole_conversations_so_their_prefixes_repeat(tmp_path: Path) -> None:
    lines = []
    for i in range(40):  # 8 conversations of 5 turns, interleaved with each other
        conversation, turn = i % 8, i // 8
        ids = [100 + conversation] + [1000 + 10 * conversation + t for t in range(turn + 1)]
        record = {"timestamp": 100 * i, "input_length": 512 * len(ids), "output_length": 20}
        lines.append(json.dumps(record | {"hash_ids": ids}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    requests = build(_spec(str(trace), rate_rps=2.5, length_scale=1 / 64, block_tokens=8))
    firsts = [r.prompt_token_ids[:8] for r in requests]
    # 10 wanted: two whole conversations of five turns, each opening with its own block.
    assert len(requests) == 10
    assert sorted(firsts.count(f) for f in set(firsts)) == [5, 5]


def _serving_run(path: Path, refused_low: int, kept_up: bool = False) -> None:
    rows = {"160": (0.00575, 44_411.0), "256": (0.0167, 51_298.0)}
    path.write_text(
        json.dumps(
            {
                "path": {
                    rate: {"tpot_p50_s": tpot, "output_tokens_per_s": tokens}
                    for rate, (tpot, tokens) in rows.items()
                },
                "engine": {"160": {"tpot_p50_s": 0.005}, "256": {"tpot_p50_s": 0.0145}},
                "refused": {"160": refused_low, "256": 920},
                "cut": {"160": 0, "256": 0},
                "path_vs_engine_tokens": {"160": 0.989, "256": 0.98 if kept_up else 0.863},
            }
        )
    )


def test_a_served_site_s_token_floor_is_its_path_s_tokens_where_it_fell_behind(
    tmp_path: Path,
) -> None:
    _serving_run(tmp_path / "serving_path_gpu_h200.json", refused_low=0)
    floor, source = served_token_floor_s("h200", tmp_path)
    assert floor == pytest.approx(1 / 51_298.0)
    assert source == "serving_path_gpu_h200.json at 256 req/s"
    assert served_token_floor_s("h100", tmp_path) == (0.0, "")  # no run on that card
    _serving_run(tmp_path / "serving_path_gpu_h200.json", refused_low=0, kept_up=True)
    assert served_token_floor_s("h200", tmp_path) == (0.0, "")  # its path kept up: no floor
    record = _record("h100", _spec(), ("round_robin",))
    specs = site_specs(record, Path("bench/results/sim/step_models.json"), token_floor_s=2e-5)
    assert [s.token_floor_s for s in specs] == [2e-5, 2e-5]


def test_a_served_site_s_steps_are_the_serving_path_bench_s_path_over_its_engine(
    tmp_path: Path,
) -> None:
    _serving_run(tmp_path / "serving_path_gpu_h200.json", refused_low=0)
    scale, source = served_step_scale("h200", tmp_path)
    assert scale == pytest.approx(1.15)  # the lowest rate with nothing refused or cut
    assert source == "serving_path_gpu_h200.json at 160 req/s"
    assert served_step_scale("h100", tmp_path) == (1.0, "")  # no run on that card
    _serving_run(tmp_path / "serving_path_gpu_h200.json", refused_low=3)
    assert served_step_scale("h200", tmp_path) == (1.0, "")  # every rate refused some
    record = _record("h100", _spec(), ("round_robin",))
    specs = site_specs(record, Path("bench/results/sim/step_models.json"), step_scale=1.2)
    assert [s.step_scale for s in specs] == [1.2, 1.2]
