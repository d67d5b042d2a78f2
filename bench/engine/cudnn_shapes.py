"""How cuDNN's attention graph should be shaped for chunked prefill: one measurement.

For one prompt prefilled in chunks (bench.engine.prefill_kernels' inputs), every chunk's context
gathered out of the paged cache, this times three ways to hand a chunk to cuDNN (SDPA graph,
diagonal anchored bottom-right):

- exact: dense dims equal to the chunk's query and context lengths (a graph per shape);
- ragged: what site_engine/engine/cuda/cudnn_prefill.py builds (ragged rows, the actual lengths
  as tensors with the padding mask, dims bucketed so one graph serves many shapes);
- whole: torch's SDPA over the whole prompt (cuDNN, top-left causal): the speed to reach;

and how long a graph takes to build (the first one, then one per new shape), which decides
whether exact shapes can be built per step. (A kernel cache, cuDNN's dynamic shapes, built new
shapes in 6 ms instead of 39 but its graphs then timed at an impossible 0.1-0.4 ms a prompt:
not used.)

    python -m bench.engine.cudnn_shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import results_dir
from bench.engine.prefill_kernels import (
    HeadLayout,
    _gathered,
    _inputs,
    _sdpa_candidate,
    _time_ms,
    attention_flops,
    chunk_plan,
)


def _build_exact(cudnn: Any, handle: Any, s_q: int, s_kv: int, layout: HeadLayout,
                 scale: float, cache: Any) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    bf16 = cudnn.data_type.BFLOAT16
    options: dict[str, Any] = {}
    if cache is not None:
        options = {"kernel_cache": cache}  # which turns cuDNN's dynamic shapes on
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle,
                          **options)  # fmt: skip
    h, hkv, d = layout.heads, layout.kv_heads, layout.head_dim
    q = graph.tensor(name="q", dim=[1, h, s_q, d], stride=[s_q * h * d, d, h * d, 1],
                     data_type=bf16)  # fmt: skip
    kv = {"dim": [1, hkv, s_kv, d], "stride": [s_kv * hkv * d, d, hkv * d, 1], "data_type": bf16}
    k = graph.tensor(name="k", **kv)
    v = graph.tensor(name="v", **kv)
    o, _ = graph.sdpa(name="exact", q=q, k=k, v=v, generate_stats=False, attn_scale=scale,
                      diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                      diagonal_band_right_bound=0)  # fmt: skip
    o.set_output(True).set_dim([1, h, s_q, d]).set_stride([s_q * h * d, d, h * d, 1])
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, {"q": q, "k": k, "v": v, "o": o}


def _exact_candidate(cudnn: Any, handle: Any, layout: HeadLayout, cache: Any,
                     builds: list[float]) -> Callable[..., torch.Tensor]:  # fmt: skip
    graphs: dict[tuple[int, int], tuple[Any, dict[str, Any]]] = {}

    def run(x: Any, plan: Sequence[tuple[int, int]], scale: float) -> torch.Tensor:
        out = torch.empty_like(x.query)
        for cached, new in plan:
            shape = (new, cached + new)
            if shape not in graphs:
                start = time.perf_counter()
                graphs[shape] = _build_exact(cudnn, handle, new, cached + new, layout, scale,
                                             cache)  # fmt: skip
                builds.append((time.perf_counter() - start) * 1000)
            graph, t = graphs[shape]
            k, v = _gathered(x, cached + new)
            workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8,
                                    device=out.device)  # fmt: skip
            graph.execute({t["q"]: x.query[cached : cached + new].contiguous(), t["k"]: k,
                           t["v"]: v, t["o"]: out[cached : cached + new]}, workspace,
                          handle=handle)  # fmt: skip
        return out

    return run


def measure(prompts: Sequence[int], chunk: int, reps: int) -> dict[str, Any]:
    import logging

    import cudnn

    logging.basicConfig(level=logging.INFO)

    from bench.engine.prefill_kernels import _cudnn_long, _reference_tail

    layout = HeadLayout(32, 8, 64)
    scale = layout.head_dim**-0.5
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    builds: dict[str, list[float]] = {"exact": []}
    candidates = {
        "whole": _sdpa_candidate(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        "ragged": _cudnn_long(gather=True),
        "exact": _exact_candidate(cudnn, handle, layout, None, builds["exact"]),
    }
    rows = []
    for prompt in prompts:
        plan = chunk_plan(prompt, chunk)
        flops = attention_flops(plan, layout)
        x = _inputs(prompt, layout, 16, seed=prompt)
        reference = _reference_tail(x, 64, scale)
        for name, run in candidates.items():
            row: dict[str, Any] = {"prompt": prompt, "candidate": name}
            try:
                out = run(x, plan, scale)
                row["rel_error_tail"] = float((out[-64:].float() - reference).norm()
                                              / reference.norm())  # fmt: skip
                call = functools.partial(run, x, plan, scale)
                row["ms"] = statistics.median(_time_ms(call, reps))
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(row, flush=True)
            rows.append(row)
    return {"rows": rows, "build_ms": builds, "cudnn": int(cudnn.backend_version()),
            "device": torch.cuda.get_device_name()}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.cudnn_shapes")
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192, 16384, 32000])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--results-dir", type=Path, default=results_dir("engine_prefill"))
    parser.add_argument("--name", default="engine_cudnn_shapes")
    args = parser.parse_args(argv)
    payload = measure(args.prompts, args.chunk, args.reps)
    payload["command"] = "python -m bench.engine.cudnn_shapes " + " ".join(argv or [])
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    print(json.dumps(payload["build_ms"]))


if __name__ == "__main__":
    main()
