"""The priority benchmark's two runs of a seed replay the same interactive prompts on one engine
(bench/engine/priority_driver.drive): each must start from a cold prefix cache, or the second run
finds the first one's prompts cached and skips their prefill (issue 60: chat beside the batch
answered in ~24 ms on an H200, chat alone in 80-200 ms). Tiny random Llama on CPU, token clock."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.engine.presets import TokenClock
from bench.engine.priority import PRESETS, build_engine
from bench.engine.priority_driver import Shape, drive, make_requests
from fedllm_contract.priority import Priority
from site_engine.model_loading import LoadedModel, load_model

BLOCK_SIZE = 16  # build_engine's
# The CPU preset with room for every prompt of both runs: nothing a run cached is evicted before
# the next one (an 8B model's cache on a GPU holds a whole run's prompts).
PRESET = {**PRESETS["cpu"], "kv_cache_blocks": 256}


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir, device="cpu")


def test_the_second_run_prefills_the_same_prompts_again(loaded: LoadedModel) -> None:
    engine = build_engine(loaded, PRESET)
    vocab = loaded.model.config.vocab_size
    chats = make_requests("chat", 6, Shape(prompt=(40, 64), answer=(4, 8)), Priority.INTERACTIVE,
                          vocab, seed=1)  # fmt: skip
    arrivals = [(0.05 * n, request) for n, request in enumerate(chats)]
    batch = make_requests("batch", 12, Shape(prompt=(32, 48), answer=(4, 8)), Priority.BATCH,
                          vocab, seed=2)  # fmt: skip
    alone = drive(engine, arrivals, [], TokenClock(0.01, 0.0001), 1.0, 5.0, 4)
    mixed = drive(engine, arrivals, batch, TokenClock(0.01, 0.0001), 1.0, 5.0, 4)
    for run in (alone, mixed):
        assert run.interactive_done == run.interactive_total == len(chats)
        # Random prompts share no full block: a hit could only be the other run's blocks.
        assert run.interactive_cached_prompt_tokens == 0
    # The cache works (the clear is what keeps the runs apart): the same prompts again, on an
    # engine that does not clear it, are served from it.
    before = engine.scheduler_stats().prefix_cache_hits
    for request in chats:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler_stats().prefix_cache_hits - before >= len(chats) * 2 * BLOCK_SIZE


def test_clear_prefix_cache_needs_an_idle_engine(loaded: LoadedModel) -> None:
    engine = build_engine(loaded, PRESET)
    shape = Shape(prompt=(40, 40), answer=(4, 4))
    vocab = loaded.model.config.vocab_size
    request = make_requests("one", 1, shape, Priority.INTERACTIVE, vocab, seed=3)[0]
    engine.add_request(request)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.clear_prefix_cache()
    while engine.has_unfinished():
        engine.step()
    engine.clear_prefix_cache()
    engine.add_request(replace(request, request_id="one-again"))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler_stats().prefix_cache_hits == 0
