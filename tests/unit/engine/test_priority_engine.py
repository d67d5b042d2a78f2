"""Priority classes through the real engine (tiny random Llama on CPU): batch work preempted by
interactive requests in a small KV cache re-runs and gives, under greedy decoding, the very
answers it gives when nothing preempts it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedllm_contract.priority import Priority
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel, load_model

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Iterator[LoadedModel]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(tiny_llama_dir, device="cpu")
    torch.set_num_threads(previous)


def requests(seed: int) -> tuple[list[EngineRequest], list[EngineRequest]]:
    """Eight batch and four interactive requests of random prompts, greedy, exact lengths."""
    rng = random.Random(seed)

    def make(rid: str, priority: Priority) -> EngineRequest:
        return EngineRequest(
            rid,
            tuple(rng.randrange(1, 1000) for _ in range(rng.randint(4, 24))),
            SamplingParams(max_tokens=rng.randint(6, 20), temperature=0.0, ignore_eos=True),
            predicted_tokens=2,  # under-predicted: admission packs the cache tight
            priority=priority,
        )

    batch = [make(f"b{n}", Priority.BATCH) for n in range(8)]
    interactive = [make(f"i{n}", Priority.INTERACTIVE) for n in range(4)]
    return batch, interactive


def run(
    engine: PagedEngine, batch: list[EngineRequest], interactive: list[EngineRequest]
) -> dict[str, list[int]]:
    """The batch queued up front; an interactive request every third step."""
    answers: dict[str, list[int]] = {r.request_id: [] for r in (*batch, *interactive)}
    for request in batch:
        engine.add_request(request)
    pending = list(interactive)
    steps = 0
    while engine.has_unfinished() or pending:
        if pending and steps % 3 == 2:
            engine.add_request(pending.pop(0))
        for output in engine.step():
            answers[output.request_id].extend(output.new_token_ids)
            assert output.finish_reason in (None, FinishReason.LENGTH)
        steps += 1
        assert steps < 2000, "no progress"
    return answers


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_preempted_batch_answers_are_complete_and_identical(
    loaded: LoadedModel, overlap: bool
) -> None:
    batch, interactive = requests(seed=7)
    per_block = kv_cache_bytes_per_block(
        KVCacheSpec.from_config(loaded.model.config), BLOCK_SIZE, torch.float32
    )

    def engine(num_blocks: int, background_step_tokens: int) -> PagedEngine:
        return PagedEngine(
            loaded,
            EngineConfig(
                max_num_seqs=4,
                max_num_batched_tokens=32,
                block_size=BLOCK_SIZE,
                kv_cache_bytes=num_blocks * per_block,
                async_scheduling=overlap,
                background_step_tokens=background_step_tokens,
            ),
        )

    # A cache for everything at once and no interactive load: nothing is ever preempted.
    calm = engine(num_blocks=200, background_step_tokens=0)
    alone = run(calm, batch, [])
    alone.update(run(calm, [], interactive))
    assert calm.stats().num_preemptions == 0
    # A small cache, a deferral bound, interactive requests arriving mid-batch.
    tight = engine(num_blocks=24, background_step_tokens=8)
    mixed = run(tight, batch, interactive)
    loads = {load.priority: load for load in tight.stats().by_class}
    assert loads[Priority.BATCH].num_preemptions > 0, "the small cache should preempt batch work"
    assert loads[Priority.INTERACTIVE].num_preemptions == 0
    assert mixed == alone
    for request in (*batch, *interactive):
        assert len(mixed[request.request_id]) == request.sampling.max_tokens
