"""The queue-order study: shortest-predicted-first with aging, at the sites' waiting queues and
the gateway's queue, against first come first served, on the simulator (docs/simulator.md).

    python -m fedsim.queue_study [--case 4_unequal_sharegpt] [--seeds 3] [--loads 0.8 0.95] \
        [--arms fcfs spf] [--duration-s 30] [--source sharegpt|served_prompts|file] \
        [--trace-file F] [--predictor-artifact DIR] [--hold-requests N] [--name queue_order]

For each seed the federation's capacity is measured first: the completions per second of a
saturated run (FCFS everywhere, arrivals at `--saturate` x the case's first guess, counted over
the last two thirds of the arrivals, when every site's batch and queue are full). Each arm then
serves Poisson arrivals at each load x that capacity for `--duration-s` (the same requests in
every arm of a seed: paired), run until every request ends (at most `--drain-s` after the last
arrival). An arm is the order of both queues, `fcfs` or `spf` (the sites' scheduler policy and
GATEWAY_QUEUE_ORDER), and optionally `@predictor` (served, none, oracle: fedsim/workload.py);
the routing is the product's default policy and the SPF aging and bound the product's
defaults. Writes NAME.{json,md} (fedsim/queue_report.py): per arm, load and seed the latencies,
and each arm's ratios to the first arm's, seed by seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast, get_args

from fedllm_contract import spf
from fedsim.federation import RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.prompts import SERVED_ARTIFACT
from fedsim.queue_report import render
from fedsim.site import SiteSpec
from fedsim.study import RESULTS, Case, cases, first_guess
from fedsim.workload import Predictor, Source, WorkloadSpec, build, prediction_kind
from gateway.routing.hold_order import HoldOrder, HoldPolicy


@dataclass(frozen=True, slots=True)
class Arm:
    """The order of the sites' and the gateway's queues, and what predicts the lengths."""

    name: str
    order: HoldPolicy
    predictor: Predictor

    @classmethod
    def parse(cls, name: str) -> Arm:
        order, _, how = name.partition("@")
        if order not in ("fcfs", "spf"):
            raise ValueError(f"arm {name!r}: the order must be fcfs or spf")
        if (how or "served") not in get_args(Predictor):
            raise ValueError(f"arm {name!r}: the predictor must be one of {get_args(Predictor)}")
        return cls(name, cast(HoldPolicy, order), cast(Predictor, how or "served"))

    def sites(self, specs: Sequence[SiteSpec]) -> list[SiteSpec]:
        return [replace(s, policy=self.order) for s in specs]

    def gateway(self, hold_requests: int) -> GatewaySettings:
        return GatewaySettings(
            hold_requests=hold_requests,
            hold_order=HoldOrder(self.order, spf.DEFAULT_AGING, spf.DEFAULT_MAX_OVERTAKES),
        )


@dataclass(frozen=True, slots=True)
class Setup:
    case: Case
    source: Source
    duration_s: float
    drain_s: float
    hold_requests: int
    traces: Path | None
    trace_file: Path | None
    artifact: Path

    def workload(self, rate: float, seed: int, predictor: Predictor) -> WorkloadSpec:
        return WorkloadSpec(
            source=self.source,
            rate=rate,
            duration_s=self.duration_s,
            seed=seed,
            predictor=predictor,
            traces=self.traces,
            trace_file=self.trace_file,
            predictor_artifact=self.artifact,
        )


def timed_run(
    setup: Setup, arm: Arm, rate: float, seed: int, horizon_s: float | None = None
) -> tuple[RunResult, dict[str, Any]]:
    """One run of `arm` at `rate`; its summary with the rate and the CPU seconds it took."""
    requests = build(setup.workload(rate, seed, arm.predictor))
    began = time.process_time()
    result = run(
        arm.sites(setup.case.sites()),
        requests,
        arm.gateway(setup.hold_requests),
        drain_s=setup.drain_s if horizon_s is None else horizon_s,
    )
    row = {"rate": rate, "cpu_s": round(time.process_time() - began, 1)} | result.summary()
    row["ttft_mean_s"] = result.ttft_mean
    return result, row


def capacity(setup: Setup, seed: int, saturate: float) -> dict[str, Any]:
    """What the federation serves at most, in this seed's requests per second: the answer
    tokens per second of a saturated FCFS run over the last two thirds of its arrivals (every
    site's batch full, a queue waiting), over the mean answer length of its requests."""
    rate = saturate * first_guess(setup.case)
    arm = Arm("fcfs", "fcfs", "served")
    requests = build(setup.workload(rate, seed, "served"))
    began = time.process_time()
    result = run(arm.sites(setup.case.sites()), requests, arm.gateway(0), drain_s=0.0)
    start, end = round(setup.duration_s / 3.0), int(setup.duration_s)
    tokens_per_s = result.token_rate(start, end)
    mean_answer = statistics.fmean(r.answer_tokens for r in requests)
    return {
        "capacity_rps": tokens_per_s / mean_answer,
        "answer_tokens_per_s": tokens_per_s,
        "mean_answer_tokens": mean_answer,
        "offered_rps": rate,
        "window_s": [start, end],
        "queued_at_end": result.requests - result.completed - result.rejected,
        "rejected": result.rejected,
        "cpu_s": round(time.process_time() - began, 1),
    }


def study(
    setup: Setup,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    loads: Sequence[float],
    saturate: float,
    write: Any,
) -> dict[str, Any]:
    """Every arm at every load and seed; `write(payload)` after each run (a stopped study keeps
    what it measured)."""
    payload: dict[str, Any] = {"capacity": {}, "runs": {}}
    for seed in seeds:
        found = capacity(setup, seed, saturate)
        payload["capacity"][str(seed)] = found
        print(f"seed {seed}: capacity {found['capacity_rps']:.1f} req/s {found}", flush=True)
        write(payload)
        for load in loads:
            rate = load * found["capacity_rps"]
            for arm in arms:
                _, row = timed_run(setup, arm, rate, seed)
                payload["runs"].setdefault(arm.name, {}).setdefault(str(load), {})[str(seed)] = row
                print(f"  {arm.name} load {load} seed {seed}: {row}", flush=True)
                write(payload)
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.queue_study")
    parser.add_argument("--case", default="4_unequal_sharegpt")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8, 0.95])
    parser.add_argument("--arms", nargs="+", default=["fcfs", "spf"])
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--drain-s", type=float, default=300.0)
    parser.add_argument("--saturate", type=float, default=1.5)
    parser.add_argument("--source", choices=get_args(Source), default=None)
    parser.add_argument("--trace-file", type=Path, default=None)
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--predictor-artifact", type=Path, default=SERVED_ARTIFACT)
    parser.add_argument("--hold-requests", type=int, default=1024, help="the gateway's queue")
    parser.add_argument("--name", default="queue_order")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    chosen = {c.name: c for c in cases(quick=False)}
    if args.case not in chosen:
        parser.error(f"--case must be one of {sorted(chosen)}")
    if args.duration_s < 30.0:
        print("note: points shorter than 30 s of arrivals are not the study's", flush=True)
    source = args.source or ("file" if args.trace_file else chosen[args.case].source)
    setup = Setup(
        chosen[args.case],
        source,
        args.duration_s,
        args.drain_s,
        args.hold_requests,
        args.traces,
        args.trace_file,
        args.predictor_artifact,
    )
    arms = [Arm.parse(a) for a in args.arms]
    command = "python -m fedsim.queue_study " + " ".join(sys.argv[1:] if argv is None else argv)
    head = {
        "command": command,
        "case": {"name": setup.case.name, "cards": setup.case.cards, "rtts_s": setup.case.rtts_s},
        "source": source,
        "trace_file": str(args.trace_file) if args.trace_file else None,
        "predictors": {a.name: prediction_kind(setup.workload(1.0, 0, a.predictor)) for a in arms},
        "arms": [a.name for a in arms],
        "baseline": arms[0].name,
        "loads": args.loads,
        "seeds": args.seeds,
        "duration_s": args.duration_s,
        "spf": {"aging": spf.DEFAULT_AGING, "max_overtakes": spf.DEFAULT_MAX_OVERTAKES},
        "gateway_queue_requests": args.hold_requests,
        "saturate": args.saturate,
    }
    began = time.perf_counter()

    def write(payload: dict[str, Any]) -> None:
        render(head | payload | {"wall_s": round(time.perf_counter() - began)}, args.out, args.name)

    study(setup, arms, args.seeds, args.loads, args.saturate, write)
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
