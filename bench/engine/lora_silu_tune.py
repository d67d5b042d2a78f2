"""Issue 77's probe of gate/up's LoRA deltas fused into silu_mul (kept under the tag
study/lora-silu-mul): the fused kernel at each column block and warp count against the expand
followed by silu_mul, the 8B shape's gate/up at 256 decode rows over 8 and 64 adapters, each op
as CUDA-graph replays of 20 calls (gate_up stays in L2 between calls: the elementwise part is
faster here than in a step). Run on a GPU from the repository root:
    PYTHONPATH=$PWD python3 bench/engine/lora_silu_tune.py"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable

import torch

from site_engine.engine.cuda import elementwise
from site_engine.engine.cuda import lora_segmented as ls

WIDTH, HIDDEN, RANK, SLOTS, ROWS = 14336, 4096, 16, 64, 256


def timed(fn: Callable[[], object], n: int = 200) -> float:
    """Microseconds a call, over graph replays of 20 calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(n // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) * 1000 / n


def old_path(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, seg: ls.Segments) -> None:
    ls.lora_expand(shrunk, b, y, seg, (WIDTH, WIDTH))
    elementwise.silu_mul(y)


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    a = (torch.randn(SLOTS, HIDDEN, 2 * RANK, device=dev) * 0.05).to(dt)
    b = (torch.randn(SLOTS, RANK, 2 * WIDTH, device=dev) * 0.05).to(dt)
    scaling = torch.ones(SLOTS, device=dev)
    x = torch.randn(ROWS, HIDDEN, device=dev).to(dt)
    gate_up = torch.randn(ROWS, 2 * WIDTH, device=dev).to(dt)
    for adapters in (8, 64):
        slots = (torch.arange(ROWS, device=dev) % adapters).to(torch.int64)
        seg = ls.segments(slots, SLOTS)
        shrunk = ls.lora_shrink(x, a, scaling, seg)
        row: dict[str, float] = {
            "silu_mul_alone": timed(functools.partial(elementwise.silu_mul, gate_up)),
            "expand_then_silu_mul": timed(
                functools.partial(old_path, shrunk, b, gate_up.clone(), seg)
            ),
        }
        for cols, warps in itertools.product((32, 64, 128, 256), (2, 4, 8)):
            fused = functools.partial(
                ls.lora_silu_mul, shrunk, b, gate_up, seg, block_n=cols, warps=warps
            )
            row[f"fused_n{cols}_w{warps}"] = timed(fused)
        print(adapters, json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
