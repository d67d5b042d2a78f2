"""The elastic benchmark's load: open-loop Poisson arrivals whose rate steps 1x -> 3x -> 1x of a
unit rate, each request alternately a ShareGPT-like prompt (bench/loadgen/workload.py's mix:
Dolly records with their context and synthetic log-normal prompts, with SmolLM2's own answer
lengths) and a turn of the synthetic Mooncake trace (conversations whose prompts share prefix
blocks), in the trace's order. Every arm gets exactly the same requests at the same offsets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.elastic.presets import ElasticPreset, Phase
from bench.loadgen.text_tokens import WordTokens
from bench.loadgen.traces import read_trace, trace_requests
from bench.loadgen.workload import Request, arrivals, load_pools

# Templates drawn per source before timing: more than any run sends.
_TEMPLATE_RPS = 50.0


def arrival_times(phases: Sequence[Phase], unit_rps: float, seed: int) -> list[float]:
    """Poisson arrivals, piecewise constant in rate: phase i at multiple_i x unit_rps."""
    rng = random.Random(f"elastic-{seed}-{unit_rps:.6f}")
    times: list[float] = []
    start = 0.0
    for phase in phases:
        rate = phase.multiple * unit_rps
        at = start + rng.expovariate(rate)
        while at < start + phase.seconds:
            times.append(at)
            at += rng.expovariate(rate)
        start += phase.seconds
    return times


def templates(
    preset: ElasticPreset,
    words: WordTokens,
    vocab: int,
    count: int,
    seed: int,
    data_dir: Path | None,
    trace_file: Path,
) -> list[Request]:
    """`count` requests (untimed), alternating the two sources."""
    half = count // 2 + 1
    pools = load_pools(
        words.encode_text, vocab, data_dir=data_dir, max_prompt_tokens=preset.max_prompt_tokens
    )
    sharegpt = arrivals(
        pools, _TEMPLATE_RPS, half / _TEMPLATE_RPS * 1.5 + 1, seed,
        answer_scale=preset.answer_scale, max_prompt_tokens=preset.max_prompt_tokens,
        max_answer_tokens=preset.max_answer_tokens, words=words,
    )[:half]  # fmt: skip
    trace = trace_requests(
        read_trace(trace_file), words, _TEMPLATE_RPS, half / _TEMPLATE_RPS, seed, preset.trace
    )[:half]
    mixed: list[Request] = []
    for i in range(count):
        source = sharegpt if i % 2 == 0 else trace
        mixed.append(source[(i // 2) % len(source)])
    return mixed


def timed(requests: Sequence[Request], times: Sequence[float]) -> list[Request]:
    """The templates at the arrival times (as many as there are times), named afresh."""
    if len(requests) < len(times):
        raise ValueError(f"{len(times)} arrivals but only {len(requests)} request templates")
    return [
        replace(request, id=f"elastic-{i}", at_s=at, session=None)
        for i, (request, at) in enumerate(zip(requests, times, strict=False))
    ]
