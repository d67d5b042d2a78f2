"""The prefix-caching benchmark's workloads, as sessions of turns with arrival times.

- shared: MT-Bench two-turn conversations behind one system prompt common to all (seeded random
  tokens, as long as the preset says: 4,096 on the GPU). A session arrives on a Poisson clock;
  its second turn is sent the moment its first answer is complete and re-sends everything:
  system prompt, question 1, the engine's own answer, question 2.
- trace: the synthetic Mooncake trace (FAST'25), every request in order. Each hash id becomes
  512 tokens drawn from a generator seeded by the id, a prompt is its blocks concatenated and
  cut to min(input_length, cap), answers are min(output_length, output cap). The trace is
  replayed once per arm, cut into consecutive parts, one per rate: part k's arrival times are
  the trace's own, shifted to start at 0 and scaled so its mean rate is rate k.
- noreuse: ShareGPT-shaped single-turn requests (log-normal prompt and answer lengths) of random
  tokens: nothing to reuse, what caching costs when it cannot help.

`lru_bound` is the reuse a single LRU cache of a given capacity allows on the trace as
replayed (arrival order, the engine's block size, a hit never covers a prompt's last token).
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen.traces import TRACE_BLOCK_TOKENS as TRACE_BLOCK
from bench.loadgen.traces import TraceRecord

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile
Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class Turn:
    # Tokens this turn adds after everything before it (earlier turns and their answers).
    tail: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    arrival_s: float
    prefix: tuple[int, ...]  # before the first turn's tail (the common system prompt)
    turns: tuple[Turn, ...]


def poisson_times(count: int, rate: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _lognormal(rng: random.Random, median: float, p99: float, cap: int) -> int:
    sigma = math.log(p99 / median) / _Z99
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def load_mt_bench(path: Path, encode: Encode) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The two user turns of every MT-Bench question, encoded."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(tuple(encode(r["turns"][0])), tuple(encode(r["turns"][1]))) for r in rows]


def shared_sessions(
    questions: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    system_tokens: int,
    vocab: int,
    rate: float,
    window_s: float,
    answers: tuple[int, int],
    seed: int,
) -> list[Session]:
    """rate * window_s conversations (at least 2) behind one system prompt."""
    system_rng = random.Random(f"system-prompt-{system_tokens}")
    system = tuple(system_rng.randrange(vocab) for _ in range(system_tokens))
    rng = random.Random(f"shared-{seed}-{rate}")
    count = max(2, round(rate * window_s))
    sessions = []
    for i, arrival in enumerate(poisson_times(count, rate, rng)):
        first, second = questions[rng.randrange(len(questions))]
        turns = tuple(Turn(tail, rng.randint(*answers)) for tail in (first, second))
        sessions.append(Session(f"mt-{rate:g}-{i}", arrival, system, turns))
    return sessions


def noreuse_sessions(
    *, vocab: int, rate: float, window_s: float, max_prompt: int, max_answer: int, seed: int
) -> list[Session]:
    """ShareGPT-shaped lengths (prompts median 160 / p99 1,500 tokens, answers median 120 /
    p99 600), random tokens."""
    rng = random.Random(f"noreuse-{seed}-{rate}")
    count = max(2, round(rate * window_s))
    sessions = []
    for i, arrival in enumerate(poisson_times(count, rate, rng)):
        prompt = tuple(rng.randrange(vocab) for _ in range(_lognormal(rng, 160, 1500, max_prompt)))
        answer = _lognormal(rng, 120, 600, max_answer)
        sessions.append(Session(f"nr-{rate:g}-{i}", arrival, (), (Turn(prompt, answer),)))
    return sessions


class TraceTokens:
    """The 512 tokens of each hash id, drawn once from a generator seeded by the id."""

    def __init__(self, vocab: int) -> None:
        self._vocab = vocab
        self._blocks: dict[int, tuple[int, ...]] = {}

    def block(self, hash_id: int) -> tuple[int, ...]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = random.Random(f"mooncake-block-{hash_id}")
            tokens = tuple(rng.randrange(self._vocab) for _ in range(TRACE_BLOCK))
            self._blocks[hash_id] = tokens
        return tokens

    def prompt(self, row: TraceRecord, cap: int) -> tuple[int, ...]:
        length = min(row.input_length, cap)
        blocks = row.hash_ids[: -(-length // TRACE_BLOCK)]
        return tuple(t for h in blocks for t in self.block(h))[:length]


def trace_parts(rows: Sequence[TraceRecord], parts: int) -> list[Sequence[TraceRecord]]:
    """The trace cut into `parts` consecutive slices of (nearly) equal request counts."""
    size = -(-len(rows) // parts)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def trace_sessions(
    rows: Sequence[TraceRecord],
    tokens: TraceTokens,
    *,
    rate: float,
    cap: int,
    max_answer: int,
    label: str,
) -> tuple[list[Session], float]:
    """One part of the trace at mean `rate`; returns its sessions and the speed-up applied to
    the trace's clock (trace seconds per replayed second)."""
    start = rows[0].at_ms
    span_s = (rows[-1].at_ms - start) / 1000
    native = (len(rows) - 1) / span_s if span_s > 0 else rate
    scale = native / rate  # replayed seconds per trace second
    sessions = [
        Session(
            f"{label}-{i}",
            (row.at_ms - start) / 1000 * scale,
            (),
            (Turn(tokens.prompt(row, cap), max(1, min(row.output_length, max_answer))),),
        )
        for i, row in enumerate(rows)
    ]
    return sessions, 1 / scale


def lru_bound(
    rows: Sequence[TraceRecord], cap: int, capacity_tokens: float, block_size: int
) -> dict[str, Any]:
    """Prompt tokens a single LRU cache of `capacity_tokens` could skip on the trace (inputs
    capped at `cap`), in arrival order, with the engine's blocks of `block_size` tokens (a
    divisor of 512): the cut-off last 512-token block of a capped prompt is shared at that
    granularity, as the engine shares it. `math.inf`: unbounded."""
    if TRACE_BLOCK % block_size:
        raise ValueError(f"block_size must divide {TRACE_BLOCK}, got {block_size}")
    per_id = TRACE_BLOCK // block_size
    capacity = capacity_tokens / block_size
    held: OrderedDict[tuple[int, int], None] = OrderedDict()
    offered = hits = 0
    for row in rows:
        length = min(row.input_length, cap)
        offered += length
        keys = [(row.hash_ids[k // per_id], k % per_id) for k in range(length // block_size)]
        found = 0
        for key in keys[: (length - 1) // block_size]:
            if key not in held:
                break
            found += 1
        hits += found * block_size
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > capacity:
            held.popitem(last=False)
    return {
        "capacity_tokens": None if math.isinf(capacity_tokens) else int(capacity_tokens),
        "offered_tokens": offered,
        "hit_tokens": hits,
        "computed_over_offered": (offered - hits) / offered if offered else None,
    }
