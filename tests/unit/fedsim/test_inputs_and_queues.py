"""The simulator's inputs and queues (issue 68): any trace file; a trace that runs out of
distinct requests is an error, not a replay; the served predictor itself where prompts have
text, its stand-in (and saying so) where not; the product's routing default; the gateway's
queue and the sites' SPF order, with the most overtaken request measured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fedsim.federation import run
from fedsim.gateway import GatewaySettings
from fedsim.queue_report import summary
from fedsim.traces import TraceError, read_trace
from fedsim.workload import SimRequest, WorkloadSpec, build, prediction_kind
from gateway.routing.hold_order import HoldOrder
from gateway.settings import RoutingSettings
from predictor.baseline import SklearnConfig
from predictor.runtime import LengthPredictor
from predictor.training import TrainingSet, TrainSpec, train_artifact
from tests.unit.fedsim.test_fedsim import _spec
from tests.unit.predictor.conftest import synthetic_records


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n: int, text: bool = False) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(n):
        row: dict[str, object] = {"timestamp": 100 * i, "input_length": 20 + i,
                                  "output_length": 5 + i % 7, "hash_ids": [i]}  # fmt: skip
        if text:
            long = i % 3 == 0
            row["prompt"] = ("Write a long essay about" if long else "Spell") + f" item {i}."
        out.append(row)
    return out


def test_a_trace_file_of_either_format_is_read_and_a_bad_row_named(tmp_path: Path) -> None:
    rows = read_trace(_jsonl(tmp_path / "t.jsonl", _rows(3)))
    assert [(r.prompt, r.answer, r.at_s, r.hash_ids) for r in rows] == [
        (20, 5, 0.0, (0,)), (21, 6, 0.1, (1,)), (22, 7, 0.2, (2,))]  # fmt: skip
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,374,44\n"
                   "2023-11-16 18:15:47.5,10,0\n")  # fmt: skip
    assert [(r.prompt, r.answer, r.at_s) for r in read_trace(csv)] == [(374, 44, 0.0), (10, 1, 1.5)]
    bad = _jsonl(tmp_path / "bad.jsonl", [*_rows(2), {"timestamp": 1, "input_length": "x"}])
    with pytest.raises(TraceError, match=r"bad.jsonl:3"):
        read_trace(bad)
    (tmp_path / "t.txt").write_text("")
    with pytest.raises(TraceError, match=r"expected \.jsonl"):
        read_trace(tmp_path / "t.txt")
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "none.jsonl")


def test_a_trace_that_runs_out_of_distinct_requests_is_an_error_not_a_replay(
    tmp_path: Path,
) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", _rows(40))
    spec = WorkloadSpec("file", rate=4.0, duration_s=10.0, trace_file=trace, predictor="none")
    requests = build(spec)  # 40 requests: every one of them, once
    assert len({r.prompt for r in requests}) == len(requests) == 40
    with pytest.raises(TraceError, match=r"holds 40 distinct requests .* needs 41"):
        build(dataclasses.replace(spec, rate=4.1))


def test_the_dev_mooncake_trace_holds_no_more_than_62_requests_a_second_for_30_s() -> None:
    """What the routing study's winning arms replayed: 1,872 requests fit 8,192 tokens."""
    spec = WorkloadSpec("mooncake", rate=62.0, duration_s=30.0, predictor="none")
    assert len(build(spec)) == 1860
    with pytest.raises(TraceError, match="mooncake holds 1872 distinct"):
        build(dataclasses.replace(spec, rate=63.0))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny served-predictor artifact: TF-IDF over prompts whose wording says their length."""
    out = tmp_path_factory.mktemp("artifact") / "sklearn"
    data = TrainingSet(synthetic_records(90, seed=1), synthetic_records(30, seed=2, corpus="v"))
    spec = TrainSpec("sklearn", "mico_n10_l1024", sklearn=SklearnConfig(max_iter=200))
    train_artifact(spec, data, out, progress=lambda _: None)
    return out


def test_prompts_with_text_are_predicted_by_the_artifact_itself(
    tmp_path: Path, artifact: Path
) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", _rows(12, text=True))
    spec = WorkloadSpec("file", rate=1.0, duration_s=12.0, trace_file=trace,
                        predictor_artifact=artifact)  # fmt: skip
    requests = build(spec)
    texts = [str(r["prompt"]) for r in _rows(12, text=True)]
    expected = {
        t: (max(1, round(p.expected_tokens)), p.bucket)
        for t, p in zip(texts, LengthPredictor.load(artifact).predict_batch(texts), strict=True)
    }
    by_length = {int(str(r["input_length"])): str(r["prompt"]) for r in _rows(12, text=True)}
    for request in requests:
        text = by_length[len(request.prompt)]
        assert (request.predicted, request.bucket) == expected[text]
    long = [r.predicted or 0 for r in requests if "essay" in by_length[len(r.prompt)]]
    short = [r.predicted or 0 for r in requests if "Spell" in by_length[len(r.prompt)]]
    assert min(long) > max(short)  # it read the wording
    assert prediction_kind(spec).startswith("served model (sklearn")
    stand_in = WorkloadSpec("sharegpt", rate=1.0, duration_s=5.0)
    assert prediction_kind(stand_in).startswith("STAND-IN for the served predictor")
    mixed = _rows(4, text=True)
    del mixed[1]["prompt"]
    with pytest.raises(TraceError, match="some requests have a prompt text"):
        build(dataclasses.replace(spec, trace_file=_jsonl(tmp_path / "m.jsonl", mixed),
                                  duration_s=4.0))  # fmt: skip


def test_the_simulated_gateway_routes_by_the_products_default() -> None:
    assert GatewaySettings().policy == RoutingSettings().policy


def _burst(predicted: list[int]) -> list[SimRequest]:
    prompts = [tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + 8)) for i in range(len(predicted))]
    return [SimRequest(f"r{i}", 0.001 * i, prompts[i], p, 600, p) for i, p in enumerate(predicted)]


def test_the_gateway_holds_what_every_site_pushes_back_and_serves_it_in_its_order() -> None:
    """One site of 4 slots and a queue bound of 2: a burst of 14 leaves 8 at the gateway."""
    predicted = [300, 290, 280, 270, 260, 250, 240, 230, 5, 6, 7, 8, 9, 10]
    site = dataclasses.replace(_spec(), max_model_len=1024)
    found = {}
    for order in ("fcfs", "spf"):
        settings = GatewaySettings(policy="least_requests", site_max_queued_requests=2,
                                   hold_requests=64, hold_order=HoldOrder(order, 50.0, 3),
                                   offload=False)  # fmt: skip
        result = run([dataclasses.replace(site, policy=order)], _burst(predicted), settings)
        assert result.completed == len(predicted)
        assert result.rejected == 0
        assert result.held == 8
        assert result.gateway_overtakes <= 3
        found[order] = result
    assert found["fcfs"].gateway_overtakes == 0
    # Held: r6..r13 planned 240, 230, then 5..10. Aging 50 tokens an arrival, bound 3: ranks
    # capped at 200.75, so r8, r9 go ahead of r6 and r8, r9, r10 of r7; r11 ranks behind it.
    assert found["spf"].gateway_overtakes == 3
    assert found["spf"].mean_latency < found["fcfs"].mean_latency
    refused = run([site], _burst(predicted), dataclasses.replace(settings, hold_requests=0))
    assert refused.held == 0
    assert refused.rejected == 8


def test_the_sites_overtakes_are_counted_and_spf_keeps_them_within_its_bound() -> None:
    # Site SPF, one slot: a long prediction, then short ones arriving while it waits.
    site = dataclasses.replace(_spec(), max_num_seqs=1, max_model_len=1024, policy="spf")
    burst = _burst([1, 400, *([2] * 10)])
    settings = GatewaySettings(policy="least_requests", site_max_queued_requests=None,
                               offload=False)  # fmt: skip
    result = run([site], burst, settings)
    assert result.completed == len(burst)
    # Behind r0 (running), r1 (400 tokens, aging 1) waits for every one of the 10 short ones.
    assert result.site_overtakes == {site.name: 10}
    fcfs = run([dataclasses.replace(site, policy="fcfs")], burst, settings)
    assert fcfs.site_overtakes == {site.name: 0}


def test_the_report_pairs_seeds_and_checks_the_bound() -> None:
    def row(mean: float, p50: float, p99: float, overtakes: int = 0) -> dict[str, object]:
        return {"mean_latency_s": mean, "ttft_p50_s": p50, "ttft_p99_s": p99, "held": 0,
                "site_overtakes_max": overtakes, "gateway_overtakes_max": 0}  # fmt: skip

    payload = {
        "baseline": "fcfs",
        "arms": ["fcfs", "spf"],
        "loads": [0.95],
        "spf": {"aging": 1.0, "max_overtakes": 5},
        "runs": {
            "fcfs": {"0.95": {"0": row(10.0, 2.0, 8.0), "1": row(20.0, 4.0, 8.0)}},
            "spf": {"0.95": {"0": row(6.0, 1.0, 8.8, 5), "1": row(18.0, 4.0, 8.0, 4)}},
        },
    }
    found = summary(payload)
    assert found["mean_latency_vs_fcfs"] == {"0.95": 0.8}  # (6 + 18) / (10 + 20)
    assert found["mean_latency_vs_fcfs_min_max"] == {"0.95": [0.6, 0.9]}
    assert found["ttft_p99_vs_fcfs"] == {"0.95": 1.05}
    assert found["bound_held"] is True
    payload["runs"]["spf"]["0.95"]["1"] = row(18.0, 4.0, 8.0, 6)  # type: ignore[index]
    assert summary(payload)["bound_held"] is False
