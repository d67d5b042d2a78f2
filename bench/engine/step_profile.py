"""Where a full-batch decode step spends its host time: cProfile over engine.step() with every
sequence decoding, plus the GPU time of the graph replay alone.

    python -m bench.engine.step_profile [--batch 256] [--prompt 512]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from bench.engine.decode_probe import build
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel, load_model


def filled_engine(loaded: LoadedModel, batch: int, prompt: int, graphs: bool) -> PagedEngine:
    """An engine whose `batch` sequences have all finished prefill and are decoding."""
    engine = PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=batch,
            kv_cache_bytes=24 << 30,
            max_num_batched_tokens=8192,
            cuda_graphs=graphs,
        ),
    )
    for i in range(batch):
        engine.add_request(
            EngineRequest(
                f"r{i}",
                tuple(range(1000 + i, 1000 + i + prompt)),
                SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
            )
        )
    while engine.scheduler_stats().cached_tokens < batch * (prompt + 1):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    return engine


def kernel_profile(engine: PagedEngine, label: str, steps: int = 10) -> None:
    """GPU kernels and host calls of `steps` decode steps (torch profiler)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps * 1000
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=12, max_name_column_width=60
    )
    print(f"\n### {label}: {wall:.2f} ms per step under the profiler ({steps} steps)\n", flush=True)
    print(table, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--profile-batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(
            build(Path(tmp) / "m", args.tokenizer_dir), device="cuda", dtype="bfloat16"
        )
    for graphs in (False, True):
        engine = filled_engine(loaded, args.profile_batch, args.prompt, graphs)
        label = "after: CUDA graphs + fused kernels" if graphs else "before: eager"
        kernel_profile(engine, f"{label}, batch {args.profile_batch}")
        del engine
        torch.cuda.empty_cache()
    engine = filled_engine(loaded, args.batch, args.prompt, graphs=True)
    host_profile(engine, args.batch, args.steps)


def host_profile(engine: PagedEngine, batch: int, steps: int) -> None:
    started = time.perf_counter()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - started) / steps * 1000
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(15)
    print(stream.getvalue(), flush=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    captured = graphs._captured[batch]
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(50):
        captured.graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(
        f"batch {batch}: step {per_step:.2f} ms (under cProfile), "
        f"graph replay alone {start.elapsed_time(end) / 50:.2f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
