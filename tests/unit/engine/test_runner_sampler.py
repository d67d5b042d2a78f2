"""Sampler: greedy, temperature, top-p and per-request seeds, on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.sampler import Sampler, apply_top_p, step_seed


def chunk(request_id: str, sampling: SamplingParams, num_generated: int = 0) -> ScheduledChunk:
    return ScheduledChunk(request_id, (1,), 0, (0,), True, sampling, num_generated)


def random_logits(rows: int, vocab: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits(6)
    chunks = [chunk(str(i), SamplingParams(max_tokens=1, temperature=0.0)) for i in range(6)]
    assert Sampler().sample(logits, chunks) == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_next_to_sampled_rows() -> None:
    logits = random_logits(4)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    hot = SamplingParams(max_tokens=1, temperature=5.0)
    tokens = Sampler().sample(logits, [chunk("a", greedy), chunk("b", hot)] * 2)
    argmax = logits.argmax(dim=-1).tolist()
    assert (tokens[0], tokens[2]) == (argmax[0], argmax[2])


def test_tiny_top_p_always_takes_top_token() -> None:
    logits = random_logits(200, seed=1)
    params = SamplingParams(max_tokens=1, temperature=1.5, top_p=1e-6)
    tokens = Sampler().sample(logits, [chunk(str(i), params) for i in range(200)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3]])
    kept = apply_top_p(probs, torch.tensor([0.6, 0.5]))
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.5, 0.3], [0.0, 0.5, 0.0]]))


@pytest.mark.parametrize(
    ("temperature", "top_p", "expected"),
    [
        (1.0, 1.0, [0.5, 0.3, 0.2]),
        (
            2.0,
            1.0,
            [math.sqrt(p) / sum(math.sqrt(q) for q in (0.5, 0.3, 0.2)) for p in (0.5, 0.3, 0.2)],
        ),
        (1.0, 0.6, [0.625, 0.375, 0.0]),
    ],
)
def test_sampled_frequencies_follow_the_distribution(
    temperature: float, top_p: float, expected: list[float]
) -> None:
    rows = 20_000
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(rows, 3)
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor(sampler.sample(logits, [chunk(str(i), params) for i in range(rows)]))
    frequencies = torch.bincount(tokens, minlength=3).double() / rows
    torch.testing.assert_close(frequencies, torch.tensor(expected).double(), atol=0.015, rtol=0)


def test_seeded_row_is_independent_of_the_batch() -> None:
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=42)
    logits = random_logits(5, seed=3)
    alone = [
        Sampler().sample(logits[2:3], [chunk("s", seeded, num_generated=step)])[0]
        for step in range(8)
    ]
    others = [
        chunk("g", SamplingParams(max_tokens=8, temperature=0.0)),
        chunk("u", SamplingParams(max_tokens=8)),
        chunk("o", SamplingParams(max_tokens=8, seed=7)),
        chunk("t", SamplingParams(max_tokens=8, temperature=0.3, top_p=0.5)),
    ]
    sampler = Sampler(generator=torch.Generator().manual_seed(123))
    batched = []
    for step in range(8):
        batch = [*others[:2], chunk("s", seeded, num_generated=step), *others[2:]]
        batched.append(sampler.sample(logits, batch)[2])
    assert batched == alone
    assert len(set(alone)) > 1  # the stream advances with num_generated


def test_step_seed_is_stable_and_spreads() -> None:
    assert step_seed(1, 0) == step_seed(1, 0)
    seeds = {step_seed(seed, step) for seed in range(20) for step in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert step_seed(2**64 + 5, 3) == step_seed(5, 3)  # seeds are taken modulo 2**64


def test_forget_drops_seeded_state() -> None:
    sampler = Sampler()
    seeded = SamplingParams(max_tokens=1, seed=1)
    sampler.sample(random_logits(2), [chunk("a", seeded), chunk("b", seeded)])
    assert sampler.num_tracked_requests == 2
    sampler.forget(["a", "unknown"])
    assert sampler.num_tracked_requests == 1


def test_row_count_must_match() -> None:
    with pytest.raises(ValueError, match="2 logit rows for 1 rows"):
        Sampler().sample(random_logits(2), [chunk("a", SamplingParams(max_tokens=1))])


def test_a_continuation_counts_its_steps_from_the_tokens_generated_before() -> None:
    """An answer continued on another site after 3 tokens samples its next token with the
    random stream the original site would have used for step 3."""
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=42)
    continued = SamplingParams(max_tokens=5, temperature=1.0, seed=42, generated_before=3)
    logits = random_logits(1, seed=4)
    original = [Sampler().sample(logits, [chunk("s", seeded, step)])[0] for step in range(3, 8)]
    resumed = [Sampler().sample(logits, [chunk("s", continued, step)])[0] for step in range(5)]
    assert resumed == original
    restarted = [Sampler().sample(logits, [chunk("s", seeded, step)])[0] for step in range(5)]
    assert restarted != original  # without the offset the stream would start over
