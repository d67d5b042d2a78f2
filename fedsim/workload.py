"""Simulated requests: lengths and arrivals from the traces (read where --traces points; never
copied into the repository), or ShareGPT-like lengths; a LoRA mix; and the length predictor's
answer for each.

Prompts are token ids the sites hash into their prefix cache as they hash real ones: unique per
request, except where a trace says two prompts share blocks (Mooncake's `hash_ids`, one id per
512 tokens), where they share the same ids and so the same cached blocks.

The prediction: the served predictor's measured quality, not its code (the traces carry lengths,
not text). Its predicted lengths are the true ones with log-normal error whose rank correlation
with the truth is the served predictor's measured Spearman (bench/results/predictor/
predictor_served.json: 0.66), and its bucket the served scheme's (quantile edges of the same
file); "oracle" predicts the truth; "none" predicts nothing (routing plans as it does without).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Literal

from fedllm_contract.priority import Priority

Source = Literal["sharegpt", "azure_conv", "azure_code", "mooncake"]
SOURCES: tuple[Source, ...] = ("sharegpt", "azure_conv", "azure_code", "mooncake")
Predictor = Literal["served", "oracle", "none"]
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake trace
_SERVED_SPEARMAN = 0.658  # predictor_served.json's served_predictor.spearman
# predictor_served.json's scheme: quantile_n10 edges of the served answer lengths.
BUCKET_EDGES = (0.0, 17.0, 40.0, 78.0, 123.0, 179.0, 250.0, 441.0, 1024.0, 1025.0)


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt: tuple[int, ...]
    answer_tokens: int
    max_tokens: int
    predicted: int | None = None
    bucket: int | None = None
    adapter: str = ""
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True, slots=True)
class Lengths:
    """(prompt tokens, answer tokens) of one request, and where its prompt's blocks come from."""

    prompt: int
    answer: int
    at_s: float = 0.0
    hash_ids: tuple[int, ...] = ()


def traces_dir(explicit: Path | None = None) -> Path:
    """--traces, else FEDSIM_TRACES, else ../shared/datasets/traces beside the checkout."""
    if explicit is not None:
        return explicit
    env = os.environ.get("FEDSIM_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "datasets" / "traces"


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def sharegpt_lengths(count: int, seed: int) -> list[Lengths]:
    """ShareGPT-like lengths: log-normal prompts (median 180 tokens) and answers (median 220),
    capped at 2,048 and 1,024, ShareGPT's reported shape (Vidur, vLLM's benchmark)."""
    rng = random.Random(f"sharegpt-{seed}")
    return [
        Lengths(_lognormal(rng, 180, 1.1, 4, 2048), _lognormal(rng, 220, 0.9, 1, 1024))
        for _ in range(count)
    ]


def azure_lengths(path: Path) -> list[Lengths]:
    """Azure LLM inference 2023 (conv or code): context and generated tokens, arrival offsets."""
    rows: list[Lengths] = []
    start: datetime | None = None
    with path.open() as handle:
        for row in csv.DictReader(handle):
            at = datetime.fromisoformat(row["TIMESTAMP"][:26])
            start = start or at
            rows.append(
                Lengths(
                    int(row["ContextTokens"]),
                    max(1, int(row["GeneratedTokens"])),
                    (at - start).total_seconds(),
                )
            )
    return rows


def mooncake_lengths(path: Path) -> list[Lengths]:
    rows: list[Lengths] = []
    with path.open() as handle:
        for line in handle:
            r = json.loads(line)
            rows.append(
                Lengths(
                    int(r["input_length"]),
                    max(1, int(r["output_length"])),
                    float(r["timestamp"]) / 1000.0,
                    tuple(r["hash_ids"]),
                )
            )
    return rows


def trace_lengths(source: Source, traces: Path | None, count: int, seed: int) -> list[Lengths]:
    if source == "sharegpt":
        return sharegpt_lengths(count, seed)
    root = traces_dir(traces)
    if source == "mooncake":
        return mooncake_lengths(root / "mooncake_fast25_synthetic_trace.jsonl")
    name = "conv" if source == "azure_conv" else "code"
    return azure_lengths(root / f"azure_llm_inference_2023_{name}.csv")


def _prompt(index: int, lengths: Lengths) -> tuple[int, ...]:
    """Token ids: the trace's shared blocks where it has them, else ids no other prompt has."""
    if lengths.hash_ids:
        ids: list[int] = []
        for h in lengths.hash_ids:
            ids.extend(range(h * MOONCAKE_BLOCK + 1, (h + 1) * MOONCAKE_BLOCK + 1))
        return tuple(ids[: lengths.prompt])
    # Above every Mooncake id; 32-bit ids (the block hash's), 2**18 prompts before they repeat.
    base = (1 << 31) + (index % (1 << 18)) * (1 << 13)
    return tuple(range(base, base + lengths.prompt))


def pearson_for_spearman(rho: float) -> float:
    """The normal correlation whose rank correlation is `rho` (Pearson's relation)."""
    return 2.0 * math.sin(math.pi * rho / 6.0)


def predict(answers: Sequence[int], how: Predictor, seed: int) -> list[int | None]:
    """Each answer's predicted length (the module docstring)."""
    if how == "none":
        return [None] * len(answers)
    if how == "oracle":
        return list(answers)
    logs = [math.log(a) for a in answers]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / max(len(logs) - 1, 1)) or 1.0
    r = pearson_for_spearman(_SERVED_SPEARMAN)
    rng = random.Random(f"predict-{seed}")
    out: list[int | None] = []
    for x in logs:
        z = r * (x - mean) / sd + math.sqrt(1 - r * r) * rng.gauss(0.0, 1.0)
        out.append(max(1, round(math.exp(mean + sd * z))))
    return out


def bucket_of(predicted: int | None) -> int | None:
    if predicted is None:
        return None
    return min(bisect_right(BUCKET_EDGES, predicted) - 1, len(BUCKET_EDGES) - 2)


def zipf_adapters(count: int, adapters: int, share: float, seed: int) -> list[str]:
    """Each request's LoRA adapter: none with probability 1 - share, else one of `adapters`
    by Zipf(1) popularity."""
    if adapters <= 0 or share <= 0:
        return [""] * count
    rng = random.Random(f"lora-{seed}")
    weights = [1.0 / (i + 1) for i in range(adapters)]
    names = [f"lora{i:03d}" for i in range(adapters)]
    return [rng.choices(names, weights)[0] if rng.random() < share else "" for _ in range(count)]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    source: Source = "sharegpt"
    rate: float = 10.0  # requests per second
    duration_s: float = 60.0
    seed: int = 0
    predictor: Predictor = "served"
    max_model_len: int = 8192
    adapters: int = 0
    adapter_share: float = 0.0
    traces: Path | None = None
    # Poisson arrivals at `rate`; False: the trace's own arrival times, compressed to `rate`.
    poisson: bool = True


def build(spec: WorkloadSpec) -> list[SimRequest]:
    """The requests of one run: `rate` x `duration_s` of them, lengths drawn from the source
    (in the trace's order from a seeded offset), those that cannot fit the context left out."""
    count = max(1, round(spec.rate * spec.duration_s))
    pool = trace_lengths(spec.source, spec.traces, count, spec.seed)
    fits = [x for x in pool if x.prompt + x.answer <= spec.max_model_len and x.prompt > 0]
    if not fits:
        raise ValueError(f"no request of {spec.source} fits {spec.max_model_len} tokens")
    rng = random.Random(f"arrivals-{spec.seed}")
    offset = rng.randrange(len(fits)) if spec.source != "sharegpt" else 0
    chosen = [fits[(offset + i) % len(fits)] for i in range(count)]
    if spec.poisson:
        at, times = 0.0, []
        for _ in chosen:
            at += rng.expovariate(spec.rate)
            times.append(at)
    else:
        span = max(chosen[-1].at_s - chosen[0].at_s, 1e-9)
        scale = spec.duration_s / span
        times = [(x.at_s - chosen[0].at_s) * scale for x in chosen]
    answers = [x.answer for x in chosen]
    predicted = predict(answers, spec.predictor, spec.seed)
    adapters = zipf_adapters(count, spec.adapters, spec.adapter_share, spec.seed)
    return [
        SimRequest(
            request_id=f"r{i}",
            arrival_s=times[i],
            prompt=_prompt(i, x),
            answer_tokens=x.answer,
            max_tokens=min(max(x.answer, 1024), spec.max_model_len - x.prompt),
            predicted=predicted[i],
            bucket=bucket_of(predicted[i]),
            adapter=adapters[i],
        )
        for i, x in enumerate(chosen)
    ]


def with_rate(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """The same requests arriving `factor` times faster."""
    return [replace(r, arrival_s=r.arrival_s / factor) for r in requests]
