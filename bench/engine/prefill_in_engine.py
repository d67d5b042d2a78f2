"""The varlen kernel on a real engine step's inputs, against the same step rebuilt: where the
engine's long-context attention time goes.

The engine's profile at 32k (engine_prefill_long_h100_profile_engine.txt) puts the varlen
kernel at ~13.6 ms a layer for the whole prompt, while bench.engine.prefill_kernels times the
same kernel and configuration at ~11.4 ms on the same chunk plan. This takes one prompt through
a PagedEngine run eagerly (no CUDA graphs, so that Python sees each launch) and keeps the
attention inputs of layer 0's last chunk: the query, the engine's own cache views, block table
and offsets. Then it times the kernel alone on variants of those inputs, each differing from the
engine's launch in one respect (triton's do_bench, median, L2 flushed before each run):

- engine: the inputs as the engine passed them (one-token chunks left to the decode kernel);
- padded_256 / padded_1024: the sequence arrays padded as a captured step pads them to
  max_num_seqs, and the query rows to the step's token bucket;
- q_contiguous: the query copied into a contiguous tensor;
- compact: the sequence's blocks copied into a cache of just those blocks, in order;
- shuffled: the same blocks scattered over that small cache at random (prefill_kernels' layout);
- random_values: shuffled, with fresh standard-normal query, keys and values;
- graph, graph padded_1024: the engine's launch (and the padded one) replayed from a captured
  CUDA graph;
- after the MLP's GEMMs: the engine's launch right after the chunk's MLP matrix products, the
  products' own time subtracted.

(b16c3b9 also timed a grid with the KV heads as its fastest axis: 5.10 against 4.49 ms at 32k;
that run's results files hold its rows.)

Every variant's output (real rows) is compared with the engine variant's, except random_values.

    python -m bench.engine.prefill_in_engine --tokenizer-dir <gpt2> [--prompt 32000]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import bench.common as common
from bench.common import markdown_table
from bench.engine.harness import Progress
from bench.engine.model_setup import LLAMA_1B_LONG_SHAPE, ensure_model
from bench.engine.paths import shared_path
from bench.engine.prefill_kernels import HeadLayout, attention_flops
from bench.engine.prefill_long import _prompt
from bench.engine.report import versions
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine

Inputs = dict[str, Any]


def engine_inputs(loaded: Any, prompt: int, chunk: int) -> tuple[Inputs, PagedEngine]:
    """The attention inputs of layer 0's last chunk of one eager prefill, and the engine that
    still holds its cache (the keys and values stay in the freed, cached blocks)."""
    from unittest import mock

    from site_engine.engine.cuda import attention as cuda_attention
    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention as original

    kept: Inputs = {}

    def keep(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             block_tables: torch.Tensor, query_start_loc: torch.Tensor,
             context_lens: torch.Tensor, **options: Any) -> torch.Tensor:  # fmt: skip
        if not kept and int(context_lens.max()) >= prompt:
            kept.update(query=_strided_copy(query, query.shape[0]),
                        query_strides=tuple(query.stride()),
                        key_cache=key_cache, value_cache=value_cache,
                        block_tables=block_tables.clone(), query_start_loc=query_start_loc.clone(),
                        context_lens=context_lens.clone(), options=dict(options))  # fmt: skip
        return original(query, key_cache, value_cache, block_tables, query_start_loc,
                        context_lens, **options)  # fmt: skip

    with mock.patch.object(cuda_attention, "paged_prefill_attention", keep):
        config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=chunk, cuda_graphs=False)
        engine = PagedEngine(loaded, config)
        greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest("long", tuple(_prompt(loaded.vocab_size, prompt, 5)),
                                         greedy))  # fmt: skip
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
    if not kept:
        raise RuntimeError("no varlen launch reached the prompt's length")
    return kept, engine


def _strided_copy(query: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows with `query`'s strides (the engine's query is a view of the fused QKV
    output, rows 3,072 elements apart), the first ones `query`'s, the rest zeros."""
    copy = torch.empty_strided((rows, *query.shape[1:]), query.stride(), dtype=query.dtype,
                               device=query.device)  # fmt: skip
    copy.zero_()
    copy[: query.shape[0]] = query
    return copy


def _launch(x: Inputs, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention

    options = {**x["options"], "num_tokens": x["num_tokens"], "out": out}
    return lambda: paged_prefill_attention(
        x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["query_start_loc"],
        x["context_lens"], **options,
    )  # fmt: skip


def _padded(x: Inputs, seqs: int, bucket: int) -> Inputs:
    n = x["context_lens"].shape[0]
    extra = seqs - n
    query = _strided_copy(x["query"], bucket)
    return {
        **x, "query": query, "num_tokens": bucket,
        "query_start_loc": torch.cat([x["query_start_loc"],
                                      x["query_start_loc"][-1:].repeat(extra)]),
        "context_lens": torch.cat([x["context_lens"], x["context_lens"].new_ones(extra)]),
        "block_tables": torch.cat([x["block_tables"], x["block_tables"][:1].repeat(extra, 1)]),
    }  # fmt: skip


def _compact(x: Inputs, shuffle: bool, random_values: bool) -> Inputs:
    """The sequence's blocks in a cache of their own (one sequence: the engine's step has one)."""
    block_size = x["key_cache"].shape[1]
    used = -(-int(x["context_lens"][0]) // block_size)
    blocks = x["block_tables"][0, :used].long()
    keys, values = x["key_cache"][blocks], x["value_cache"][blocks]
    query = x["query"]
    if random_values:
        keys, values, query = (
            torch.randn_like(keys),
            torch.randn_like(values),
            torch.randn_like(query),
        )
    spare = 8 if shuffle else 0
    order = torch.randperm(used + spare, device=keys.device)[:used] if shuffle else \
        torch.arange(used, device=keys.device)  # fmt: skip
    key_cache = keys.new_zeros((used + spare, *keys.shape[1:]))
    value_cache = torch.zeros_like(key_cache)
    key_cache[order], value_cache[order] = keys, values
    table = torch.zeros_like(x["block_tables"][:1])
    table[0, :used] = order.to(table.dtype)
    return {**x, "query": query, "key_cache": key_cache, "value_cache": value_cache,
            "block_tables": table, "query_start_loc": x["query_start_loc"][:2],
            "context_lens": x["context_lens"][:1]}  # fmt: skip


def _graphed(launch: Callable[[], torch.Tensor]) -> Callable[[], object]:
    """The launch captured as the engine captures its steps (warm-ups, side stream)."""
    from site_engine.engine.graphs.decode_graphs import capture_buckets

    graph, _ = capture_buckets((1,), lambda _size: launch())[1]
    return graph.replay


def measure(x: Inputs, reps_ms: int = 300) -> list[dict[str, Any]]:
    import triton.testing

    tokens = x["query"].shape[0]
    x = {**x, "num_tokens": tokens}
    bucket = max(tokens, 8192)
    variants: dict[str, Inputs] = {
        "engine": x,
        "engine, one-token chunks kept": {**x, "options": {**x["options"], "skip_single": False}},
        "padded_256": _padded(x, 256, bucket),
        "padded_1024": _padded(x, 1024, bucket),
        "q_contiguous": {**x, "query": x["query"].contiguous()},
        "compact": _compact(x, shuffle=False, random_values=False),
        "shuffled": _compact(x, shuffle=True, random_values=False),
        "random_values": _compact(x, shuffle=True, random_values=True),
    }
    layout = HeadLayout(x["query"].shape[1], x["key_cache"].shape[2], x["query"].shape[2])
    cached = int(x["context_lens"][0]) - tokens
    flops = attention_flops([(cached, tokens)], layout)
    reference: torch.Tensor | None = None
    rows = []
    graphed = {"graph": x, "graph, padded_1024": variants["padded_1024"]}
    for name, inputs in [*variants.items(), *graphed.items()]:
        out = torch.full_like(inputs["query"], float("nan"))
        launch = _launch(inputs, out)
        run = _graphed(launch) if name.startswith("graph") else launch
        run()
        torch.cuda.synchronize()
        ms = float(triton.testing.do_bench(run, warmup=50, rep=reps_ms, return_mode="median"))
        real = out[:tokens].float()
        if reference is None:
            reference = real.clone()
        error = None if name == "random_values" else \
            float((real - reference).norm() / reference.norm())  # fmt: skip
        rows.append({"variant": name, "ms": ms, "tflops": flops / ms / 1e9,
                     "rel_error_vs_engine": error})  # fmt: skip
    rows.append(_after_gemms(_launch(x, torch.empty_like(x["query"])), tokens, flops, reps_ms))
    return rows


def _after_gemms(
    launch: Callable[[], torch.Tensor], tokens: int, flops: float, reps_ms: int
) -> dict[str, Any]:
    """The engine's launch right after the chunk's MLP matrix products (1B shape: gate-up
    2,048 -> 16,384 and down 8,192 -> 2,048 over the chunk's rows), timed as (GEMMs + kernel) -
    GEMMs: whether the tensor-core load before each attention launch in a forward pass (clocks,
    power, L2) slows the kernel."""
    import triton.testing

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    hidden, gate_up, down_in = rand(tokens, 2048), rand(2048, 16384), rand(tokens, 8192)
    down = rand(8192, 2048)

    def gemms() -> None:
        torch.mm(hidden, gate_up)
        torch.mm(down_in, down)

    def both() -> None:
        gemms()
        launch()

    alone = float(triton.testing.do_bench(gemms, warmup=50, rep=reps_ms, return_mode="median"))
    together = float(triton.testing.do_bench(both, warmup=50, rep=reps_ms, return_mode="median"))
    ms = together - alone
    return {"variant": f"after the MLP's GEMMs ({alone:.3f} ms, subtracted)", "ms": ms,
            "tflops": flops / ms / 1e9, "rel_error_vs_engine": None}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.engine.prefill_in_engine")
    parser.add_argument("--prompt", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/fedllm-bench-llama1b-long"))
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--results-dir", type=Path, default=common.results_dir("engine_prefill"))
    parser.add_argument("--name", default="engine_prefill_in_engine_h100")
    args = parser.parse_args(argv)
    log = Progress()
    tokenizer = shared_path(args.tokenizer_dir, "tokenizers", "gpt2").resolve()
    loaded = ensure_model(args.model_dir, LLAMA_1B_LONG_SHAPE, tokenizer, log)
    inputs, engine = engine_inputs(loaded, args.prompt, args.chunk)
    log(f"kept layer 0's last chunk: {inputs['query'].shape[0]} query tokens over "
        f"{int(inputs['context_lens'][0])} positions, query strides {inputs['query_strides']}, "
        f"{inputs['context_lens'].shape[0]} sequence(s)")  # fmt: skip
    rows = measure(inputs)
    engine.close()
    payload = {"command": common.command_line("bench.engine.prefill_in_engine", argv),
               "versions": versions(), "device": torch.cuda.get_device_name(),
               "prompt": args.prompt, "chunk": args.chunk, "rows": rows}  # fmt: skip
    table = markdown_table(
        ["variant", "ms (last chunk, layer 0)", "TFLOP/s", "rel. error vs engine"],
        [[r["variant"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
          "-" if r["rel_error_vs_engine"] is None else f"{r['rel_error_vs_engine']:.1e}"]
         for r in rows],
    )  # fmt: skip
    text = (f"# {args.name}\n\nCommand: `{payload['command']}`\n\nDevice: {payload['device']}\n\n"
            f"{table}\n")  # fmt: skip
    out_dir = args.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    (out_dir / f"{args.name}.md").write_text(text)
    print(text, flush=True)
    return payload


if __name__ == "__main__":
    main()
