"""Lazy graphs on the CPU (EngineConfig.lazy_graphs, core/graph_capture.py): the engine serves
before its capture work is done, captures only between steps with no step of its own in flight,
and answers with the same tokens as an engine without lazy graphs.

The CPU has no CUDA graphs: the runner lists none (its graph sets exist on CUDA only), so the
capture work here is the queue's callables of the test's own, recording the engine's state at
each call. tests/gpu/test_lazy_graphs.py runs the real captures.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.graph_capture import PendingGraph
from site_engine.engine.core.types import FinishReason
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.make_model import build_random_model
from site_engine.model_loading import LoadedModel, load_model
from tests.unit.engine.test_engine_correctness import BLOCK_SIZE, CONFIGS, NUM_BLOCKS, make_requests


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> LoadedModel:
    model_dir = tmp_path_factory.mktemp("lazy") / "llama"
    build_random_model(CONFIGS["llama"], seed=1).save_pretrained(str(model_dir))
    load_tokenizer(gpt2_tokenizer_dir).save_pretrained(str(model_dir))
    return load_model(model_dir, device="cpu")


def engine_of(loaded: LoadedModel, lazy: bool, every: int = 3) -> PagedEngine:
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
            async_scheduling=True,  # steps in flight between step() calls: what a drain is for
            lazy_graphs=lazy,
            graph_capture_every_steps=every,
        ),
    )


class Probes:
    """Capture callables that record what the engine was doing when each was called."""

    def __init__(self, engine: PagedEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, bool, int]] = []  # (label, step in flight, iterations)

    def graphs(self, count: int) -> list[PendingGraph]:
        labels = [f"probe {i}" for i in range(count)]
        return [PendingGraph(label, partial(self.call, label)) for label in labels]

    def call(self, label: str) -> None:
        self.calls.append((label, self.engine.step_in_flight, self.engine.stats().iterations))


def serve(
    engine: PagedEngine, requests: list[EngineRequest]
) -> tuple[dict[str, list[int]], list[int]]:
    """All requests at once, stepped to the end: each request's tokens, and for each step that
    produced a token, how many graphs remained to capture after it."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    remaining_at_token: list[int] = []
    for request in requests:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished():
        produced = engine.step()
        if any(o.new_token_ids for o in produced):
            remaining_at_token.append(len(engine.graph_queue.remaining))
        for output in produced:
            outputs[output.request_id].extend(output.new_token_ids)
            assert output.finish_reason in (None, FinishReason.LENGTH)
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    return outputs, remaining_at_token


def test_cpu_runner_lists_no_graphs_and_the_setting_off_keeps_the_queue_empty(
    loaded: LoadedModel,
) -> None:
    lazy, eager = engine_of(loaded, lazy=True), engine_of(loaded, lazy=False)
    try:
        assert lazy.runner.pending_graphs() == []
        assert lazy.runner.num_graphs == 0
        assert lazy.graph_queue.done
        assert eager.graph_queue.done
        assert not lazy.graphs_pending
        assert not eager.graphs_pending
    finally:
        lazy.close()
        eager.close()


def test_lazy_engine_serves_before_its_graphs_and_gives_the_same_tokens(
    loaded: LoadedModel,
) -> None:
    requests = make_requests(seed=3)
    eager = engine_of(loaded, lazy=False)
    expected, _ = serve(eager, requests)
    eager.close()

    engine = engine_of(loaded, lazy=True, every=3)
    probes = Probes(engine)
    engine.graph_queue.extend(probes.graphs(6))
    got, remaining_at_token = serve(engine, requests)

    assert got == expected  # tokens identical to the engine that never waited for graphs
    assert all(
        len(tokens) == r.sampling.max_tokens
        for tokens, r in zip(got.values(), requests, strict=False)
    )
    # Served before the capture work was done: tokens came out while graphs were pending ...
    assert remaining_at_token[0] == 6
    assert remaining_at_token[-1] == 0
    assert any(remaining > 0 for remaining in remaining_at_token[1:])
    # ... and each capture came between steps, with no step of the engine's in flight, one per
    # 3 steps (a drained step counts in `iterations` once applied).
    assert [label for label, _, _ in probes.calls] == [f"probe {i}" for i in range(6)]
    assert not any(in_flight for _, in_flight, _ in probes.calls)
    iterations = [it for _, _, it in probes.calls]
    assert all(b - a >= 2 for a, b in itertools.pairwise(iterations)), iterations
    assert engine.graph_queue.done
    assert engine.graph_queue.ready_s is not None
    engine.close()


def test_the_service_captures_while_idle_and_serves_meanwhile(loaded: LoadedModel) -> None:
    """The engine loop captures pending graphs while no request runs (a time-bounded run per
    loop turn, never beside a request or a step in flight), and a request that arrives during
    the capture work is answered in full before the rest is captured."""
    engine = engine_of(loaded, lazy=True, every=10_000)  # no busy captures in this test
    release, holding = threading.Event(), threading.Event()
    calls: list[tuple[int, bool, bool, int]] = []

    def slow(index: int) -> None:
        stats = engine.stats()
        calls.append((index, engine.has_unfinished(), engine.step_in_flight, stats.iterations))
        if index == 1:
            holding.set()
            release.wait(30)  # holds the loop in a capture while a request arrives

    engine.graph_queue.extend(PendingGraph(f"slow {i}", partial(slow, i)) for i in range(4))
    ready: list[float] = []
    engine.on_graphs_ready = ready.append
    request = make_requests(seed=4)[0]
    service = EngineService(engine, loaded.tokenizer, graphs=engine)
    service.start()

    async def answer() -> list[int]:
        tokens: list[int] = []
        async for event in service.generate(request):
            tokens.extend(event.token_ids)
        return tokens

    async def main() -> list[int]:
        assert await asyncio.to_thread(holding.wait, 60), "the idle loop did not capture"
        assert len(calls) == 2
        task = asyncio.create_task(answer())
        await asyncio.sleep(0.1)  # the request waits in the loop's commands
        release.set()
        return await asyncio.wait_for(task, 60)

    try:
        tokens = asyncio.run(main())
        deadline = time.monotonic() + 60
        while engine.graphs_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tokens) == request.sampling.max_tokens
        assert not engine.graphs_pending
        assert len(ready) == 1
        assert [index for index, _, _, _ in calls] == [0, 1, 2, 3]
        assert not any(busy or in_flight for _, busy, in_flight, _ in calls)
        # The last two captures came after the request's steps: it did not wait for them.
        assert calls[1][3] == 0
        assert calls[2][3] >= request.sampling.max_tokens
    finally:
        service.stop()
        engine.close()
