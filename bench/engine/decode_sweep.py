"""The decode-step sweep of the GPU engine benchmark: whole engine steps against the roofline.

This module owns phase 2 of a run: for each batch size b, b sequences of one prompt length are
put in a fresh PagedEngine and run until every one of them decodes; then a run of consecutive
`engine.step()` calls that decode all b is timed, with the device synchronized only before the
first and after the last, and the mean period is set against the roofline (weight bytes + KV
bytes read, over the measured copy rate; see bench.engine.roofline). A synchronization around
every step would hide what async scheduling buys: the host preparing step N+1 while the device
runs step N. The same batch also runs in an engine with async scheduling off, the baseline in
the same run. It returns one row per batch size, the rows the results file keeps under
"decode_sweep".
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Any

from bench.engine.harness import Progress, free_device_memory, sync
from bench.engine.metrics import kv_bytes_per_token, roofline_ms
from bench.engine.roofline import kv_block_bytes, weight_bytes
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, dtype_size
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel


def _decode_step(engine: PagedEngine, generated: dict[str, int]) -> int:
    """One engine step; counts each sequence's tokens; returns how many sequences sampled."""
    outputs = engine.step()
    for output in outputs:
        generated[output.request_id] += len(output.new_token_ids)
    return len(outputs)


def decode_sweep(
    loaded: LoadedModel,
    args: argparse.Namespace,
    bandwidth: float,
    budget_s: float,
    log: Progress,
    *,
    with_sync: bool = True,
) -> list[dict[str, Any]]:
    """For each batch size b: b sequences of prompt length L in a fresh engine, run until all
    decode, then the median time of whole engine.step() calls that decode all b of them
    (`with_sync`: also in an engine with async scheduling off)."""
    spec = KVCacheSpec.from_config(loaded.model.config)
    per_block = kv_block_bytes(loaded, args.block_size)
    per_token = kv_bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_size(loaded.dtype)
    )
    weights = weight_bytes(loaded)
    prompt_len = args.decode_prompt_len
    vocab = len(loaded.tokenizer)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for b in args.decode_batch_sizes:
        if time.perf_counter() - started > budget_s:
            rows.append({"batch_size": b, "skipped": "decode sweep budget spent"})
            continue
        times_ms, kv_tokens, full_batches = _time_batch(loaded, args, b, per_block, vocab, True)
        row = _sweep_row(
            b, prompt_len, times_ms, kv_tokens, full_batches, weights, per_token, bandwidth
        )
        if with_sync:
            sync_ms, _, _ = _time_batch(loaded, args, b, per_block, vocab, False)
            row["sync_step_ms"] = statistics.fmean(sync_ms)
            row["async_speedup"] = row["sync_step_ms"] / row["decode_step_ms"]
        rows.append(row)
        log(
            f"  decode b={b}: {row['decode_step_ms']:.2f} ms/step "
            f"(roofline {row['roofline_step_ms']:.3f} ms, x{row['ratio_to_roofline']:.2f}"
            + (f"; without async scheduling {row['sync_step_ms']:.2f} ms" if with_sync else "")
            + f"), {row['decode_tok_s']:.0f} tok/s"
        )
    return rows


def _time_batch(
    loaded: LoadedModel,
    args: argparse.Namespace,
    b: int,
    per_block: int,
    vocab: int,
    overlap: bool,
) -> tuple[list[float], list[int], int]:
    """The timed decode steps of batch size b in a fresh engine: (per-step host times in ms, KV
    tokens read at each step, how many steps decoded all b sequences). The device is synchronized
    only around the whole run, so the mean of the step times is the steady-state period."""
    device = loaded.device
    prompt_len = args.decode_prompt_len
    step_tokens = max(args.max_num_batched_tokens, prompt_len)
    prefill_steps = math.ceil(b * prompt_len / step_tokens) + 1
    max_tokens = prefill_steps + args.decode_warmup_steps + args.decode_steps + 4
    total_len = prompt_len + max_tokens
    if total_len > loaded.max_model_len:
        raise ValueError(f"decode sweep needs {total_len} positions > {loaded.max_model_len}")
    blocks = b * math.ceil(total_len / args.block_size)
    num_blocks = int(blocks * 1.05) + 16  # the scheduler keeps a 1% watermark out of plans
    engine = PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=b,
            max_num_batched_tokens=step_tokens,
            block_size=args.block_size,
            kv_cache_bytes=num_blocks * per_block,
            async_scheduling=overlap,
        ),
    )
    try:
        generated = _start_decoding(engine, args, b, max_tokens, prefill_steps, vocab)
        for _ in range(args.decode_warmup_steps):
            _decode_step(engine, generated)
        times_ms: list[float] = []
        kv_tokens: list[int] = []
        full_batches = 0
        sync(device)
        began = time.perf_counter()
        for _ in range(args.decode_steps):
            # Each sequence attends to its prompt and every token generated so far (with async
            # scheduling the counts lag one step behind what the device computes: same mean).
            kv_tokens.append(sum(prompt_len + g for g in generated.values()))
            count = _decode_step(engine, generated)
            now = time.perf_counter()
            times_ms.append((now - began) * 1000.0)
            began = now
            full_batches += count == b
        sync(device)
        times_ms[-1] += (time.perf_counter() - began) * 1000.0
    finally:
        del engine
        free_device_memory(device)
    return times_ms, kv_tokens, full_batches


def _start_decoding(
    engine: PagedEngine,
    args: argparse.Namespace,
    b: int,
    max_tokens: int,
    prefill_steps: int,
    vocab: int,
) -> dict[str, int]:
    """Adds b random prompts and steps until every sequence has sampled a token; returns the
    tokens generated per sequence so far."""
    prompt_len = args.decode_prompt_len
    rng = random.Random(f"decode-{args.seed}-{b}")
    generated: dict[str, int] = {}
    for i in range(b):
        rid = f"decode-{b}-{i}"
        generated[rid] = 0
        engine.add_request(
            EngineRequest(
                rid,
                tuple(rng.randrange(vocab) for _ in range(prompt_len)),
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
        )

    guard = 0
    while min(generated.values()) == 0:
        _decode_step(engine, generated)
        guard += 1
        if guard > 10 * prefill_steps + 100:
            raise RuntimeError(f"batch {b}: sequences never all reached decoding")
    return generated


def _sweep_row(
    b: int,
    prompt_len: int,
    times_ms: list[float],
    kv_tokens: list[int],
    full_batches: int,
    weights: int,
    per_token: int,
    bandwidth: float,
) -> dict[str, Any]:
    """The results row of one batch size: the step time against the roofline."""
    median_ms = statistics.fmean(times_ms)  # the period: see the module docstring
    mean_kv_tokens = statistics.fmean(kv_tokens)
    kv_read = mean_kv_tokens * per_token
    roof = roofline_ms(weights + kv_read, bandwidth)
    return {
        "batch_size": b,
        "prompt_len": prompt_len,
        "mean_context_len": mean_kv_tokens / b,
        "timed_steps": len(times_ms),
        "steps_decoding_all": full_batches,
        "decode_step_ms": median_ms,
        "decode_step_ms_p10": statistics.quantiles(times_ms, n=10)[0]
        if len(times_ms) > 1
        else median_ms,
        "decode_step_ms_p90": statistics.quantiles(times_ms, n=10)[-1]
        if len(times_ms) > 1
        else median_ms,
        "weight_bytes": weights,
        "kv_bytes_read": kv_read,
        "roofline_step_ms": roof,
        "ratio_to_roofline": median_ms / roof,
        "decode_tok_s": b / (median_ms / 1000.0),
    }
