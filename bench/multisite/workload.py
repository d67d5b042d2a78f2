"""The queries the benchmark replays: random Alpaca rows with their true response lengths.

Each query is the record's prompt text (the gateway tokenizes it and the predictor reads it) and
the length of its reference answer in the serving model's tokens (GPT-2 BPE), replayed exactly:
`ignore_eos` with max_tokens = that length. Records whose prompt + answer do not fit the served
model's context are skipped (counted in the description), never truncated, so every replayed
length is a real one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictor.datasets import Corpus, PromptRecord, load_corpus

Encode = Callable[[str], Sequence[int]]
CORPUS: Corpus = "alpaca_random"


@dataclass(frozen=True, slots=True)
class Query:
    id: str
    prompt: str
    prompt_tokens: int
    answer_tokens: int  # the reference answer's length: replayed as max_tokens with ignore_eos

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    queries: tuple[Query, ...]
    skipped_too_long: int  # records drawn but left out: prompt + answer over the context
    answer_cap: int | None  # answers cut to this length (quick runs only); None: true lengths

    def describe(self) -> dict[str, Any]:
        answers = sorted(q.answer_tokens for q in self.queries)
        return {
            "corpus": CORPUS,
            "queries": len(self.queries),
            "prompt_tokens": sum(q.prompt_tokens for q in self.queries),
            "answer_tokens": sum(answers),
            "answer_mean": sum(answers) / len(answers),
            "answer_p50": answers[len(answers) // 2],
            "answer_p90": answers[int(0.9 * (len(answers) - 1))],
            "answer_max": answers[-1],
            "skipped_too_long": self.skipped_too_long,
            "answer_cap": self.answer_cap,
            "replay": "ignore_eos, greedy, max_tokens = the reference answer's length",
        }


def draw_queries(
    records: Sequence[PromptRecord],
    count: int,
    encode: Encode,
    *,
    max_total_tokens: int,
    seed: int,
    answer_cap: int | None = None,
) -> Workload:
    """`count` records drawn without replacement in a seeded order (the arrival order)."""
    if count < 1:
        raise ValueError(f"the workload needs at least one query, got {count}")
    order = list(records)
    random.Random(seed).shuffle(order)
    queries: list[Query] = []
    skipped = 0
    for record in order:
        if len(queries) == count:
            break
        prompt_tokens = len(encode(record.prompt))
        answer = max(1, len(encode(record.response)))
        if answer_cap is not None:
            answer = min(answer, answer_cap)
        if prompt_tokens == 0 or prompt_tokens + answer > max_total_tokens:
            skipped += 1
            continue
        queries.append(
            Query(f"{record.corpus}-{record.index}", record.prompt, prompt_tokens, answer)
        )
    if len(queries) < count:
        raise ValueError(f"only {len(queries)} usable {CORPUS} records, {count} were asked for")
    return Workload(tuple(queries), skipped, answer_cap)


def load_workload(
    count: int,
    encode: Encode,
    *,
    max_total_tokens: int,
    seed: int,
    data_dir: Path | None = None,
    answer_cap: int | None = None,
) -> Workload:
    return draw_queries(
        load_corpus(CORPUS, data_dir),
        count,
        encode,
        max_total_tokens=max_total_tokens,
        seed=seed,
        answer_cap=answer_cap,
    )


def skewed(workload: Workload, long_share: float, burst: int, seed: int) -> Workload:
    """The same queries in a skewed arrival order: the longest `long_share` of the answers
    arrive in bursts of `burst` back-to-back queries, the bursts spread through the stream of
    short ones (each burst at a random position)."""
    if not 0 < long_share < 1 or burst < 1:
        raise ValueError("long_share must be in (0, 1) and burst >= 1")
    ranked = sorted(workload.queries, key=lambda q: -q.answer_tokens)
    cut = max(1, round(long_share * len(ranked)))
    long, short = ranked[:cut], list(ranked[cut:])
    rng = random.Random(seed)
    rng.shuffle(long)
    rng.shuffle(short)
    bursts = [long[i : i + burst] for i in range(0, len(long), burst)]
    slots = sorted(rng.sample(range(len(short) + 1), k=len(bursts)) if bursts else [])
    ordered: list[Query] = []
    at = 0
    for slot, group in zip(slots, bursts, strict=True):
        ordered.extend(short[at:slot])
        ordered.extend(group)
        at = slot
    ordered.extend(short[at:])
    return Workload(tuple(ordered), workload.skipped_too_long, workload.answer_cap)
