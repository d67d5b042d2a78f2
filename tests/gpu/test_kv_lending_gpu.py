"""Idle memory first on the GPU (PagedEngine.lend_kv / return_kv): a lending made while requests
run gives its memory back to the driver (another process could take it), the CUDA graphs are
made again over the resized cache (captured inside the resize, or queued again with lazy
graphs), and the requests answer the tokens of an engine that never lent.

Run on the GPU machine: python3 -m pytest -m gpu tests/gpu/test_kv_lending_gpu.py (written
without a GPU run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from site_engine.engine.core.api import EngineRequest
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import make_model_dir
from site_engine.model_loading import LoadedModel, load_model
from tests.unit.engine.test_engine_correctness import BLOCK_SIZE, make_requests

pytestmark = pytest.mark.gpu
MIB = 1 << 20
CACHE, LENT = 512 * MIB, 256 * MIB


def engine_of(loaded: LoadedModel, lazy: bool) -> PagedEngine:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=BLOCK_SIZE,
                          kv_cache_bytes=CACHE, async_scheduling=True, lazy_graphs=lazy,
                          graph_capture_every_steps=2)  # fmt: skip
    return PagedEngine(loaded, config)


def serve(
    engine: PagedEngine, requests: list[EngineRequest], lend_at: int = -1, return_at: int = -1
) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    step = 0
    while engine.has_unfinished():
        if step == lend_at:
            lend_and_check(engine)
        if step == return_at:
            assert engine.return_kv() > 0
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return outputs


def lend_and_check(engine: PagedEngine) -> None:
    device = engine.runner.device
    graphs = engine.runner.num_graphs
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    assert engine.kv_room() >= LENT
    lent = engine.lend_kv(LENT)
    assert lent >= LENT
    free_after = torch.cuda.mem_get_info(device)[0]
    assert free_after - free_before >= 0.9 * lent, "the lent memory stayed in this process"
    # Eager graphs are captured again inside the resize; lazy ones are queued again.
    if engine.graphs_pending:
        assert engine.runner.num_graphs == 0
    else:
        assert engine.runner.num_graphs == graphs


@pytest.mark.parametrize("lazy", [False, True], ids=["graphs-at-start", "lazy-graphs"])
def test_a_lending_frees_device_memory_and_the_tokens_stay(
    lazy: bool, cuda_device: str, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    model_dir = make_model_dir(tmp_path / "llama", "llama", gpt2_tokenizer_dir)
    loaded = load_model(model_dir, device=cuda_device)
    requests = make_requests(seed=3)  # ignore_eos: the model's EOS does not end them

    alone = engine_of(loaded, lazy)
    expected = serve(alone, requests)
    alone.close()

    engine = engine_of(loaded, lazy)
    full = engine.runner.kv_cache.num_bytes
    got = serve(engine, requests, lend_at=4, return_at=20)
    assert got == expected
    assert engine.runner.kv_cache.num_bytes == full
    assert engine.kv_room() > 0
    engine.close()
