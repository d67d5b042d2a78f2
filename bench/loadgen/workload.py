"""The long-prompt mix of the engine-serving benchmark (issue 16), with the served model's own
answer lengths, arriving open loop.

Prompts, half each: Dolly records that carry a context (instruction + context: documents,
retrieval-style prompts), and synthetic prompts of random token ids whose lengths are
log-normal with median 250 and p99 3,000 tokens. Answers are SmolLM2-135M-Instruct's own
greedy answer lengths (`predictor/labels/smollm2-135m-instruct`, counted in its tokens, mean
~410 over Dolly): a Dolly prompt replays its own label, so a predictor trained on that model's
answers has something real to predict; a synthetic prompt replays a label drawn at random
(nothing about random ids tells its length: there, no predictor can beat the mean). Only Dolly
prompts of the test split (`predictor.prepare.split_of`: 49 of the 440 with a context) are
replayed: the served model's predictor was trained on the train split and chosen on the
validation split, so it never saw them. Each answer
is replayed exactly with `ignore_eos` and max_tokens = its length, so a gateway that plans with
max_tokens plans with the truth (the oracle arm).

Arrivals are Poisson: exponential gaps at the rate, drawn from a seed of the rate, so every
policy sees exactly the same requests at the same offsets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen.text_tokens import WordTokens
from predictor.datasets import load_corpus
from predictor.prepare import split_of
from predictor.served_labels import join_records, read_labels

Encode = Callable[[str], Sequence[int]]

# The model name every site serves (Request.model None names it).
ROUTED_MODEL = "fed"
SYNTHETIC_MEDIAN = 250
SYNTHETIC_P99 = 3000
_Z99 = 2.3263478740408408  # the standard normal's 99th percentile
LABELS_DIR = (
    Path(__file__).resolve().parent.parent.parent / "predictor/labels/smollm2-135m-instruct"
)


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    source: str  # "dolly_context", "synthetic_lognormal", "mooncake_trace", "mt_bench_turn1", ...
    prompt_token_ids: tuple[int, ...]
    answer_tokens: int
    at_s: float  # arrival offset from the start of the run
    # Sent as text when given (routers that read text need it), else as the token ids; the text
    # encodes to exactly prompt_token_ids.
    prompt_text: str | None = None
    # The conversation it belongs to (sent as `user`: the session key of session affinity).
    session: str | None = None
    # The model it names (a LoRA adapter of the routed model); None: the routed model.
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Pools:
    dolly: tuple[tuple[tuple[int, ...], int], ...]  # (prompt ids, served answer length)
    answers: tuple[int, ...]  # every Dolly label, for synthetic prompts
    vocab: int


def load_pools(
    encode: Encode,
    vocab: int,
    *,
    data_dir: Path | None,
    labels_dir: Path = LABELS_DIR,
    max_prompt_tokens: int,
) -> Pools:
    """Test-split Dolly records with a context, joined with their served-model labels and
    encoded once; every labelled Dolly answer length for the synthetic prompts."""
    records = [r for r in load_corpus("dolly", data_dir) if "\n\n" in r.prompt]
    joined = list(join_records(records, read_labels(labels_dir)))
    unseen = [(r, label) for r, label in joined if split_of(r.prompt) == "test"]
    if not unseen:
        raise ValueError(f"no test-split Dolly record with a context has a label in {labels_dir}")
    dolly = tuple(
        (tuple(int(t) for t in encode(record.prompt))[:max_prompt_tokens], label.answer_tokens)
        for record, label in unseen
    )
    return Pools(dolly, tuple(label.answer_tokens for _, label in joined), vocab)


def synthetic_length(rng: random.Random, cap: int) -> int:
    sigma = math.log(SYNTHETIC_P99 / SYNTHETIC_MEDIAN) / _Z99
    return max(1, min(cap, round(rng.lognormvariate(math.log(SYNTHETIC_MEDIAN), sigma))))


def scaled(answer: int, scale: float, cap: int) -> int:
    return max(1, min(cap, round(answer * scale)))


def arrivals(
    pools: Pools,
    rate_rps: float,
    duration_s: float,
    seed: int,
    *,
    answer_scale: float,
    max_prompt_tokens: int,
    max_answer_tokens: int,
    words: WordTokens | None = None,
) -> list[Request]:
    """Poisson arrivals at `rate_rps` for `duration_s`; the same (rate, seed) gives the same
    requests at the same offsets. With `words`, every prompt is text too (a synthetic prompt of
    word tokens; a Dolly one its cut text, its ids re-encoded from it)."""
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError("the rate and the duration must be > 0")
    rng = random.Random(f"federation-{seed}-{rate_rps}")
    requests: list[Request] = []
    at = rng.expovariate(rate_rps)
    while at < duration_s:
        i = len(requests)
        text: str | None = None
        if i % 2 == 0:
            prompt, answer = rng.choice(pools.dolly)
            source = "dolly_context"
            if words is not None:
                text = words.decode_ids(prompt)
                prompt = tuple(words.encode_text(text))
        else:
            length = synthetic_length(rng, max_prompt_tokens)
            if words is None:
                prompt = tuple(rng.randrange(pools.vocab) for _ in range(length))
            else:
                prompt = words.draw(rng, length)
                text = words.text(prompt, check=False)
            answer, source = rng.choice(pools.answers), "synthetic_lognormal"
        answer = scaled(answer, answer_scale, max_answer_tokens)
        requests.append(
            Request(f"r{seed}-{rate_rps:g}-{i}", source, prompt, answer, at, prompt_text=text)
        )
        at += rng.expovariate(rate_rps)
    return requests


def _stats(values: Sequence[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": round(sum(ordered) / len(ordered), 1),
        "p50": float(ordered[len(ordered) // 2]),
        "p99": float(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]),
        "max": float(ordered[-1]),
    }


def describe(requests: Sequence[Request]) -> dict[str, Any]:
    by_source: dict[str, int] = {}
    for request in requests:
        by_source[request.source] = by_source.get(request.source, 0) + 1
    return {
        "requests": len(requests),
        "by_source": by_source,
        "prompt_tokens": _stats([len(r.prompt_token_ids) for r in requests]),
        "answer_tokens": _stats([r.answer_tokens for r in requests]),
    }
