"""The federation benchmark's parts: the latency injector (delay, jitter, order), the open-loop
workload, the metrics and goodput, and the Prometheus reading."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time

import pytest

from bench.federation.loadgen import CUT_OFF, Outcome, RunOutcomes
from bench.federation.metrics import goodput_rps, summarize, tokens_per_capacity
from bench.federation.report import derive_sweep, with_headline
from bench.federation.runs import prometheus_sums
from bench.federation.topology import PRESETS
from bench.federation.wan import Delay, Route, serve
from bench.federation.workload import Pools, Request, arrivals, scaled, synthetic_length
from devtools.launch import free_port


def test_delay_line_never_lets_a_chunk_overtake_the_one_before() -> None:
    delay = Delay(one_way_s=0.02, jitter_s=0.05, rng=random.Random(1))
    dues = [delay.due(now=i * 0.001) for i in range(200)]
    assert dues == sorted(dues)
    assert all(due >= i * 0.001 + 0.02 for i, due in enumerate(dues))


@pytest.mark.parametrize(
    ("text", "route"),
    [
        ("s1:1000:2000:80:8", Route("s1", 1000, 2000, 80.0, 8.0)),
        ("a:1:2:0:0", Route("a", 1, 2, 0.0, 0.0)),
    ],
)
def test_route_parses(text, route) -> None:
    assert Route.parse(text) == route
    assert Route.parse(route.spec()) == route


@pytest.mark.parametrize("text", ["s1:1000:2000:80", "s1:x:2000:80:8", "s1:1:2:-5:0"])
def test_route_refuses_bad_specs(text) -> None:
    with pytest.raises(Exception, match=r"route|delays"):
        Route.parse(text)


def test_injector_adds_the_round_trip_and_keeps_bytes_in_order() -> None:
    async def scenario() -> tuple[float, bytes]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
            writer.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        target_port = target.sockets[0].getsockname()[1]
        listen = free_port()
        proxy = asyncio.create_task(serve([Route("s", listen, target_port, 100.0, 20.0)]))
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        started = time.perf_counter()
        payload = b"".join(i.to_bytes(2, "big") for i in range(2000))
        for i in range(0, len(payload), 100):
            writer.write(payload[i : i + 100])
            await writer.drain()
        got = await reader.readexactly(len(payload))
        elapsed = time.perf_counter() - started
        writer.close()
        proxy.cancel()
        target.close()
        return elapsed, got

    elapsed, got = asyncio.run(scenario())
    assert got == b"".join(i.to_bytes(2, "big") for i in range(2000))
    assert elapsed >= 0.1  # one round trip at least, jitter only adds


POOLS = Pools(dolly=(((1, 2, 3), 400), ((4, 5), 40)), answers=(400, 40), vocab=100)


def test_arrivals_are_poisson_deterministic_and_alternate_sources() -> None:
    def draw(seed: int) -> list[Request]:
        return arrivals(
            POOLS, 20.0, 30.0, seed, answer_scale=0.5, max_prompt_tokens=64, max_answer_tokens=150
        )

    first = draw(3)
    assert first == draw(3)
    assert first != draw(4)
    assert 480 < len(first) < 720  # 600 expected
    assert all(a.at_s < b.at_s for a, b in itertools.pairwise(first))
    assert {r.source for r in first[::2]} == {"dolly_context"}
    assert {r.source for r in first[1::2]} == {"synthetic_lognormal"}
    assert {r.answer_tokens for r in first} <= {150, 20}  # 400 * 0.5 capped at 150, 40 * 0.5
    assert max(len(r.prompt_token_ids) for r in first) <= 64


def test_synthetic_prompt_lengths_have_the_mix_median_and_tail() -> None:
    rng = random.Random(0)
    lengths = sorted(synthetic_length(rng, 100_000) for _ in range(20_000))
    assert 230 < lengths[10_000] < 270
    assert 2500 < lengths[19_800] < 3500
    assert scaled(400, 0.125, 256) == 50
    assert scaled(1, 0.1, 10) == 1


def _outcome(i: int, ttft: float | None, e2e: float | None, tokens: int, site: str) -> Outcome:
    ok = e2e is not None
    return Outcome(f"r{i}", "x", 10, tokens, 0.0, 200 if ok else 0, site, ttft, e2e, tokens)


def test_summary_counts_a_missing_answer_as_slower_than_any() -> None:
    outcomes = [_outcome(i, 0.1, 1.0, 11, "a") for i in range(98)]
    outcomes += [_outcome(98, None, None, 0, "b"), _outcome(99, None, None, 0, "b")]
    run = summarize("arm", 5.0, 20.0, RunOutcomes(tuple(outcomes), 21.0))
    assert (run.requests, run.completed) == (100, 98)
    assert run.ttft_p50_s == pytest.approx(0.1)
    assert math.isinf(run.ttft_p99_s)
    assert not run.holds_slo
    assert run.tpot_p50_s == pytest.approx(0.09)
    assert run.slo_attained_rps == pytest.approx(98 / 20)
    assert run.requests_per_site == {"a": 98}
    assert run.tokens_per_site == {"a": 98 * 21}
    assert run.to_json()["ttft_s"]["p99"] is None
    one = (*outcomes[:98], _outcome(98, 0.1, 1.0, 11, "a"), outcomes[99])
    one_miss = summarize("arm", 5.0, 20.0, RunOutcomes(one, 21.0))
    assert one_miss.ttft_p99_s == pytest.approx(0.1)  # nearest rank: 1 in 100 is above p99
    assert not one_miss.holds_slo  # but every request must be answered


def test_summary_lists_the_latest_first_tokens_none_first() -> None:
    outcomes = [_outcome(i, 0.1 * (i + 1), 5.0, 11, "a") for i in range(10)]
    outcomes.append(_outcome(10, None, None, 0, "b"))
    run = summarize("arm", 1.0, 10.0, RunOutcomes(tuple(outcomes), 12.0))
    assert [row["id"] for row in run.slowest] == ["r10", "r9", "r8", "r7", "r6"]
    assert run.slowest[0]["ttft_s"] is None
    assert run.slowest[0]["site"] == "b"
    assert run.slowest[1]["ttft_s"] == pytest.approx(1.0)
    assert run.slowest[1]["ended"] == "ok"
    assert run.to_json()["slowest_first_tokens"][1]["id"] == "r9"


@pytest.mark.parametrize(
    ("points", "goodput"),
    [
        ([(1, True), (2, True), (4, False), (8, False)], 2),
        ([(4, False), (1, True), (2, True)], 2),  # order does not matter
        ([(1, True), (2, False), (4, True)], 1),  # holding above a miss is noise
        ([(1, False)], 0.0),
        ([], 0.0),
    ],
)
def test_goodput_is_the_highest_rate_holding_the_slo_from_below(points, goodput) -> None:
    assert goodput_rps(points) == goodput


def test_a_run_holds_the_slo_only_within_both_bounds() -> None:
    def run(ttft: float, tpot: float) -> bool:
        outcome = _outcome(0, ttft, ttft + 10 * tpot, 11, "a")
        return summarize("arm", 1.0, 10.0, RunOutcomes((outcome,), 10.0)).holds_slo

    assert run(0.5, 0.05)
    assert run(1.9, 0.09)
    assert not run(2.5, 0.05)
    assert not run(0.5, 0.2)


def _cut(ttft: float | None, open_s: float, events: int) -> Outcome:
    # Cut off at the drain's end: HTTP 200 if the stream had begun, no usage event yet.
    return Outcome("cut", "x", 10, 1024, 0.0, 200, "a", ttft, None, 0, CUT_OFF, events, open_s)


@pytest.mark.parametrize(
    ("cut", "holds", "tpot"),
    [
        # streaming at 17 ms a token when the drain ended: it met the SLO so far
        (_cut(0.2, 10.2, 589), True, 10.0 / 588),
        # streaming, but 300 ms a token: a TPOT miss
        (_cut(0.2, 10.2, 34), False, 10.0 / 33),
        # one event, then nothing until the cut: the whole wait is its TPOT
        (_cut(0.2, 10.2, 1), False, 10.0),
        # never got a first token: misses both
        (_cut(None, 10.2, 0), False, None),
    ],
)
def test_a_request_cut_off_while_streaming_is_judged_on_what_it_streamed(cut, holds, tpot) -> None:
    done = [_outcome(i, 0.1, 1.0, 11, "a") for i in range(49)]  # p99 of 50 is the worst
    run = summarize("arm", 1.0, 10.0, RunOutcomes((*done, cut), 12.0))
    assert cut.tpot_s == (None if tpot is None else pytest.approx(tpot))
    assert run.holds_slo is holds
    assert run.completed == 49
    assert run.cut_off_streaming == (1 if cut.ttft_s is not None else 0)
    assert math.isinf(run.e2e_p99_s) or run.e2e_p99_s == pytest.approx(1.0)
    assert run.slo_attained_rps == pytest.approx((49 + holds) / 10.0)


def test_a_failed_request_is_not_judged_on_its_stream() -> None:
    failed = Outcome("f", "x", 10, 100, 0.0, 200, "a", 0.2, None, 0, "site failed", 50, 3.0)
    assert not failed.cut_off_streaming
    assert failed.tpot_s is None
    run = summarize("arm", 1.0, 10.0, RunOutcomes((failed,), 3.0))
    assert not run.holds_slo


def test_tokens_per_capacity_is_a_share_of_the_mean() -> None:
    outcomes = [_outcome(0, 0.1, 1, 90, "big"), _outcome(1, 0.1, 1, 40, "small")]
    run = summarize("arm", 1.0, 1.0, RunOutcomes(tuple(outcomes), 1.0))
    # big: 100 tokens / weight 2 = 50, small: 50 / 1 = 50: each got its share
    shares = tokens_per_capacity([run.tokens_per_site], {"big": 2.0, "small": 1.0})
    assert shares == {"big": 1.0, "small": 1.0}


def test_prometheus_sums_add_labelled_samples() -> None:
    text = (
        "# HELP fedllm_site_running_requests x\n"
        'fedllm_site_running_requests{site="a"} 3.0\n'
        'fedllm_gateway_offloads_total{giver="a",taker="b"} 2.0\n'
        'fedllm_gateway_offloads_total{giver="b",taker="a"} 1.0\n'
        "fedllm_site_waiting_requests NaN\n"
    )
    assert prometheus_sums(text) == {
        "fedllm_site_running_requests": 3.0,
        "fedllm_gateway_offloads_total": 3.0,
    }


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_unequal_on_purpose(name) -> None:
    preset = PRESETS[name]
    sites = preset.sites
    assert len({s.max_num_seqs for s in sites}) > 1
    assert len({s.kv_cache_mib for s in sites}) > 1
    assert len({s.shape for s in sites}) == 2
    assert {s.rtt_ms for s in sites} == {5.0, 40.0, 80.0, 150.0}
    weights = preset.capacity_weights(49152)
    slow = next(s for s in sites if s.shape != sites[0].shape)
    assert weights[slow.name] < slow.max_num_seqs  # a slower model weighs less than its slots


def test_the_result_carries_the_goodput_ratios_at_its_top_level() -> None:
    run = {"rate_rps": 12.0, "holds_slo": True, "slo_attained_rps": 11.0, "tokens_per_site": {}}
    late = {**run, "rate_rps": 24.0}
    sweep = derive_sweep({"least_requests": [run], "mico": [run, late]}, {})
    stored = with_headline({"sweep": sweep})
    assert stored["goodput_vs_least_requests"] == {"least_requests": 1.0, "mico": 2.0}
    assert with_headline({"scenarios": {}}) == {"scenarios": {}}
