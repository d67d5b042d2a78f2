"""The simulator against measured GPU runs: the same requests, the same engine limits, one
simulated site with the fitted step time, and the TTFT and TPOT percentiles compared.

Replayed: bench/results/engine/engine_h200.json's `engine_burst` (1,000 requests at once),
`engine_subset_burst` (its first 256) and `engine_poisson` (the 1,000 at 20 requests/s), and
engine_serving/engine_serving_h200.json's `burst` (the same 1,000-request burst two days and many
engine changes later), and each engine_h200_r<rate>.json's runs (bench.engine.gpu at another
Poisson rate and trace size, named with the file's suffix): Llama-3.2-1B-shaped on an H200,
max_num_seqs 256, budget 4,096 tokens,
prefix caching on. Their trace is rebuilt exactly as the runs built it (fedsim/engine_trace.py:
Alpaca and LIMA prompts in GPT-2 token ids, the reference answer lengths replayed, seed 0; its
Poisson arrivals), from the datasets in ../shared/datasets; the rebuilt trace's output tokens are
checked against each run's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fedllm_contract.tokenizer import load_tokenizer
from fedsim.cards import CARDS, MODELS
from fedsim.engine_trace import WorkloadRequest, WorkloadSpec, load_workload, poisson_arrivals
from fedsim.federation import RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.site import SiteSpec
from fedsim.step_time import StepFeatures, StepTimeModel
from fedsim.workload import SimRequest, bucket_of


@dataclass(frozen=True, slots=True)
class Replayed:
    name: str
    source: str
    measured: dict[str, float]
    simulated: dict[str, float]

    @property
    def errors(self) -> dict[str, float]:
        return {
            key: abs(self.simulated[key] - value) / value
            for key, value in self.measured.items()
            if value > 0
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "measured": self.measured,
            "simulated": self.simulated,
            "relative_error": self.errors,
        }


def _measured(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50_s": summary["ttft"]["p50_ms"] / 1e3,
        "ttft_p99_s": summary["ttft"]["p99_ms"] / 1e3,
        "tpot_p50_s": summary["tpot"]["p50_ms"] / 1e3,
    }


def _simulated(result: RunResult) -> dict[str, float]:
    return {
        "ttft_p50_s": result.ttft_p50,
        "ttft_p99_s": result.ttft_p99,
        "tpot_p50_s": result.tpot_p50,
    }


@dataclass(frozen=True, slots=True)
class MeasuredRun:
    name: str
    source: str
    summary: dict[str, Any]
    requests: list[SimRequest]
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int


# Runs of bench.engine.gpu at other Poisson rates on today's engine (engine_h200_r<rate>.json):
# each file's trace is rebuilt from its own config.
_RATE_RUNS = "engine_h200_r*.json"

_Run = tuple[str, dict[str, Any], dict[str, Any], list[float]]


def _workload_of(data: dict[str, Any], shared: Path) -> list[WorkloadRequest]:
    """The trace a bench.engine.gpu result file ran, rebuilt from its config."""
    config, trace = data["config"], data["trace"]
    # The run's own order of corpora (bench/engine/run_phases.py); by_corpus counts the shuffled
    # trace in order of first appearance, which is the run's order only by chance.
    counts = (
        (("alpaca_random", config["requests_alpaca"]), ("lima", config["requests_lima"]))
        if "requests_alpaca" in config
        else tuple(trace["by_corpus"].items())
    )
    spec = WorkloadSpec(
        counts=counts,
        max_prompt_tokens=config["max_prompt_tokens"],
        max_output_tokens=config["max_response_tokens"],
        seed=config["seed"],
    )
    tokenizer = load_tokenizer(shared / "tokenizers" / "gpt2")
    return load_workload(spec, tokenizer.encode, shared / "datasets")


def _engine_file(
    path: Path, shared: Path, suffix: str
) -> tuple[dict[str, MeasuredRun], list[WorkloadRequest]]:
    """The burst, subset and Poisson runs of one bench.engine.gpu result file, named with
    `suffix`, their trace rebuilt as the run built it; and that trace."""
    data = json.loads(path.read_text())
    config = data["config"]
    workload = _workload_of(data, shared)
    runs: dict[str, _Run] = {
        name + suffix: (
            path.name,
            data["runs"][name]["summary"],
            data["runs"][name]["engine_config"],
            t,
        )
        for name, t in (
            ("engine_burst", [0.0] * len(workload)),
            ("engine_subset_burst", [0.0] * int(data.get("hf_subset_requests") or 0)),
            (
                "engine_poisson",
                poisson_arrivals(len(workload), config["poisson_rate"], config["seed"]),
            ),
        )
        if name in data["runs"]
    }
    return _as_measured(runs, workload), workload


def _as_measured(runs: dict[str, _Run], workload: list[WorkloadRequest]) -> dict[str, MeasuredRun]:
    out = {}
    for name, (source, summary, engine, times) in runs.items():
        chosen = workload[: len(times)]
        if sum(w.output_tokens for w in chosen) != summary["output_tokens"]:
            raise ValueError(f"{source}:{name}: the rebuilt trace is not the run's")
        requests = [
            SimRequest(
                w.request_id,
                at,
                w.prompt_token_ids,
                w.output_tokens,
                w.output_tokens,
                w.output_tokens,
                bucket_of(w.output_tokens),
            )
            for w, at in zip(chosen, times, strict=True)
        ]
        out[name] = MeasuredRun(
            name,
            f"{source}:{name}",
            summary,
            requests,
            engine["max_num_seqs"],
            engine["max_num_batched_tokens"],
            engine["block_size"],
        )
    return out


def measured_runs(
    results: Path, shared: Path, engine_run: Path | None = None
) -> dict[str, MeasuredRun]:
    """The runs of engine_h200.json, engine_serving_h200.json and engine_h200_r*.json (the
    module docstring), their trace rebuilt. `engine_run`: a newer engine's bench.engine.gpu file
    instead of engine_h200_20261127.json; engine_serving_h200.json's burst (another engine's)
    is then left out."""
    # Today's engine (2026-11-27) where it has run; the file of 2026-11-21 was measured on an
    # engine whose admitting steps were ~10x slower (docs/simulator.md).
    path = engine_run or results / "engine" / "engine_h200_20261127.json"
    if not path.is_file():
        path = results / "engine" / "engine_h200.json"
    out, workload = _engine_file(path, shared, "")
    serving_path = results / "engine_serving" / "engine_serving_h200.json"
    serving = None
    if engine_run is None and serving_path.is_file():
        serving = json.loads(serving_path.read_text())
    if serving is not None and "burst" in serving:
        burst = serving["burst"]
        times = [0.0] * burst["trace_requests"]
        out |= _as_measured(  # the same trace as the engine file's burst
            {"serving_burst": (serving_path.name, burst["summary"], burst["engine_config"], times)},
            workload,
        )
    for extra in sorted((results / "engine").glob(_RATE_RUNS)):
        out |= _engine_file(extra, shared, "_" + extra.stem.removeprefix("engine_h200_"))[0]
    return out


def replay(measured: MeasuredRun, step: StepTimeModel) -> RunResult:
    """One measured run through one simulated H200 site with the engine's limits."""
    site = SiteSpec(
        "h200",
        CARDS["h200"],
        MODELS["llama1b"],
        step,
        rtt_s=0.0,
        max_num_seqs=measured.max_num_seqs,
        max_num_batched_tokens=measured.max_num_batched_tokens,
        block_size=measured.block_size,
        max_model_len=4096,
    )
    # The engine alone: no gateway queue bound in front of it.
    settings = GatewaySettings(site_max_queued_requests=None, offload=False)
    return run([site], list(measured.requests), settings, drain_s=600.0)


def compare(measured: MeasuredRun, step: StepTimeModel) -> Replayed:
    result = replay(measured, step)
    return Replayed(measured.name, measured.source, _measured(measured.summary), _simulated(result))


@dataclass(frozen=True, slots=True)
class _Recording(StepTimeModel):
    """A step model that keeps the features of every step it times."""

    log: list[StepFeatures] = field(default_factory=list, compare=False)

    def seconds(self, f: StepFeatures) -> float:
        self.log.append(f)
        return StepTimeModel.seconds(self, f)


def burst_steps(measured: MeasuredRun, step: StepTimeModel) -> list[StepFeatures]:
    """Every step of a burst's replay. A burst's schedule does not depend on the step times
    (every request is there from the start), so its busy time under another host term is the
    sum of that model's step times over these steps."""
    if any(r.arrival_s > 0 for r in measured.requests):
        raise ValueError(f"{measured.name} is not a burst: its schedule follows its step times")
    recording = _Recording(**{f.name: getattr(step, f.name) for f in fields(StepTimeModel)})
    replay(measured, recording)
    return recording.log


def fit_admitting(measured: MeasuredRun, step: StepTimeModel, iterations: int = 30) -> float:
    """The host term's admitting_step_s that makes `measured` (a burst: its wall time is the
    site's busy time) last as long simulated as it did: bisection on [0, 20 ms]. FITTING ONLY:
    the run it is fitted on is not one the calibration reports a replay error for."""
    wall = measured.summary["wall_s"]
    features = burst_steps(measured, step)
    low, high = 0.0, 0.02
    for _ in range(iterations):
        mid = (low + high) / 2
        model = replace(step, host=replace(step.host, admitting_step_s=mid))
        busy = sum(model.seconds(f) for f in features)
        low, high = (mid, high) if busy < wall else (low, mid)
    return (low + high) / 2
