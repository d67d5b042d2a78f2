"""Request traces from the shared corpora: prompt and response lengths in the serving tokenizer."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from fedllm_contract.tokenizer import load_tokenizer
from predictor.datasets import Corpus, load_corpus


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_tokens: int


def load_trace(
    corpus: Corpus,
    count: int,
    tokenizer_dir: Path,
    *,
    max_total_tokens: int,
    seed: int = 0,
    data_dir: Path | None = None,
) -> list[TraceRequest]:
    """`count` random records; each replays its reference answer's length (prompt + answer are
    clipped to `max_total_tokens`, the served model's context)."""
    records = load_corpus(corpus, data_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    trace = []
    for index, record in enumerate(rng.sample(records, count)):
        prompt = tuple(tokenizer.encode(record.prompt))[: max_total_tokens // 2]
        output = max(1, min(len(tokenizer.encode(record.response)), max_total_tokens - len(prompt)))
        trace.append(TraceRequest(f"{corpus}-{index}", prompt, output))
    return trace
