"""Lazy graphs on the GPU (EngineConfig.lazy_graphs): an engine that serves before its CUDA
graphs exist answers with the same greedy tokens as one whose graphs were captured up front,
captures them between steps while it serves, and replays them once they exist.

Run on the GPU machine: python3 -m pytest -m gpu tests/gpu/test_lazy_graphs.py
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.engine.lora_profile import counting_replays
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import LoadedModel, load_model
from tests.unit.engine.test_engine_correctness import (
    BLOCK_SIZE,
    CONFIGS,
    NUM_BLOCKS,
    make_requests,
    reference,
)

pytestmark = pytest.mark.gpu


def engine_of(loaded: LoadedModel, lazy: bool, overlap: bool) -> PagedEngine:
    per_block = kv_cache_bytes_per_block(
        KVCacheSpec.from_config(loaded.model.config), BLOCK_SIZE, torch.float32
    )
    return PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=4,
            max_num_batched_tokens=24,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=NUM_BLOCKS * per_block,
            async_scheduling=overlap,
            lazy_graphs=lazy,
            graph_capture_every_steps=2,
        ),
    )


def serve(
    engine: PagedEngine, requests: list[EngineRequest], replays: dict[str, int]
) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Every request to the end: the tokens, and per step (graphs captured, replays in it)."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    steps: list[tuple[int, int]] = []
    while engine.has_unfinished():
        before = replays["replays"]
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
        steps.append((engine.runner.num_graphs, replays["replays"] - before))
        assert len(steps) < 5000, "the engine stopped making progress"
    return outputs, steps


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_lazy_graphs_serve_at_once_then_replay_with_the_same_tokens(
    overlap: bool, cuda_device: str, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    model_dir = tmp_path / "llama"
    build_random_model(CONFIGS["llama"], seed=1).save_pretrained(str(model_dir))
    load_tokenizer(gpt2_tokenizer_dir).save_pretrained(str(model_dir))
    loaded = load_model(model_dir, device=cuda_device)
    requests = make_requests(seed=3)

    upfront = engine_of(loaded, lazy=False, overlap=overlap)
    total = upfront.runner.num_graphs
    assert total > 0
    assert not upfront.graphs_pending
    with counting_replays() as replays:
        expected, _ = serve(upfront, requests, replays)
    upfront.close()

    engine = engine_of(loaded, lazy=True, overlap=overlap)
    assert engine.runner.num_graphs == 0
    assert len(engine.graph_queue.remaining) == total  # the same graphs, to capture later
    with counting_replays() as replays:
        got, steps = serve(engine, requests, replays)
        assert got == expected
        for request in requests[:3]:  # float32 against transformers, as the eager engine
            assert got[request.request_id] == reference(model_dir, request)
        # The first step ran with no graph at all, eagerly; the graphs came while serving.
        assert steps[0] == (0, 0)
        assert any(0 < captured < total for captured, _ in steps)
        assert any(count > 0 for _, count in steps), "captured graphs were never replayed"
        while engine.graphs_pending:  # what the busy steps left, as an idle site captures it
            engine.capture_idle_graphs()
        assert engine.runner.num_graphs == total
        assert engine.graph_queue.failed == []

        # All captured: every step replays (decode graphs or a flat step graph), and the
        # tokens are still those of the engine whose graphs were there from the start.
        second = [replace(r, request_id=f"{r.request_id}-b") for r in requests]
        again, after = serve(engine, second, replays)
    # (An async engine's last step() only applies the step before it: nothing to replay.)
    assert all(count >= 1 for _, count in after[:-1]), after
    assert list(again.values()) == list(expected.values())
    engine.close()
