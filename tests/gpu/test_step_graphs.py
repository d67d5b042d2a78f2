"""The graph runners (flat step graphs: a mixed step as one padded flat batch; decode graphs)
against the eager runner path, over the running batch the runner keeps (input_batch.py).

The same steps — decode rows (their input token the row's last token on the device, as async
scheduling leaves it), a chunk continuing cached positions, a fresh prompt — are laid out once
(InputBatch.layout) and go through the eager path (ModelRunner.forward, then the sampled rows'
logits) and through FlatStepGraphs or DecodeGraphs; the logits must agree. Steps of different
sizes run through the same graphs object, so stale staging from a larger step cannot leak into a
smaller one. On the GPU the buckets are captured CUDA graphs; under TRITON_INTERPRET=1 on the CPU
the same static-buffer forward runs eagerly (tests/unit/engine/test_graphs_interpreted.py runs
this file so in CI).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.cuda.attention import CudaPagedAttention
from site_engine.engine.graphs.decode_graphs import DecodeGraphs
from site_engine.engine.graphs.flat_step_graphs import FlatStepGraphs, token_buckets
from site_engine.engine.input_batch import StepLayout
from site_engine.engine.model_runner import ModelRunner, step_of_chunks
from site_engine.make_model import build_random_model

pytestmark = pytest.mark.gpu
BLOCK = 4
NUM_BLOCKS = 96
ROWS = 8
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


class _Steps:
    """A runner over a small random Llama, and the steps of a few sequences it lays out."""

    def __init__(self, device: str) -> None:
        model = build_random_model(CONFIG, seed=3).to(device)
        self.runner = ModelRunner(
            model, num_blocks=NUM_BLOCKS, block_size=BLOCK, device=torch.device(device),
            dtype=torch.float32, attention=CudaPagedAttention(), max_rows=ROWS,
        )  # fmt: skip
        self.rng = random.Random(0)
        self.free = self.rng.sample(range(NUM_BLOCKS - 1), NUM_BLOCKS - 1)  # never the scratch

    def table(self, positions: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-positions // BLOCK))]

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(512) for _ in range(n)]

    def layout(self, chunks: list[ScheduledChunk]) -> StepLayout:
        """Chunk i in row i; a one-token chunk past position 0 is a decode row whose input is
        the row's last token on the device (set here to the chunk's token, as sampling would)."""
        output, decodes = step_of_chunks(chunks)
        batch = self.runner.batch
        for row, token in decodes:
            batch.last_token[row] = token
        batch.apply(output)
        return batch.layout(output)

    def eager(self, layout: StepLayout) -> torch.Tensor:
        index = torch.tensor(layout.sample_index, device=self.runner.device)
        with torch.inference_mode():
            hidden = self.runner.forward(layout)
            return self.runner.flat_model.compute_logits(hidden.index_select(0, index))


def test_flat_step_matches_the_eager_path(kernel_device: str) -> None:
    s = _Steps(kernel_device)
    runner = s.runner
    graphs = FlatStepGraphs(
        runner.flat_model, runner.attention, runner.kv_cache, max_tokens=48, max_seqs=6,
        max_blocks_per_seq=64, scratch_block=NUM_BLOCKS - 1, capture=kernel_device == "cuda",
    )  # fmt: skip
    graphs.capture()
    # Cache contents for three sequences: eager prefill of their first positions.
    tables = {rid: s.table(40) for rid in ("a", "b", "c")}
    lengths = {"a": 17, "b": 9, "c": 12}
    runner.execute_chunks([_chunk(rid, s.prompt(n), 0, tables[rid]) for rid, n in lengths.items()])
    steps = [
        [
            _chunk("a", s.prompt(1), 17, tables["a"], generated=1),
            _chunk("b", s.prompt(1), 9, tables["b"], generated=1),
            _chunk("c", s.prompt(10), 12, tables["c"]),
            _chunk("d", s.prompt(15), 0, s.table(15)),
        ],
        [_chunk("a", s.prompt(1), 18, tables["a"], 2), _chunk("e", s.prompt(3), 0, s.table(3))],
        # A chunk that does not end its prompt samples nothing: the sampled rows' logits come
        # from the lm_head graph of their count, whatever the other chunks are.
        [
            _chunk("a", s.prompt(1), 19, tables["a"], 3),
            _chunk("f", s.prompt(20), 0, s.table(40), sample=False),
            _chunk("c", s.prompt(3), 22, tables["c"]),
        ],
        [_chunk("g", s.prompt(30), 0, s.table(40), sample=False)],
    ]
    for chunks in steps:
        layout = s.layout(chunks)
        expected = s.eager(layout)
        with torch.inference_mode():
            got = graphs.run(layout, runner.batch)
        assert got.shape == expected.shape
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_decode_graphs_match_the_eager_path(kernel_device: str) -> None:
    s = _Steps(kernel_device)
    runner = s.runner
    graphs = DecodeGraphs(
        runner.flat_model, runner.attention, runner.kv_cache, max_batch=6, max_blocks_per_seq=64,
        scratch_block=NUM_BLOCKS - 1, capture=kernel_device == "cuda",
    )  # fmt: skip
    graphs.capture()
    tables = {rid: s.table(48) for rid in "abcde"}
    lengths = {"a": 17, "b": 9, "c": 12, "d": 30, "e": 4}
    runner.execute_chunks([_chunk(rid, s.prompt(n), 0, tables[rid]) for rid, n in lengths.items()])
    positions = dict(lengths)
    # Five rows, then three (a smaller bucket after a larger one), then five again.
    for names in ("abcde", "dbe", "edcba"):
        chunks = [
            _chunk(rid, s.prompt(1), positions[rid], tables[rid], generated=1) for rid in names
        ]
        layout = s.layout(chunks)
        assert layout.num_decodes == len(names)
        expected = s.eager(layout)
        with torch.inference_mode():
            got = graphs.run(layout, runner.batch)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for rid in names:
            positions[rid] += 1


def test_a_scheduled_run_through_the_graph_paths_gives_the_eager_tokens(kernel_device: str) -> None:
    """The real scheduler drives two runners over the same requests, one eager, one through its
    graph paths (decode graphs, flat step graphs, and decode graphs beside eager prefill chunks
    when a step is larger than the flat graphs take): the same greedy tokens, staggered arrivals
    and chunked prefill included."""
    from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig

    def run(graphs: bool) -> dict[str, list[int]]:
        model = build_random_model(CONFIG, seed=5).to(kernel_device)
        runner = ModelRunner(
            model, num_blocks=NUM_BLOCKS, block_size=BLOCK, device=torch.device(kernel_device),
            dtype=torch.float32, attention=CudaPagedAttention(), max_rows=ROWS,
            cuda_graph_max_batch=ROWS if graphs else 0, cuda_graph_max_tokens=24 if graphs else 0,
            graph_capture=kernel_device == "cuda",
        )  # fmt: skip
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=NUM_BLOCKS - 1, block_size=BLOCK, max_num_seqs=ROWS,
                max_num_batched_tokens=32, max_model_len=256, watermark=0.0,
            )
        )  # fmt: skip
        paths: dict[str, int] = {}
        for name in ("graphs", "step_graphs"):
            graph_runner = getattr(runner, name)
            if graph_runner is not None:
                counted = graph_runner.run

                def count(*args: object, _run: object = counted, _name: str = name) -> object:
                    paths[_name] = paths.get(_name, 0) + 1
                    return _run(*args)  # type: ignore[operator]

                graph_runner.run = count
        used.append(paths)
        rng = random.Random(11)
        prompts = [[rng.randrange(512) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
        answers: dict[str, list[int]] = {}
        step = 0
        while step < 400 and (prompts or scheduler.has_unfinished()):
            if prompts and step % 2 == 0:
                rid = f"r{len(answers)}"
                answers[rid] = []
                scheduler.add(rid, prompts.pop(), SamplingParams(max_tokens=8, temperature=0.0))
            output = scheduler.schedule()
            with torch.inference_mode():
                result = runner.execute(output)
            for update in scheduler.update(output, result):
                answers[update.request_id] += update.new_token_ids
            step += 1
        assert not scheduler.has_unfinished()
        return answers

    used: list[dict[str, int]] = []
    eager, graphed = run(False), run(True)
    assert used[0] == {}
    assert used[1]["graphs"] > 0, used
    assert used[1]["step_graphs"] > 0, used
    assert eager == graphed
    assert all(len(tokens) == 8 for tokens in eager.values())
