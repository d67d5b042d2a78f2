"""The `text` workload: what the length predictor adds where it has text to read (issue 34).

Every prompt is a Dolly record (instruction, and its context when it has one) and every answer
is SmolLM2-135M-Instruct's own greedy answer to it (`predictor/labels/smollm2-135m-instruct`,
in its tokens, replayed at the preset's answer scale): the prompts are real text and the lengths
the served model's, unlike the trace (seeded tokens) and the shared-prefix workload (MT-Bench
questions with lengths drawn from other prompts), where a predictor has nothing to read.

Two splits of the same corpus (`predictor.prepare.split_of`): `test` is what the sweep measures;
`train` is the traffic a deployment served before, from which the retrain path adapts its
predictor (bench/federation/adapt.py). A predictor that was never trained on Dolly
(`python -m predictor.served_build --fast --exclude-corpus dolly`) stands for a deployment whose
traffic is a kind of prompt its predictor never saw (the issue's AlpacaEval case, which is
held-out data here and not used for it).

Arrivals are Poisson at the rate for the duration, records drawn in a seeded order (cycling if a
run needs more than the split holds); the same (rate, seed, split) gives the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from bench.federation.text_tokens import WordTokens
from bench.federation.workload import LABELS_DIR, Request, scaled
from predictor.datasets import load_corpus
from predictor.prepare import split_of
from predictor.served_labels import join_records, read_labels

CORPUS: Final[Literal["dolly"]] = "dolly"
SPLITS = ("train", "test")


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str  # as sent: the record's prompt cut to the cap, through word tokens' text
    token_ids: tuple[int, ...]
    answer_tokens: int  # the served model's answer, unscaled


def text_prompts(
    words: WordTokens,
    split: str,
    max_prompt_tokens: int,
    *,
    data_dir: Path | None,
    labels_dir: Path = LABELS_DIR,
) -> tuple[TextPrompt, ...]:
    """The split's labelled Dolly records, each cut to `max_prompt_tokens` and encoded once."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    records = load_corpus(CORPUS, data_dir)
    chosen = [
        (record, label)
        for record, label in join_records(records, read_labels(labels_dir))
        if split_of(record.prompt) == split
    ]
    if not chosen:
        raise ValueError(f"no {split}-split {CORPUS} record has a label in {labels_dir}")
    prompts = []
    for record, label in chosen:
        ids = tuple(words.encode_text(record.prompt))[:max_prompt_tokens]
        text = words.decode_ids(ids)
        prompts.append(TextPrompt(text, tuple(words.encode_text(text)), label.answer_tokens))
    return tuple(prompts)


def text_requests(
    prompts: Sequence[TextPrompt],
    rate_rps: float,
    duration_s: float,
    seed: int,
    *,
    answer_scale: float,
    max_answer_tokens: int,
    split: str = "test",
) -> list[Request]:
    """Poisson arrivals at `rate_rps` for `duration_s`, prompts in a seeded order."""
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError("the rate and the duration must be > 0")
    if not prompts:
        raise ValueError("no prompts to send")
    rng = random.Random(f"text-{split}-{seed}-{rate_rps}")
    order = list(range(len(prompts)))
    rng.shuffle(order)
    requests: list[Request] = []
    at = rng.expovariate(rate_rps)
    while at < duration_s:
        i = len(requests)
        prompt = prompts[order[i % len(order)]]
        requests.append(
            Request(
                id=f"{split}-{seed}-{rate_rps:g}-{i}",
                source=f"{CORPUS}_{split}",
                prompt_token_ids=prompt.token_ids,
                answer_tokens=scaled(prompt.answer_tokens, answer_scale, max_answer_tokens),
                at_s=at,
                prompt_text=prompt.text,
            )
        )
        at += rng.expovariate(rate_rps)
    return requests
