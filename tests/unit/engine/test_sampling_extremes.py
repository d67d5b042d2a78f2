"""Regressions from fuzzing the site's gRPC API (tests/integration/test_grpc_fuzz.py): extreme
temperatures must be refused or sample sensibly, never turn the probabilities into NaN."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.sampler import Sampler


def chunk(request_id: str, sampling: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(request_id, (1,), 0, (0,), True, sampling, 0)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf, -1e-30])
def test_non_finite_or_negative_temperature_is_refused(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_tokens=1, temperature=temperature)


@given(
    temperature=st.floats(min_value=0, max_value=2**-14, exclude_min=True, width=32),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    winner=st.integers(1, 99),
)
def test_a_tiny_temperature_takes_the_clear_winner(
    temperature: float, seed: int | None, winner: int
) -> None:
    """logits / 1e-45 overflowed float32: softmax gave NaN and the argmax picked token 0."""
    logits = torch.linspace(-3, 3, 100).roll(winner - 99).unsqueeze(0) * 10
    assert int(logits.argmax()) == winner
    params = SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
    assert Sampler().sample(logits, [chunk("tiny", params)]) == [winner]
