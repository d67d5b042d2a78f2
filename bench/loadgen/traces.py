"""The synthetic Mooncake trace (`../shared/datasets/traces/
mooncake_fast25_synthetic_trace.jsonl`: multi-turn conversations from public datasets, Poisson
arrivals, 512-token prefix blocks named by `hash_ids`, 65% of prompt tokens reusable with an
unbounded cache) replayed as requests whose prompts repeat. Each block id becomes
`block_tokens` seeded word tokens (512 as in the trace; fewer at CPU scale, where every input
length is scaled by the same factor), a prompt is its blocks cut to its input length, capped at
`max_prompt_tokens` (the sites' context less the longest answer: the cut keeps the prefix, so
reuse is kept). A run at rate r takes whole conversations (requests sharing their first block),
in a seeded order, until it has r x duration requests, and compresses their trace times (the
whole trace spans 1,022 s) into the run's duration: arrivals keep the trace's shape, turns keep
their order.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen.text_tokens import WordTokens
from bench.loadgen.workload import Request, scaled

TRACE_BLOCK_TOKENS = 512  # what a hash id stands for in the Mooncake traces
# Room left in front of every prompt (the federation bench put a per-arm marker there).
MARKER_TOKENS = 4


@dataclass(frozen=True, slots=True)
class TraceRecord:
    at_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> list[TraceRecord]:
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            raw = json.loads(line)
            records.append(
                TraceRecord(
                    int(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                )
            )
    if not records:
        raise ValueError(f"no request in {path}")
    return records


@dataclass(frozen=True, slots=True)
class Shape:
    """How the trace is cut to the sites: block tokens per trace block id, prompt and answer
    caps, the share of each answer replayed."""

    block_tokens: int
    max_prompt_tokens: int
    max_answer_tokens: int
    answer_scale: float


def trace_requests(
    records: Sequence[TraceRecord],
    words: WordTokens,
    rate_rps: float,
    duration_s: float,
    seed: int,
    shape: Shape,
) -> list[Request]:
    """The module docstring's run at `rate_rps` for `duration_s`."""
    families: dict[int, list[TraceRecord]] = defaultdict(list)
    for record in records:
        families[record.hash_ids[0]].append(record)
    order = sorted(families)
    random.Random(f"trace-{seed}").shuffle(order)
    wanted = max(1, round(rate_rps * duration_s))
    chosen: list[TraceRecord] = []
    for first in order:
        if len(chosen) >= wanted:
            break
        chosen.extend(families[first])
    chosen.sort(key=lambda r: r.at_ms)
    span_ms = max(1, max(r.at_ms for r in records))
    factor = shape.block_tokens / TRACE_BLOCK_TOKENS
    cap = shape.max_prompt_tokens - MARKER_TOKENS
    blocks: dict[int, tuple[tuple[int, ...], str]] = {}
    requests = []
    for i, record in enumerate(chosen):
        length = min(cap, max(1, round(record.input_length * factor)))
        whole, part = divmod(length, shape.block_tokens)
        ids: list[int] = []
        texts: list[str] = []
        for n, block in enumerate(record.hash_ids[: whole + (part > 0)]):
            if block not in blocks:
                drawn = words.draw(random.Random(f"trace-{seed}-{block}"), shape.block_tokens)
                blocks[block] = drawn, words.text(drawn, check=False)
            tokens, text = blocks[block]
            if n < whole:
                ids.extend(tokens)
                texts.append(text)
            else:  # the partial last block
                ids.extend(tokens[:part])
                texts.append(words.text(tokens[:part], check=False))
        requests.append(
            Request(
                id=f"trace-{i}",
                source="mooncake_trace",
                prompt_token_ids=tuple(ids),
                answer_tokens=scaled(
                    record.output_length, shape.answer_scale, shape.max_answer_tokens
                ),
                at_s=record.at_ms / span_ms * duration_s,
                prompt_text="".join(texts),
            )
        )
    if requests:  # every word token encodes alone; the first prompt whole, to be sure
        words.text(requests[0].prompt_token_ids)
    return requests
