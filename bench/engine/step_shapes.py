"""Mixed steps against the sum of their parts: the step-time table of the serving benchmark.

A mixed step carries prefill chunks (fresh prompts, chunks that continue cached positions) and
decode rows. For each step shape it times, in the same process and interleaved rep by rep:
the mixed step, a prefill-only step of the same prefill chunks, and a decode-only step of the
same decode rows, each one whole `ModelRunner.execute` (inputs, forward, logits, sampling,
waiting for the tokens), and reports mixed / (prefill-only + decode-only). The chunks are built
by hand over the runner's cache (random K/V in the blocks they use, never zeros), so the same
shape is measured whatever the scheduler would have produced.

    python -m bench.engine.step_shapes [--model-dir DIR] [--profile] [--json-out FILE]

--profile adds the kernel table (torch profiler) and the host profile (cProfile) of the first
shape's mixed step: where such a step spends its time.

Only APIs that every engine version of this repository has are used (PagedEngine, the runner's
execute and cache, ScheduledChunk), so the same module measures an older engine package too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.engine.harness import GIB, Progress
from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.model_runner import ModelRunner
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

_GREEDY = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One prefill chunk: `cached` positions already in the cache, `new` computed this step."""

    cached: int
    new: int


@dataclass(frozen=True, slots=True)
class StepShape:
    name: str
    description: str
    decode_rows: int
    decode_context: int  # KV positions each decode row attends to (its own new one included)
    prefill: tuple[PrefillChunk, ...]

    @property
    def prefill_tokens(self) -> int:
        return sum(c.new for c in self.prefill)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows


def _fresh(*lengths: int) -> tuple[PrefillChunk, ...]:
    return tuple(PrefillChunk(0, n) for n in lengths)


def _short_prompts(count: int, seed: int) -> tuple[PrefillChunk, ...]:
    """Chat-like fresh prompts: log-normal lengths around 26 tokens (the short mix)."""
    rng = random.Random(seed)
    return _fresh(*(max(2, min(400, int(rng.lognormvariate(3.26, 0.9)))) for _ in range(count)))


SHAPES: tuple[StepShape, ...] = (
    StepShape(
        "burst512_budget2048",
        "the issue's burst (512-token prompts, budget 2048): a chunk continuing a split prompt, "
        "three fresh prompts and the head of the next, 128 decode rows",
        128,
        540,
        (PrefillChunk(300, 212), *_fresh(512, 512, 512, 172)),
    ),
    StepShape(
        "burst512_budget8192",
        "the same at budget 8192: a continuing chunk and 15 fresh 512-token prompts + one head",
        128,
        540,
        (PrefillChunk(300, 212), *_fresh(*([512] * 15), 172)),
    ),
    StepShape(
        "long_prompt_chunk",
        "the long-prompt mix: the second 1,984-token chunk of a 3,008-token prompt, 64 decode rows",
        64,
        800,
        (PrefillChunk(1024, 1984),),
    ),
    StepShape(
        "short_prompts",
        "the short-prompt mix: 40 fresh chat prompts (~26 tokens), 192 decode rows",
        192,
        480,
        _short_prompts(40, seed=1),
    ),
)


class _Blocks:
    """Hands out distinct physical blocks, the way the scheduler's block manager would."""

    def __init__(self, block_size: int, limit: int) -> None:
        self.block_size, self.limit, self.next = block_size, limit, 0

    def table(self, positions: int) -> tuple[int, ...]:
        count = -(-positions // self.block_size)
        if self.next + count > self.limit:
            raise ValueError(f"the shapes need more than the cache's {self.limit} blocks")
        self.next += count
        return tuple(range(self.next - count, self.next))


@dataclass(frozen=True, slots=True)
class HandStep:
    """A step of hand-made chunks (chunk i in row i; a one-token chunk past position 0 a
    decode row): what the runner runs with `run`."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    def run(self, runner: Any) -> None:
        """Runs the step and waits for its sampled tokens."""
        execute_chunks = getattr(runner, "execute_chunks", None)
        if execute_chunks is not None:
            execute_chunks(self.chunks)
        else:  # an engine from before the running batch (issue 66)
            from site_engine.engine.core.types import SchedulerOutput

            runner.execute(SchedulerOutput(chunks=self.chunks))  # type: ignore[call-arg]


def build_steps(
    shape: StepShape, block_size: int, num_blocks: int, vocab: int, seed: int
) -> dict[str, HandStep]:
    """The mixed step of `shape` and its two parts; the parts reuse the mixed step's chunks."""
    rng = random.Random(seed)
    blocks = _Blocks(block_size, num_blocks)
    prefill = [
        ScheduledChunk(
            request_id=f"{shape.name}-p{i}",
            token_ids=tuple(rng.randrange(vocab) for _ in range(chunk.new)),
            start_position=chunk.cached,
            block_table=blocks.table(chunk.cached + chunk.new),
            sample=True,
            sampling=_GREEDY,
            num_generated=0,
        )
        for i, chunk in enumerate(shape.prefill)
    ]
    decode = [
        ScheduledChunk(
            request_id=f"{shape.name}-d{i}",
            token_ids=(rng.randrange(vocab),),
            start_position=shape.decode_context - 1,
            block_table=blocks.table(shape.decode_context),
            sample=True,
            sampling=_GREEDY,
            num_generated=1,
        )
        for i in range(shape.decode_rows)
    ]
    return {
        "mixed": HandStep((*decode, *prefill)),
        "prefill_only": HandStep(tuple(prefill)),
        "decode_only": HandStep(tuple(decode)),
    }


def _randomize_cache(runner: ModelRunner, blocks: int) -> None:
    """Random K/V in the first `blocks` blocks of every layer: cached positions hold real-looking
    numbers (timing on zeros can flatter the matrix units)."""
    generator = torch.Generator(device=runner.kv_cache.device).manual_seed(0)
    for layer in runner.kv_cache.layers:
        view = layer[:, :blocks]
        view.copy_(torch.randn(view.shape, generator=generator, device=view.device) * 0.5)


def _timed(run: Callable[[], Any]) -> float:
    began = time.perf_counter()
    run()  # execute() waits for the sampled tokens: the step's work is done when it returns
    return (time.perf_counter() - began) * 1000.0


def measure_shape(
    runner: ModelRunner, shape: StepShape, *, reps: int, warmup: int, seed: int
) -> dict[str, Any]:
    """Median ms of the mixed step and of its parts (interleaved), and mixed / (sum of parts)."""
    steps = build_steps(shape, runner.block_size, runner.num_blocks, runner.vocab_size, seed)
    used = max(max(c.block_table) for out in steps.values() for c in out.chunks) + 1
    _randomize_cache(runner, used)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(warmup + reps):
        for name, output in steps.items():
            elapsed = _timed(partial(output.run, runner))
            if rep >= warmup:
                times[name].append(elapsed)
    median = {name: statistics.median(values) for name, values in times.items()}
    parts = median["prefill_only"] + median["decode_only"]
    flat = getattr(runner, "step_graphs", None)  # engines before the flat step graphs have none
    mixed = steps["mixed"]
    fits = flat is not None and (
        len(mixed.chunks) <= flat.max_seqs and mixed.num_batched_tokens <= flat.max_tokens
    )
    return {
        "mixed_path": "flat step graph" if fits else "eager forward + decode graphs",
        "shape": shape.name,
        "description": shape.description,
        "decode_rows": shape.decode_rows,
        "decode_context": shape.decode_context,
        "prefill_chunks": len(shape.prefill),
        "continuing_chunks": sum(c.cached > 0 for c in shape.prefill),
        "prefill_tokens": shape.prefill_tokens,
        "step_tokens": shape.tokens,
        "mixed_ms": median["mixed"],
        "prefill_only_ms": median["prefill_only"],
        "decode_only_ms": median["decode_only"],
        "sum_of_parts_ms": parts,
        "mixed_vs_parts": median["mixed"] / parts,
        "mixed_ms_p90": statistics.quantiles(times["mixed"], n=10)[-1],
        "reps": reps,
    }


def step_limits(shapes: Sequence[StepShape]) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that admit every shape as a scheduler could
    produce it: as many sequences as the largest step holds (decode rows and prefill chunks),
    and as many tokens. An engine with less would run a shape down a path no real step takes."""
    return (
        max(s.decode_rows + len(s.prefill) for s in shapes),
        max(s.tokens for s in shapes),
    )


def step_engine(
    loaded: LoadedModel, shapes: Sequence[StepShape], kv_gib: float, max_num_seqs: int = 0
) -> PagedEngine:
    """max_num_seqs: the engine's batch limit when above what the shapes need (a site's
    default on a large GPU, 1,024, sizes the captured steps' sequence arrays)."""
    max_seqs, max_tokens = step_limits(shapes)
    return PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=max(max_seqs, max_num_seqs),
            max_num_batched_tokens=max_tokens,
            kv_cache_bytes=int(kv_gib * GIB),
        ),
    )


def measure_shapes(
    loaded: LoadedModel,
    shapes: Sequence[StepShape] = SHAPES,
    *,
    reps: int = 15,
    warmup: int = 3,
    kv_gib: float = 8.0,
    log: Progress | None = None,
    profile: bool = False,
    max_num_seqs: int = 0,
) -> list[dict[str, Any]]:
    engine = step_engine(loaded, shapes, kv_gib, max_num_seqs)
    rows = []
    for index, shape in enumerate(shapes):
        row = measure_shape(engine.runner, shape, reps=reps, warmup=warmup, seed=index)
        rows.append(row)
        if log is not None:
            log(
                f"  step {shape.name}: mixed {row['mixed_ms']:.2f} ms vs prefill-only "
                f"{row['prefill_only_ms']:.2f} + decode-only {row['decode_only_ms']:.2f} ms "
                f"= x{row['mixed_vs_parts']:.2f}"
            )
    if profile:
        runner = engine.runner
        steps = build_steps(shapes[0], runner.block_size, runner.num_blocks, runner.vocab_size, 0)
        print(profile_step(engine.runner, steps["mixed"], shapes[0].name), flush=True)
    del engine
    return rows


def profile_step(runner: ModelRunner, output: HandStep, label: str, steps: int = 5) -> str:
    """The kernel table and the host profile of `steps` executions of one step."""
    output.run(runner)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            output.run(runner)
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=15, max_name_column_width=70
    )
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        output.run(runner)
    host.disable()
    stream = io.StringIO()
    pstats.Stats(host, stream=stream).sort_stats("tottime").print_stats(15)
    return (
        f"\n### {label}: kernels over {steps} mixed steps\n\n{table}\n"
        f"\n### {label}: host (cProfile) over {steps} mixed steps\n\n{stream.getvalue()}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    from bench.engine.model_setup import LLAMA_1B_SHAPE, ensure_model

    parser = argparse.ArgumentParser(prog="python -m bench.engine.step_shapes")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/fedllm-llama1b"))
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--max-num-seqs", type=int, default=0,
        help="engine batch limit, if above what the shapes need (1024: the H100 default)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    log = Progress()
    loaded = ensure_model(args.model_dir, LLAMA_1B_SHAPE, args.tokenizer_dir, log)
    rows = measure_shapes(loaded, reps=args.reps, log=log, profile=args.profile,
                          max_num_seqs=args.max_num_seqs)  # fmt: skip
    if args.json_out is not None:
        payload = {"label": args.label, "max_num_seqs": args.max_num_seqs, "rows": rows}
        args.json_out.write_text(json.dumps(payload, indent=2))
    for row in rows:
        print(
            f"{args.label}: {row['shape']}: x{row['mixed_vs_parts']:.2f} "
            f"({row['mixed_ms']:.2f} vs {row['prefill_only_ms']:.2f} + "
            f"{row['decode_only_ms']:.2f} ms)",
            flush=True,
        )


if __name__ == "__main__":
    main()
