"""The requests one run replays, built once from a seed and replayed identically by the real
federation and by fedsim (bench/federation_real/sim.py): the same arrival offsets, prompt token
ids and answer lengths.

Sources (`--workload`):
- `sharegpt`: fedsim's ShareGPT-like lengths (fedsim.workload.sharegpt_lengths: log-normal
  prompts, median 180 tokens, and answers, median 220) with Poisson arrivals at the rate for the
  duration; every prompt's ids drawn afresh (nothing shared).
- a path to a trace: `.jsonl` in the Mooncake format (timestamp ms, input_length,
  output_length, hash_ids: one id a 512-token block, shared ids are shared prefixes) or an
  Azure LLM inference `.csv` (arrival times and lengths, no blocks). Whole conversations of the
  Mooncake trace (requests sharing their first block) in a seeded order until there are rate x
  duration requests (of the Azure trace, consecutive requests from a seeded offset), their trace
  times compressed into the duration (the trace's shape kept); a block id becomes
  `block_tokens` ids drawn from a seed of the block, so prompts that share blocks share token ids
  and the sites' prefix caches hit.

Lengths are scaled by the preset's factor (CPU scale) and capped. Prompts are token ids within
the tokenizer's vocabulary, sent as ids. Answers are replayed exactly (`ignore_eos`, max_tokens
= the length): a gateway without a predictor plans with max_tokens, so routing knows every
answer's length on both sides (the predictor's error is not part of this check).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.loadgen.workload import Request
from fedsim.traces import Lengths, azure_lengths, jsonl_lengths
from fedsim.workload import sharegpt_lengths

# Prompt ids come from [FIRST_ID, vocab - 1): clear of byte tokens and of GPT-2's end of text.
FIRST_ID = 256
# Per arm, ids in front of every prompt: each arm's prompts hash to blocks of their own, so an
# arm never hits what an earlier arm left in the sites' caches (fedsim runs each arm afresh).
MARKER_TOKENS = 4


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    source: str  # "sharegpt" or a trace's path
    rate_rps: float
    duration_s: float
    seed: int
    vocab: int
    length_scale: float
    max_prompt_tokens: int
    max_answer_tokens: int
    block_tokens: int

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "rate_rps": self.rate_rps,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "vocab": self.vocab,
            "length_scale": self.length_scale,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_answer_tokens": self.max_answer_tokens,
            "block_tokens": self.block_tokens,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> WorkloadSpec:
        return cls(**data)  # type: ignore[arg-type]


def _scaled(value: int, scale: float, cap: int) -> int:
    return max(1, min(cap, round(value * scale)))


def _trace(spec: WorkloadSpec, count: int) -> tuple[list[Lengths], list[float]]:
    path = Path(spec.source)
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {path} (--workload sharegpt or a trace file)")
    rows = jsonl_lengths(path) if path.suffix == ".jsonl" else azure_lengths(path)
    if len(rows) < count:
        raise ValueError(f"{path} holds {len(rows)} requests, the run needs {count}")
    rng = random.Random(f"trace-offset-{spec.seed}")
    if any(r.hash_ids for r in rows):
        # Whole conversations (requests sharing their first block), in a seeded order, until
        # there are enough: a window of consecutive requests of a trace interleaving thousands
        # of conversations shares almost nothing (bench/loadgen/traces.py does the same).
        families: dict[int, list[Lengths]] = {}
        for row in rows:
            families.setdefault(row.hash_ids[0] if row.hash_ids else -1, []).append(row)
        order = sorted(families)
        rng.shuffle(order)
        chosen: list[Lengths] = []
        for first in order:
            if len(chosen) >= count:
                break
            chosen.extend(families[first])
        chosen.sort(key=lambda r: r.at_s)
    else:
        start = rng.randrange(len(rows) - count + 1)
        chosen = rows[start : start + count]
    span = max(chosen[-1].at_s - chosen[0].at_s, 1e-9)
    times = [(r.at_s - chosen[0].at_s) * spec.duration_s / span for r in chosen]
    return chosen, times


def _poisson(spec: WorkloadSpec, count: int) -> list[float]:
    rng = random.Random(f"arrivals-{spec.seed}")
    at, times = 0.0, []
    for _ in range(count):
        at += rng.expovariate(spec.rate_rps)
        times.append(at)
    return times


def build(spec: WorkloadSpec) -> list[Request]:
    """The run's requests (the module docstring), in arrival order."""
    if spec.rate_rps <= 0 or spec.duration_s <= 0:
        raise ValueError("the rate and the duration must be > 0")
    if spec.vocab <= FIRST_ID + 1:
        raise ValueError(f"a vocabulary of {spec.vocab} ids leaves none for prompts")
    count = max(1, round(spec.rate_rps * spec.duration_s))
    if spec.source == "sharegpt":
        lengths, times = sharegpt_lengths(count, spec.seed), _poisson(spec, count)
    else:
        lengths, times = _trace(spec, count)
    rng = random.Random(f"prompts-{spec.seed}")
    blocks: dict[int, list[int]] = {}
    requests = []
    for i, (row, at) in enumerate(zip(lengths, times, strict=True)):
        prompt = _scaled(row.prompt, spec.length_scale, spec.max_prompt_tokens - MARKER_TOKENS)
        ids: list[int] = []
        for block in row.hash_ids:
            if len(ids) >= prompt:
                break
            if block not in blocks:
                draw = random.Random(f"block-{spec.seed}-{block}")
                blocks[block] = [
                    draw.randrange(FIRST_ID, spec.vocab - 1) for _ in range(spec.block_tokens)
                ]
            ids.extend(blocks[block])
        ids.extend(rng.randrange(FIRST_ID, spec.vocab - 1) for _ in range(prompt - len(ids)))
        requests.append(
            Request(
                id=f"q{i}",
                source="trace" if row.hash_ids else spec.source,
                prompt_token_ids=tuple(ids[:prompt]),
                answer_tokens=_scaled(row.answer, spec.length_scale, spec.max_answer_tokens),
                at_s=at,
            )
        )
    return requests


def marked(requests: Sequence[Request], arm: str, vocab: int) -> list[Request]:
    """The requests with the arm's marker ids in front of every prompt."""
    digest = hashlib.sha256(arm.encode()).digest()
    marker = tuple(FIRST_ID + int.from_bytes(digest[2 * i : 2 * i + 2]) % (vocab - FIRST_ID - 1)
                   for i in range(MARKER_TOKENS))  # fmt: skip
    return [replace(r, prompt_token_ids=marker + r.prompt_token_ids) for r in requests]


def fingerprint(requests: Sequence[Request]) -> str:
    """A digest of what the requests are (arrivals to the microsecond, ids, lengths): the
    simulated replay checks that it rebuilt the very requests the real run sent."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([round(r.at_s * 1e6), r.answer_tokens, r.prompt_token_ids]).encode())
    return h.hexdigest()[:16]


def describe(requests: Sequence[Request]) -> dict[str, object]:
    prompts = sorted(len(r.prompt_token_ids) for r in requests)
    answers = sorted(r.answer_tokens for r in requests)
    return {
        "requests": len(requests),
        "span_s": max(r.at_s for r in requests) if requests else 0.0,
        "prompt_tokens_p50": prompts[len(prompts) // 2] if prompts else 0,
        "prompt_tokens_mean": sum(prompts) / max(len(prompts), 1),
        "answer_tokens_p50": answers[len(answers) // 2] if answers else 0,
        "answer_tokens_mean": sum(answers) / max(len(answers), 1),
        "shared_prefix_requests": sum(r.source == "trace" for r in requests),
    }
