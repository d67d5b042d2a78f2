"""Workloads whose prompts repeat: what prefix-aware routing is measured on.

- `trace`: the synthetic Mooncake trace (`../shared/datasets/traces/
  mooncake_fast25_synthetic_trace.jsonl`: multi-turn conversations from public datasets,
  Poisson arrivals, 512-token prefix blocks named by `hash_ids`, 65% of prompt tokens reusable
  with an unbounded cache). Each block id becomes `block_tokens` seeded word tokens (512 as in
  the trace; fewer at CPU scale, where every input length is scaled by the same factor), a prompt
  is its blocks cut to its input length, capped at `max_prompt_tokens` (the sites' context less
  the longest answer: the cut keeps the prefix, so reuse is kept). A run at rate r takes whole
  conversations (requests sharing their first block), in a seeded order, until it has r x
  duration requests, and compresses their trace times (the whole trace spans 1,022 s) into the
  run's duration: arrivals keep the trace's shape, turns keep their order.
- `shared_prefix`: MT-Bench's two-turn conversations behind one system prompt of
  `system_tokens` seeded word tokens (4,096 on the GPU), as deployments put one in front of every
  request; conversations arrive open loop (Poisson at half the rate), the second turn a seeded
  think time after the first, re-sending the first turn and a fixed answer; each conversation
  sends its session id as `user`. The served model's answers to MT-Bench are not available here:
  answer lengths are drawn from SmolLM2's own answer lengths on other prompts
  (predictor/labels), so a predictor has no signal on them (said in the report).

Every arm's run puts a marker of its own (MARKER_TOKENS word tokens) in front of every prompt:
sites keep their caches from run to run, and the same prompts would let a later arm hit what an
earlier one left there. Prompts, arrivals, lengths and which blocks repeat are the same for every
arm of a rate.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import takewhile
from pathlib import Path

from bench.federation.text_tokens import WordTokens
from bench.federation.workload import LABELS_DIR, Request, scaled
from fedllm_contract.block_hash import block_hashes
from predictor.served_labels import read_labels

TRACE_BLOCK_TOKENS = 512  # what a hash id stands for in the Mooncake traces
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
    """How a workload is cut to the sites: block tokens per trace block id, prompt and answer
    caps, the share of each answer replayed, the system prompt's length."""

    block_tokens: int
    max_prompt_tokens: int
    max_answer_tokens: int
    answer_scale: float
    system_tokens: int


def trace_requests(
    records: Sequence[TraceRecord],
    words: WordTokens,
    rate_rps: float,
    duration_s: float,
    seed: int,
    shape: Shape,
) -> list[Request]:
    """The module docstring's `trace` run at `rate_rps` for `duration_s`."""
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


def read_mt_bench(path: Path) -> list[tuple[str, str]]:
    questions = []
    for line in path.read_text().splitlines():
        if line.strip():
            turns = json.loads(line)["turns"]
            questions.append((str(turns[0]), str(turns[1])))
    if not questions:
        raise ValueError(f"no question in {path}")
    return questions


def served_answer_lengths(labels_dir: Path = LABELS_DIR) -> tuple[int, ...]:
    """SmolLM2's own answer lengths (every labelled prompt), for prompts it never answered."""
    return tuple(label.answer_tokens for label in read_labels(labels_dir))


THINK_S = 2.0  # mean think time between a conversation's two turns


def shared_prefix_requests(
    questions: Sequence[tuple[str, str]],
    answers: Sequence[int],
    words: WordTokens,
    rate_rps: float,
    duration_s: float,
    seed: int,
    shape: Shape,
) -> list[Request]:
    """The module docstring's `shared_prefix` run: conversations arrive at rate / 2 per second
    for `duration_s`, each a first and a second turn."""
    rng = random.Random(f"shared-{seed}-{rate_rps}")
    system_ids = words.draw(random.Random(f"system-{seed}"), shape.system_tokens)
    system = words.text(system_ids)
    encode = words.encode_text
    requests: list[Request] = []
    at = rng.expovariate(rate_rps / 2)
    conversation = question = 0
    while at < duration_s:
        answer_1 = scaled(rng.choice(answers), shape.answer_scale, shape.max_answer_tokens)
        answer_2 = scaled(rng.choice(answers), shape.answer_scale, shape.max_answer_tokens)
        said_ids = words.draw(random.Random(f"answer-{seed}-{conversation}"), answer_1)
        said = words.text(said_ids, check=False)
        for _ in questions:  # the next question whose conversation fits the context
            first_q, second_q = questions[question % len(questions)]
            question += 1
            # Text pieces meet where a byte-level BPE cuts anyway (a word, then a newline or a
            # colon then a word): the ids of the whole are the pieces' ids, end to end.
            ask_1, ask_2 = (
                f"\n\nUser: {first_q}\n\nAssistant:",
                f"\n\nUser: {second_q}\n\nAssistant:",
            )
            ids_1 = (*system_ids, *encode(ask_1))
            ids_2 = (*ids_1, *said_ids, *encode(ask_2))
            if len(ids_2) <= shape.max_prompt_tokens - MARKER_TOKENS:
                break
        else:
            raise ValueError("no MT-Bench conversation fits the prompt cap (system prompt?)")
        turn_1 = system + ask_1
        turn_2 = turn_1 + said + ask_2
        if conversation == 0 and tuple(encode(turn_2)) != ids_2:
            raise ValueError("the conversation's pieces do not tokenize as its whole")
        turns = (
            (turn_1, ids_1, answer_1, at),
            (turn_2, ids_2, answer_2, at + rng.expovariate(1 / THINK_S)),
        )
        for turn, (text, ids, answer, when) in enumerate(turns, start=1):
            requests.append(
                Request(
                    id=f"mt-{conversation}-{turn}",
                    source=f"mt_bench_turn{turn}",
                    prompt_token_ids=ids,
                    answer_tokens=answer,
                    at_s=when,
                    prompt_text=text,
                    session=f"conv-{conversation}",
                )
            )
        conversation += 1
        at += rng.expovariate(rate_rps / 2)
    return sorted(requests, key=lambda r: r.at_s)


def for_run(requests: Sequence[Request], words: WordTokens, salt: str) -> list[Request]:
    """The requests as one arm's run sends them: each prompt behind the run's own marker, each
    session and id named after the run."""
    marker = words.draw(random.Random(f"marker-{salt}"), MARKER_TOKENS)
    text = words.text(marker)
    return [
        replace(
            request,
            id=f"{salt}-{request.id}",
            prompt_token_ids=(*marker, *request.prompt_token_ids),
            prompt_text=None if request.prompt_text is None else text + request.prompt_text,
            session=None if request.session is None else f"{salt}-{request.session}",
        )
        for request in requests
    ]


def reusable_share(requests: Sequence[Request], block_tokens: int) -> float:
    """Prompt tokens in full blocks that an earlier prompt began with too (a single unbounded
    cache, in arrival order): the most any routing could save."""
    seen: set[int] = set()
    reused = total = 0
    for request in sorted(requests, key=lambda r: r.at_s):
        total += len(request.prompt_token_ids)
        ids = block_hashes(request.prompt_token_ids, block_tokens, 0)
        run = len(list(takewhile(seen.__contains__, ids)))
        reused += run * block_tokens
        seen.update(ids)
    return reused / total if total else 0.0
