"""Latency of a predictor artifact on onnxruntime, as the gateway calls it.

Single prompts are real test prompts of at most 64 encoder tokens; batches are 32 of them; long
prompts are test prompts joined until they pass 512 words (the predictor truncates them, so the
cost measured is mostly tokenizing the cut text).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from predictor.runtime import LengthPredictor

SHORT_PROMPT_TOKENS = 64
LONG_PROMPT_WORDS = 512
BATCH = 32


def _timed(call: Callable[[], object], repeats: int) -> np.ndarray:
    seconds = np.empty(repeats)
    for i in range(repeats):
        started = time.perf_counter()
        call()
        seconds[i] = time.perf_counter() - started
    return seconds * 1000.0


def _cycling(predictor: LengthPredictor, batches: list[list[str]]) -> Callable[[], object]:
    batch_cycle = iter(batches * 4)
    return lambda: predictor.predict_batch(next(batch_cycle))


def short_prompts(predictor: LengthPredictor, prompts: Sequence[str], limit: int) -> list[str]:
    """Test prompts whose encoding (special tokens included) is at most 64 tokens."""
    from predictor.encoding import PromptEncoder, pretrained_dir

    encoder = PromptEncoder.from_dir(pretrained_dir(), max_tokens=512)
    chosen: list[str] = []
    for prompt in prompts:
        _, mask = encoder.encode([prompt])
        if int(mask.sum()) <= SHORT_PROMPT_TOKENS:
            chosen.append(prompt)
        if len(chosen) == limit:
            break
    return chosen


def long_prompts(prompts: Sequence[str], count: int) -> list[str]:
    out: list[str] = []
    words: list[str] = []
    for prompt in prompts:
        words += prompt.split()
        if len(words) >= LONG_PROMPT_WORDS:
            out.append(" ".join(words))
            words = []
            if len(out) == count:
                break
    return out


def measure(artifact: Path, prompts: Sequence[str], repeats: int = 300) -> dict[str, float]:
    """p50/p99 single-prompt, per-prompt cost in batches of 32 (1 and 2 threads), long prompts."""
    one = LengthPredictor.load(artifact, threads=1)
    two = LengthPredictor.load(artifact, threads=2)
    short = short_prompts(one, prompts, repeats)
    for prompt in short[:20]:  # warm-up: first runs allocate and pick kernels
        one.predict(prompt)
    cycle = iter(short * (repeats // max(1, len(short)) + 1))
    single = _timed(lambda: one.predict(next(cycle)), repeats)
    batches = [list(short[i : i + BATCH]) for i in range(0, len(short) - BATCH + 1, BATCH)]
    per_prompt: dict[int, float] = {}
    for threads, predictor in ((1, one), (2, two)):
        predictor.predict_batch(batches[0])
        timings = _timed(_cycling(predictor, batches), len(batches) * 4)
        per_prompt[threads] = float(np.median(timings)) / BATCH
    long = long_prompts(prompts, 50)
    long_cycle = iter(long * 4)
    long_ms = _timed(lambda: one.predict(next(long_cycle)), len(long) * 4)
    return {
        "p50_single_1thread": float(np.percentile(single, 50)),
        "p99_single_1thread": float(np.percentile(single, 99)),
        "mean_single_1thread": float(single.mean()),
        "batch32_per_prompt_1thread": per_prompt[1],
        "batch32_per_prompt_2threads": per_prompt[2],
        "p50_long_prompt_1thread": float(np.percentile(long_ms, 50)),
        "single_prompts": float(len(short)),
        "long_prompts": float(len(long)),
    }


def single_prompt_ms(
    paths: dict[str, Path], prompts: Sequence[str], repeats: int = 400
) -> dict[str, float]:
    """p50 milliseconds of one prompt's prediction on one thread, as the gateway calls it; the
    models take turns prompt by prompt, so a shared machine's load falls on both alike."""
    loaded = {name: LengthPredictor.load(path, threads=1) for name, path in paths.items()}
    short = [p for p in prompts if len(p) <= 256][:100] or list(prompts[:100])
    for predictor in loaded.values():
        for prompt in short[:20]:  # warm-up: first runs allocate and pick kernels
            predictor.predict(prompt)
    times: dict[str, list[float]] = {name: [] for name in loaded}
    for i in range(repeats):
        for name, predictor in loaded.items():
            started = time.perf_counter()
            predictor.predict(short[i % len(short)])
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: float(np.median(values)) for name, values in times.items()}
