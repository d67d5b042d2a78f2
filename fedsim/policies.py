"""The engine's batch policies on one simulated site: iteration-level scheduling (FCFS) against
static batching (a batch runs until its last answer ends) at MICO's maximum batch sizes 2..10,
and shortest-predicted-first against FCFS at batch 8 with exact and noisy predictions.

One burst of ShareGPT-like requests (fedsim/workload.py's lengths) is queued at t=0 and run to
the end through the real scheduler with the fitted step times of a GPU (docs/simulator.md);
prefix caching is off, as each request's prompt is its own. Per run: engine steps, simulated
seconds, output tokens/s, the cumulative KV use (the sum over steps of the tokens the running
sequences hold) and each request's completion in steps. Until issue 61 the same comparison ran
on a tiny random model on the CPU (bench.engine.cpu: `bench/results/engine/engine_cpu.md`).

    python -m fedsim.policies [--card h100] [--model llama8b] [--requests 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fedsim.cards import CARDS, MODELS
from fedsim.events import EventLoop
from fedsim.site import TOKEN, SimSite, SiteSpec
from fedsim.step_models import STEP_MODELS, step_model
from fedsim.study import RESULTS
from fedsim.workload import sharegpt_lengths
from site_engine.engine.core.outputs import StepOutputs
from site_engine.engine.core.scheduling_policy import PolicyName

BATCH_SIZES = tuple(range(2, 11))
SPF_BATCH = 8


@dataclass(frozen=True, slots=True)
class PolicyRun:
    policy: str
    max_num_seqs: int
    steps: int
    seconds: float
    output_tokens_per_s: float
    cumulative_kv_tokens: int
    mean_completion_steps: float
    p99_completion_steps: int


def run_policy(
    spec: SiteSpec,
    lengths: Sequence[tuple[int, int]],
    predicted: Sequence[int] | None = None,
    label: str | None = None,
) -> PolicyRun:
    """`lengths` (prompt, answer) all queued at t=0 on one site of `spec`, run to the end."""
    loop = EventLoop()
    done: dict[str, int] = {}
    kv = [0]

    def on_updates(site: SimSite, updates: StepOutputs) -> None:
        kv[0] += site.scheduler.stats().cached_tokens
        for index in updates.finished:
            done[updates.request_ids[index]] = site.steps

    site = SimSite(spec, loop, on_updates)
    for i, (prompt, answer) in enumerate(lengths):
        guess = predicted[i] if predicted is not None else None
        site.add(f"r{i}", (TOKEN,) * prompt, answer, answer, guess)
    loop.run(float("inf"))
    if len(done) != len(lengths):
        raise RuntimeError(f"{len(lengths) - len(done)} requests never finished")
    finished = sorted(done.values())
    return PolicyRun(
        label or spec.policy,
        spec.max_num_seqs,
        site.steps,
        site.busy_s,
        sum(answer for _, answer in lengths) / site.busy_s,
        kv[0],
        sum(finished) / len(finished),
        finished[min(len(finished) - 1, int(0.99 * len(finished)))],
    )


@dataclass(frozen=True, slots=True)
class BatchRow:
    """Iteration-level against static batching at one maximum batch size."""

    max_num_seqs: int
    iteration: PolicyRun
    static: PolicyRun

    @property
    def iterations_ratio(self) -> float:
        return self.static.steps / self.iteration.steps

    @property
    def throughput_ratio(self) -> float:
        return self.iteration.output_tokens_per_s / self.static.output_tokens_per_s

    @property
    def kv_cumulative_reduction(self) -> float:
        return 1 - self.iteration.cumulative_kv_tokens / self.static.cumulative_kv_tokens

    def to_json(self) -> dict[str, object]:
        return {
            "max_num_seqs": self.max_num_seqs,
            "iterations_ratio": self.iterations_ratio,
            "throughput_ratio": self.throughput_ratio,
            "kv_cumulative_reduction": self.kv_cumulative_reduction,
            "runs": [asdict(self.iteration), asdict(self.static)],
        }


@dataclass(frozen=True, slots=True)
class Comparison:
    card: str
    model: str
    requests: int
    seed: int
    step_models: str
    batching: tuple[BatchRow, ...]
    ordering: tuple[PolicyRun, ...]  # FCFS first, then shortest-predicted-first variants

    @property
    def kv_cumulative_reduction(self) -> float:
        """Over every batch size together."""
        iteration = sum(row.iteration.cumulative_kv_tokens for row in self.batching)
        return 1 - iteration / sum(row.static.cumulative_kv_tokens for row in self.batching)

    def to_json(self) -> dict[str, object]:
        return {
            "card": self.card,
            "model": self.model,
            "requests": self.requests,
            "seed": self.seed,
            "step_models": self.step_models,
            "batching": [row.to_json() for row in self.batching],
            "kv_cumulative_reduction": self.kv_cumulative_reduction,
            "ordering": [asdict(run) for run in self.ordering],
        }


def compare(
    card: str,
    model: str,
    requests: int,
    seed: int,
    models: Path,
    batch_sizes: Sequence[int] = BATCH_SIZES,
) -> Comparison:
    step = step_model(card, model, models)
    lengths = [(r.prompt, r.answer) for r in sharegpt_lengths(requests, seed)]

    def spec(policy: PolicyName, batch: int) -> SiteSpec:
        return SiteSpec(
            "site",
            CARDS[card],
            MODELS[model],
            step,
            0.0,
            max_num_seqs=batch,
            prefix_caching=False,
            policy=policy,
        )

    batching = tuple(
        BatchRow(b, run_policy(spec("fcfs", b), lengths), run_policy(spec("static", b), lengths))
        for b in batch_sizes
    )
    rng = random.Random(f"policies-noise-{seed}")
    ordering = [run_policy(spec("fcfs", SPF_BATCH), lengths)]
    for sigma in (0.0, 0.5, 1.0):
        guesses = [max(1, round(a * rng.lognormvariate(0.0, sigma))) for _, a in lengths]
        label = "spf_oracle" if sigma == 0 else f"spf_noisy_sigma{sigma}"
        ordering.append(run_policy(spec("spf", SPF_BATCH), lengths, guesses, label))
    root = RESULTS.parents[2]
    shown = models.resolve()
    named = str(shown.relative_to(root)) if shown.is_relative_to(root) else str(shown)
    return Comparison(card, model, requests, seed, named, batching, tuple(ordering))


def markdown(result: Comparison) -> str:
    lines = [
        f"# Batch policies on one simulated {result.card} ({result.model}), "
        f"{result.requests} requests queued at once, seed {result.seed}",
        "",
        f"Command: `python -m fedsim.policies --card {result.card} --model {result.model} "
        f"--requests {result.requests} --seed {result.seed}`; step times: "
        f"`{result.step_models}`.",
        "",
        "| max batch | iterations ratio | throughput ratio | KV cumulative reduction |",
        "|---|---|---|---|",
    ]
    for row in result.batching:
        cells = (row.iterations_ratio, row.throughput_ratio)
        lines.append(
            f"| {row.max_num_seqs} | {cells[0]:.2f} | {cells[1]:.2f} | "
            f"{row.kv_cumulative_reduction:.1%} |"
        )
    lines += [
        "",
        f"Cumulative KV over all batch sizes: {result.kv_cumulative_reduction:.1%} lower with "
        "iteration-level scheduling.",
        "",
        f"| policy (max batch {SPF_BATCH}) | mean completion (steps) | p99 (steps) | vs fcfs |",
        "|---|---|---|---|",
    ]
    fcfs = result.ordering[0].mean_completion_steps
    for run in result.ordering:
        mean = run.mean_completion_steps
        lines.append(
            f"| {run.policy} | {mean:.1f} | {run.p99_completion_steps} | {mean / fcfs:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.policies")
    parser.add_argument("--card", choices=sorted(CARDS), default="h100")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-models", type=Path, default=STEP_MODELS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    result = compare(args.card, args.model, args.requests, args.seed, args.step_models)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"policies_{args.card}_{args.model}"
    (args.out / f"{name}.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
