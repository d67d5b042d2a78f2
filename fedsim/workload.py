"""Simulated requests: lengths and arrivals from the traces (read where --traces points, or any
trace file, fedsim/traces.py; never copied into the repository), real prompts with the served
model's answer lengths (fedsim/prompts.py), or ShareGPT-like lengths; a LoRA mix; and the
length predictor's answer for each.

A run takes each request of its source once: a trace that holds fewer requests (that fit the
context) than rate x duration is an error (TraceError), never replayed from its start (a replay
repeats prompts the sites have cached: at ~62 req/s for 30 s the dev Mooncake trace ran out, and
the routing study's fastest arms replayed cached prompts).

Prompts are token ids the sites hash into their prefix cache as they hash real ones: unique per
request, except where a trace says two prompts share blocks (Mooncake's `hash_ids`, one id per
512 tokens), where they share the same ids and so the same cached blocks.

The prediction ("served"): where the workload has prompt text (the served prompts, a trace file
with a `prompt` field) the served predictor itself, an ONNX artifact run with onnxruntime on each
prompt (WorkloadSpec.predictor_artifact; fedsim/prompts.py). Where it has none (ShareGPT-like
lengths, Mooncake, Azure) a STAND-IN for it: the true lengths with log-normal error whose rank
correlation with the truth is the served predictor's measured Spearman (bench/results/predictor/
predictor_served.json: 0.66), and its bucket the served scheme's (quantile edges of the same
file); `prediction_kind` says which, for the results. "oracle" predicts the truth; "none"
predicts nothing (routing plans as it does without).
"""

from __future__ import annotations

import math
import os
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Literal

from fedllm_contract.priority import Priority
from fedsim.prompts import SERVED_ARTIFACT, artifact_predictor, served_prompts
from fedsim.traces import Lengths, TraceError, azure_lengths, jsonl_lengths, read_trace

# "served_prompts": real prompts with the served model's answer lengths (fedsim/prompts.py);
# "file": WorkloadSpec.trace_file (fedsim/traces.py).
Source = Literal["sharegpt", "azure_conv", "azure_code", "mooncake", "served_prompts", "file"]
SOURCES: tuple[Source, ...] = (
    "sharegpt",
    "azure_conv",
    "azure_code",
    "mooncake",
    "served_prompts",
    "file",
)
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


def trace_lengths(
    source: Source,
    traces: Path | None,
    count: int,
    seed: int,
    trace_file: Path | None = None,
) -> list[Lengths]:
    if source == "sharegpt":
        return sharegpt_lengths(count, seed)
    return list(_pool(source, traces, trace_file))


def _fitting(spec: WorkloadSpec, count: int) -> list[Lengths]:
    """The source's requests that fit the context; ShareGPT-like ones are drawn until `count`
    fit (the same seed draws the same lengths first)."""

    def fit(pool: Sequence[Lengths]) -> list[Lengths]:
        return [x for x in pool if x.prompt + x.answer <= spec.max_model_len and x.prompt > 0]

    if spec.source != "sharegpt":
        return fit(trace_lengths(spec.source, spec.traces, count, spec.seed, spec.trace_file))
    drawn = count
    while len(fits := fit(sharegpt_lengths(drawn, spec.seed))) < count and drawn < 64 * count:
        drawn *= 2
    return fits[:count]


@cache
def _pool(source: Source, traces: Path | None, trace_file: Path | None) -> tuple[Lengths, ...]:
    """A trace's requests, read once per process."""
    if source == "served_prompts":
        return served_prompts()
    if source == "file":
        if trace_file is None:
            raise TraceError("source 'file' needs a trace file (--trace-file)")
        return tuple(read_trace(trace_file))
    root = traces_dir(traces)
    if source == "mooncake":
        return tuple(jsonl_lengths(root / "mooncake_fast25_synthetic_trace.jsonl"))
    name = "conv" if source == "azure_conv" else "code"
    return tuple(azure_lengths(root / f"azure_llm_inference_2023_{name}.csv"))


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
    # The trace of source "file" (fedsim/traces.py), and the predictor artifact "served" runs
    # where the workload has prompt text (fedsim/prompts.py).
    trace_file: Path | None = None
    predictor_artifact: Path = SERVED_ARTIFACT


def build(spec: WorkloadSpec) -> list[SimRequest]:
    """The requests of one run: `rate` x `duration_s` of them, lengths drawn from the source
    (in the trace's order from a seeded offset, each request once), those that cannot fit the
    context left out; TraceError when the source holds too few (the module docstring)."""
    count = max(1, round(spec.rate * spec.duration_s))
    fits = _fitting(spec, count)
    if count > len(fits):
        raise TraceError(
            f"{_named(spec)} holds {len(fits)} distinct requests that fit {spec.max_model_len} "
            f"tokens; {spec.rate:g} req/s for {spec.duration_s:g} s needs {count} (at most "
            f"{len(fits) / spec.duration_s:.1f} req/s for that long): a replay would send "
            "prompts the sites have cached"
        )
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
    predicted, buckets = _predictions(spec, chosen)
    adapters = zipf_adapters(count, spec.adapters, spec.adapter_share, spec.seed)
    return [
        SimRequest(
            request_id=f"r{i}",
            arrival_s=times[i],
            prompt=_prompt(i, x),
            answer_tokens=x.answer,
            max_tokens=min(max(x.answer, 1024), spec.max_model_len - x.prompt),
            predicted=predicted[i],
            bucket=buckets[i],
            adapter=adapters[i],
        )
        for i, x in enumerate(chosen)
    ]


def _named(spec: WorkloadSpec) -> str:
    return f"trace file {spec.trace_file}" if spec.source == "file" else f"source {spec.source}"


def _predictions(
    spec: WorkloadSpec, chosen: Sequence[Lengths]
) -> tuple[list[int | None], list[int | None]]:
    """Each request's planned answer and bucket (the module docstring)."""
    texts = [x.text for x in chosen]
    if spec.predictor == "served" and any(t is not None for t in texts):
        if any(t is None for t in texts):
            raise TraceError(f"{_named(spec)}: some requests have a prompt text, others none")
        model = artifact_predictor(spec.predictor_artifact)
        found = model.predict([t for t in texts if t is not None])
        return [p for p, _ in found], [b for _, b in found]
    predicted = predict([x.answer for x in chosen], spec.predictor, spec.seed)
    return predicted, [bucket_of(p) for p in predicted]


def prediction_kind(spec: WorkloadSpec) -> str:
    """What predicts a run's answer lengths, for its results: the served model (its artifact),
    its stand-in (no prompt text), the truth or nothing."""
    if spec.predictor != "served":
        return spec.predictor
    pool = _pool(spec.source, spec.traces, spec.trace_file) if spec.source != "sharegpt" else ()
    if pool and all(x.text is not None for x in pool):
        model = artifact_predictor(spec.predictor_artifact)
        return f"served model ({spec.predictor_artifact.name}, version {model.version})"
    return (
        f"STAND-IN for the served predictor (no prompt text): log-normal error at its "
        f"Spearman {_SERVED_SPEARMAN}"
    )


def with_rate(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """The same requests arriving `factor` times faster."""
    return [replace(r, arrival_s=r.arrival_s / factor) for r in requests]
