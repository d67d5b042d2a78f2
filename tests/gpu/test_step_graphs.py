"""Flat step graphs (a mixed step as one padded flat batch) against the eager runner path.

The same steps — decode rows (one with its input token still on the device, as with async
scheduling), a chunk continuing cached positions, a fresh prompt — go through the eager path
(prepare_inputs, forward, compute_logits) and through FlatStepGraphs; the logits must agree.
Two steps of different sizes run through the same graphs object, so stale staging from a larger
step cannot leak into a smaller one. On the GPU the buckets are captured CUDA graphs; under
TRITON_INTERPRET=1 on the CPU the same static-buffer forward runs eagerly.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from site_engine.engine.core.types import (
    PENDING_TOKEN,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from site_engine.engine.cuda.attention import CudaPagedAttention
from site_engine.engine.cuda.step_graphs import FlatStepGraphs, token_buckets
from site_engine.engine.launched_step import LaunchedStep
from site_engine.engine.model_runner import ModelRunner
from site_engine.make_model import build_random_model

pytestmark = pytest.mark.gpu
BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
CONFIG = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip


def _chunk(
    rid: str, tokens: list[int], start: int, table: list[int], generated: int = 0,
    sample: bool = True,
) -> ScheduledChunk:  # fmt: skip
    return ScheduledChunk(rid, tuple(tokens), start, tuple(table), sample, GREEDY, generated)


def test_token_buckets_end_at_the_step_budget() -> None:
    assert token_buckets(24) == (16, 24)
    assert token_buckets(2048)[-3:] == (1536, 1792, 2048)
    assert token_buckets(3000)[-2:] == (2560, 3000)


def test_flat_step_matches_the_eager_path(kernel_device: str) -> None:
    model = build_random_model(CONFIG, seed=3).to(kernel_device)
    runner = ModelRunner(
        model, num_blocks=NUM_BLOCKS, block_size=BLOCK, device=torch.device(kernel_device),
        dtype=torch.float32, attention=CudaPagedAttention(),
    )  # fmt: skip
    graphs = FlatStepGraphs(
        runner.flat_model, runner.attention, runner.kv_cache, max_tokens=48, max_seqs=6,
        max_blocks_per_seq=64, scratch_block=NUM_BLOCKS - 1, capture=kernel_device == "cuda",
    )  # fmt: skip
    graphs.capture()
    rng = random.Random(0)
    free = rng.sample(range(NUM_BLOCKS - 1), NUM_BLOCKS - 1)  # scattered, never the scratch

    def table(positions: int) -> list[int]:
        return [free.pop() for _ in range(-(-positions // BLOCK))]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(512) for _ in range(n)]

    # Cache contents for three sequences: eager prefill of their first positions.
    tables = {rid: table(40) for rid in ("a", "b", "c")}
    lengths = {"a": 17, "b": 9, "c": 12}
    runner.execute(SchedulerOutput(chunks=tuple(
        _chunk(rid, prompt(n), 0, tables[rid]) for rid, n in lengths.items()
    )))  # fmt: skip
    previous = LaunchedStep(rows={"b": 1}, sampled=torch.tensor([7, 123], device=kernel_device))
    steps = [
        [
            _chunk("a", prompt(1), 17, tables["a"], generated=1),
            _chunk("b", [PENDING_TOKEN], 9, tables["b"], generated=1),
            _chunk("c", prompt(10), 12, tables["c"]),
            _chunk("d", prompt(15), 0, table(15)),
        ],
        [_chunk("e", prompt(3), 0, table(3)), _chunk("a", prompt(1), 18, tables["a"], 2)],
        # A chunk that does not end its prompt samples nothing: the sampled rows' logits come
        # from the lm_head graph of their count, whatever the other chunks are.
        [
            _chunk("f", prompt(20), 0, table(40), sample=False),
            _chunk("a", prompt(1), 19, tables["a"], 3),
            _chunk("c", prompt(3), 22, tables["c"]),
        ],
        [_chunk("g", prompt(30), 0, table(40), sample=False)],
    ]
    for chunks in steps:
        pending = previous.pending_rows(chunks)
        with torch.inference_mode():
            inputs = runner.prepare_inputs(chunks, previous)
            expected = runner.compute_logits(runner.forward(inputs), inputs)
            got = graphs.run(chunks, pending, previous.sampled)
        assert got.shape == expected.shape
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
