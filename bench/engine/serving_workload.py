"""The two prompt mixes of the serving benchmark, with the same answers.

Both mixes replay chat-length answers: request i of either mix answers with the same number of
tokens, drawn from LIMA's reference answers (GPT-2 tokens, capped), replayed with ignore_eos.
Only the prompts differ:

- short: real chat prompts, Alpaca (uniform random rows) and GSM8K questions, half each;
- long: Dolly records that carry a context (instruction + context), and synthetic prompts whose
  lengths are log-normal with median 250 and p99 3,000 tokens (random token ids), half each.

Prompt and answer pools are encoded once (`PromptPools`); each rate of the sweep then draws its
own requests from them with a rate-specific seed (with replacement: the Dolly pool has only 434
records with a context).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bench.engine.metrics import percentile
from fedsim.engine_trace import WorkloadRequest
from predictor.datasets import load_corpus

Mix = Literal["short", "long"]
MIXES: tuple[Mix, ...] = ("short", "long")
Encode = Callable[[str], Sequence[int]]

# Log-normal prompt lengths of the synthetic half of the long mix: median 250, p99 3,000.
SYNTHETIC_MEDIAN = 250
SYNTHETIC_P99 = 3000
_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True, slots=True)
class PromptPools:
    """Encoded prompts of each source and the answer lengths, ready to draw from."""

    alpaca: tuple[tuple[int, ...], ...]
    gsm8k: tuple[tuple[int, ...], ...]
    dolly_context: tuple[tuple[int, ...], ...]
    answers: tuple[int, ...]  # LIMA reference answer lengths, capped
    vocab: int
    max_prompt_tokens: int
    max_answer_tokens: int


def load_pools(
    encode: Encode,
    vocab: int,
    data_dir: str | Path | None = None,
    *,
    max_prompt_tokens: int = 3072,
    max_answer_tokens: int = 1024,
) -> PromptPools:
    def encoded(texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        prompts = (tuple(int(t) for t in encode(text))[:max_prompt_tokens] for text in texts)
        return tuple(p for p in prompts if p)

    dolly = [r for r in load_corpus("dolly", data_dir) if "\n\n" in r.prompt]
    answers = [len(encode(r.response)) for r in load_corpus("lima", data_dir)]
    return PromptPools(
        alpaca=encoded([r.prompt for r in load_corpus("alpaca_random", data_dir)]),
        gsm8k=encoded([r.prompt for r in load_corpus("gsm8k", data_dir)]),
        dolly_context=encoded([r.prompt for r in dolly]),
        answers=tuple(max(1, min(n, max_answer_tokens)) for n in answers if n > 0),
        vocab=vocab,
        max_prompt_tokens=max_prompt_tokens,
        max_answer_tokens=max_answer_tokens,
    )


def synthetic_length(rng: random.Random, cap: int) -> int:
    sigma = math.log(SYNTHETIC_P99 / SYNTHETIC_MEDIAN) / _Z99
    return max(1, min(cap, round(rng.lognormvariate(math.log(SYNTHETIC_MEDIAN), sigma))))


def build_mix(pools: PromptPools, mix: Mix, count: int, seed: int) -> list[WorkloadRequest]:
    """`count` requests of `mix`; the answer lengths depend only on (count, seed), not on the
    mix, so the two mixes of one seed replay the same answers."""
    answer_rng = random.Random(f"answers-{seed}")
    answers = [answer_rng.choice(pools.answers) for _ in range(count)]
    rng = random.Random(f"{mix}-{seed}")
    requests = []
    for i, answer in enumerate(answers):
        if mix == "short":
            corpus, pool = ("alpaca_random", pools.alpaca) if i % 2 == 0 else ("gsm8k", pools.gsm8k)
            index = rng.randrange(len(pool))
            prompt = pool[index]
        elif i % 2 == 0:
            corpus = "dolly_context"
            index = rng.randrange(len(pools.dolly_context))
            prompt = pools.dolly_context[index]
        else:
            corpus, index = "synthetic_lognormal", i
            length = synthetic_length(rng, pools.max_prompt_tokens)
            prompt = tuple(rng.randrange(pools.vocab) for _ in range(length))
        requests.append(
            WorkloadRequest(
                request_id=f"{mix}-{seed}-{i}",
                corpus=corpus,
                record_index=index,
                prompt_token_ids=prompt,
                output_tokens=answer,
                reference_output_tokens=answer,
                prompt_truncated=len(prompt) >= pools.max_prompt_tokens,
            )
        )
    return requests


def _stats(values: Sequence[int]) -> dict[str, float]:
    floats = [float(v) for v in values]
    return {
        "mean": sum(floats) / len(floats),
        "p50": percentile(floats, 50),
        "p99": percentile(floats, 99),
        "max": max(floats),
    }


def describe_mix(requests: Sequence[WorkloadRequest]) -> dict[str, Any]:
    by_corpus: dict[str, int] = {}
    for request in requests:
        by_corpus[request.corpus] = by_corpus.get(request.corpus, 0) + 1
    return {
        "requests": len(requests),
        "by_source": by_corpus,
        "prompt_tokens": _stats([len(r.prompt_token_ids) for r in requests]),
        "answer_tokens": _stats([r.output_tokens for r in requests]),
    }
