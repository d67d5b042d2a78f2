"""The sampler's logit processing on hand-made logits: logit_bias, OpenAI's presence and
frequency penalties, vLLM's repetition penalty, logprobs as OpenAI reports them, and plain rows
that take exactly the path they took before any of it existed."""

from __future__ import annotations

import pytest
import torch

from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.sampler import Sampler


def chunk(
    request_id: str,
    sampling: SamplingParams,
    history: tuple[int, ...] = (),
    prompt: tuple[int, ...] = (),
) -> ScheduledChunk:
    return ScheduledChunk(
        request_id,
        (1,),
        0,
        (0,),
        True,
        sampling,
        len(history),
        history=history,
        prompt_token_ids=prompt,
    )


GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_logit_bias_forces_and_forbids_tokens() -> None:
    raw = logits(3)
    top = int(raw[1].argmax())
    forced = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((7, 100.0),))
    banned = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((top, -100.0),))
    ids = Sampler().sample(raw, [chunk("a", forced), chunk("b", banned), chunk("c", GREEDY)])
    assert ids[0] == 7
    assert ids[1] != top
    assert ids[1] == int(raw[1].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    assert ids[2] == int(raw[2].argmax())


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    raw = logits(1)
    history = (3, 3, 3, 9)
    params = SamplingParams(
        max_tokens=4, temperature=0.0, presence_penalty=0.5, frequency_penalty=1.5
    )
    expected = raw[0].clone()
    for token, count in ((3, 3), (9, 1)):
        expected[token] -= count * 1.5 + 0.5  # OpenAI: count * frequency + presence
    raw[0, 3] = raw[0].max() + 1.0  # the most likely token before the penalty
    expected[3] = raw[0, 3] - 5.0
    ids = Sampler().sample(raw, [chunk("p", params, history)])
    assert ids == [int(expected.argmax())]
    assert ids != [3]


def test_repetition_penalty_scales_seen_tokens_of_prompt_and_answer() -> None:
    raw = torch.zeros(1, 10)
    raw[0, 2], raw[0, 5], raw[0, 6] = 4.0, 3.0, -1.0
    params = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=2.0)
    # 2 is in the prompt: 4 / 2 = 2 < 3, so 5 wins; 6 (negative) would be multiplied.
    assert Sampler().sample(raw, [chunk("r", params, history=(6,), prompt=(2,))]) == [5]


def test_logprobs_are_log_softmax_of_the_raw_logits_with_top_alternatives() -> None:
    raw = logits(2)
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        logit_bias=((0, 50.0),),  # the sampled token changes; its logprob stays the raw one
    )
    sampled = Sampler().sample_step(raw, [chunk("l", params), chunk("g", GREEDY)])
    reference = torch.log_softmax(raw.float(), dim=-1)
    assert int(sampled.ids[0]) == 0
    assert sampled.logprobs is not None
    assert sampled.top_ids is not None
    assert sampled.top_logprobs is not None
    torch.testing.assert_close(sampled.logprobs[0], reference[0, 0])
    top = reference[0].topk(3)
    assert sampled.top_ids[0].tolist() == top.indices.tolist()
    torch.testing.assert_close(sampled.top_logprobs[0], top.values)
    assert int(sampled.ids[1]) == int(raw[1].argmax())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_rows_sample_the_same_next_to_processed_rows(seed: int) -> None:
    """Seeded plain rows draw the same tokens whether or not other rows of the batch ask for
    penalties, bias or logprobs."""
    raw = logits(4, seed=seed)
    plain = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    fancy = SamplingParams(max_tokens=8, temperature=0.8, presence_penalty=1.0, logprobs=True)
    alone = Sampler().sample(raw[[0, 2]], [chunk("a", plain), chunk("c", GREEDY)])
    mixed = Sampler().sample(
        raw, [chunk("a", plain), chunk("b", fancy, (1, 2)), chunk("c", GREEDY), chunk("d", fancy)]
    )
    assert [mixed[0], mixed[2]] == alone


def test_sampling_params_refuse_out_of_range_values() -> None:
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(max_tokens=1, presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(max_tokens=1, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(max_tokens=1, logit_bias=((1, 101.0),))
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(max_tokens=1, top_logprobs=21)


class AllowOnly:
    """A grammar that allows exactly `tokens` next (not llguidance's: filled row by row)."""

    def __init__(self, *tokens: int) -> None:
        self.tokens = tokens

    def consume(self, token: int) -> bool:
        return token in self.tokens

    def fill_mask(self, words: object) -> None:
        row = words
        row[:] = 0  # type: ignore[index]
        for token in self.tokens:
            row[token // 32] |= 1 << (token % 32)  # type: ignore[index]

    def is_finished(self) -> bool:
        return False

    @property
    def error(self) -> str:
        return ""


CONSTRAINED = SamplingParams(
    max_tokens=1, temperature=0.0, constraint=ConstraintSpec("json_object")
)


def guided(request_id: str, guide: AllowOnly) -> ScheduledChunk:
    base = chunk(request_id, CONSTRAINED)
    return ScheduledChunk(
        base.request_id, base.token_ids, base.start_position, base.block_table, base.sample,
        base.sampling, base.num_generated, guide=guide,
    )  # fmt: skip


def test_masks_prepared_in_another_row_order_reach_their_own_rows() -> None:
    """The engine prepares masks in the scheduler's chunk order and the logits come in the
    runner's row order (graphed rows first): each mask lands on its request's row."""
    raw = logits(4, vocab=70)
    chunks = [chunk("free", GREEDY), guided("a", AllowOnly(5, 40)), guided("b", AllowOnly(66))]
    sampler = Sampler()
    masks = sampler.prepare_masks(list(reversed(chunks)), 70, raw.device)
    assert masks is not None
    assert masks.request_ids == ("b", "a")
    ids = sampler.sample(raw[:3], chunks)
    expected_a = 5 if raw[1, 5] > raw[1, 40] else 40
    assert ids == [int(raw[0].argmax()), expected_a, 66]
    reordered = Sampler().sample_step(raw[:3].clone(), chunks, masks).ids.tolist()
    assert reordered == ids


def test_masks_for_other_rows_are_refused() -> None:
    raw = logits(2, vocab=70)
    sampler = Sampler()
    masks = sampler.prepare_masks([guided("x", AllowOnly(1))], 70, raw.device)
    with pytest.raises(ValueError, match="other rows"):
        sampler.sample_step(raw, [chunk("free", GREEDY), guided("y", AllowOnly(1))], masks)
