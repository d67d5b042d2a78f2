"""The engine benchmarks' request trace: real prompts, reference response lengths, arrival
times. bench.engine's GPU runs serve it, and fedsim's calibration (fedsim/calibrate/replay.py)
rebuilds a recorded run's trace from its config to replay it on the simulated site.

Each request carries the GPT-2 token ids of a real prompt (Alpaca random rows and LIMA) and the
length of that record's reference response, which the engine replays exactly (greedy,
ignore_eos, max_tokens = that length). Everything is deterministic for a given seed: which
records are drawn, the order in which the corpora are interleaved, and the Poisson arrivals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from predictor.datasets import Corpus, PromptRecord, load_corpus

Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    corpus: str
    record_index: int  # index of the record in its corpus file (stable across runs)
    prompt_token_ids: tuple[int, ...]
    output_tokens: int  # the length replayed: the reference length, capped
    reference_output_tokens: int  # the reference response's length before the cap
    prompt_truncated: bool


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How many requests to draw from each corpus, and the caps that keep them in context."""

    counts: tuple[tuple[Corpus, int], ...]
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise ValueError("max_prompt_tokens and max_output_tokens must be >= 1")
        if any(count < 0 for _, count in self.counts):
            raise ValueError(f"request counts must be >= 0, got {self.counts}")
        if sum(count for _, count in self.counts) < 1:
            raise ValueError("the workload needs at least one request")

    @property
    def max_total_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_output_tokens


def sample_workload(
    records: Mapping[str, Sequence[PromptRecord]], spec: WorkloadSpec, encode: Encode
) -> list[WorkloadRequest]:
    """Draws `spec.counts` records per corpus without replacement and interleaves the corpora
    in a seeded random order (the arrival order). Records whose prompt encodes to no token are
    skipped (an engine cannot serve an empty prompt)."""
    rng = random.Random(spec.seed)
    drawn: list[WorkloadRequest] = []
    for corpus, count in spec.counts:
        if count == 0:
            continue
        pool = list(records.get(corpus, ()))
        rng.shuffle(pool)
        taken = 0
        for record in pool:
            if taken == count:
                break
            prompt = tuple(int(t) for t in encode(record.prompt))
            if not prompt:
                continue
            reference = len(encode(record.response))
            drawn.append(
                WorkloadRequest(
                    request_id=f"{corpus}-{record.index}",
                    corpus=corpus,
                    record_index=record.index,
                    prompt_token_ids=prompt[: spec.max_prompt_tokens],
                    output_tokens=max(1, min(reference, spec.max_output_tokens)),
                    reference_output_tokens=reference,
                    prompt_truncated=len(prompt) > spec.max_prompt_tokens,
                )
            )
            taken += 1
        if taken < count:
            raise ValueError(
                f"corpus {corpus!r} has only {taken} usable records, {count} were asked for"
            )
    rng.shuffle(drawn)
    return drawn


def load_workload(
    spec: WorkloadSpec, encode: Encode, data_dir: str | Path | None = None
) -> list[WorkloadRequest]:
    """`sample_workload` over the corpora as predictor.datasets reads them."""
    records: dict[str, list[PromptRecord]] = {
        corpus: load_corpus(corpus, data_dir) for corpus, count in spec.counts if count
    }
    return sample_workload(records, spec, encode)


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Arrival times in seconds (from 0) of a Poisson process of `rate` requests per second:
    independent exponential gaps of mean 1/rate; the first request arrives after one gap."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    rng = random.Random(f"poisson-{seed}")
    arrivals: list[float] = []
    now = 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        arrivals.append(now)
    return arrivals
