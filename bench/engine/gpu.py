"""GPU engine benchmark: this engine against transformers on one trace, and decode steps
against the HBM roofline, in one run.

    python -m bench.engine.gpu          (writes bench/results/engine_h200.{json,md})
    python -m bench.engine.gpu --small --device cpu --dtype float32    (smoke test)

A Llama-3.2-1B-shaped model with random weights (bf16) is built with transformers, saved, and
loaded back through site_engine.model_loading.load_model, as a user's model directory would be.
The trace replays real prompts (GPT-2 token ids of Alpaca random rows and LIMA) with their
reference response lengths (greedy, ignore_eos). Phases, each with progress lines on stdout:

1. copy bandwidth: a large device-to-device copy, the measured HBM rate;
2. decode sweep: the median time of a whole `engine.step()` with b sequences decoding at a
   prompt length of 512, against roofline = (weight bytes + KV bytes read) / copy rate;
3. this engine, all requests at once ("burst"), on the whole trace;
4. this engine, burst, on the subset the transformers baselines run (same requests);
5. this engine, Poisson arrivals at --poisson-rate requests/s, on the whole trace;
6. transformers `generate` with static batches on the subset;
7. transformers continuous batching (generate_batch's manager) on the subset.

Results are rewritten after every phase (with "complete": false until the end), so a run cut
short by a time limit still leaves what it measured; --deadline-s shrinks the budgets of later
phases so that the whole run ends in time.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import bench.common as common
from bench.common import markdown_table
from bench.engine.hf_baselines import BaselineResult, run_hf_generate, run_hf_generate_batch
from bench.engine.metrics import (
    RequestTiming,
    RunSummary,
    kv_bytes_per_token,
    roofline_ms,
    summarize_run,
)
from bench.engine.workload import (
    WorkloadRequest,
    WorkloadSpec,
    describe_workload,
    load_workload,
    poisson_arrivals,
)
from predictor.datasets import data_dir as default_data_dir
from site_engine.engine.api import EngineRequest, RequestRejected
from site_engine.engine.kv_cache import KVCacheSpec, dtype_size, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine.types import SamplingParams
from site_engine.model_loading import LoadedModel, load_model
from site_engine.tokenizer import load_tokenizer

GIB = 1 << 30
MIB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parent.parent.parent

# Llama-3.2-1B's shape (default rope: the rope variant does not change the cost of a step).
LLAMA_1B_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
SMALL_SHAPE: dict[str, Any] = {
    **LLAMA_1B_SHAPE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50304,
}

# Defaults of the full run, and of --small (a smoke test on CPU); flags given explicitly win.
FULL_DEFAULTS: dict[str, Any] = {
    "requests_alpaca": 800,
    "requests_lima": 200,
    "max_num_seqs": 256,
    "hf_requests": 256,
    "decode_batch_sizes": [1, 32, 64, 128, 256],
    "decode_steps": 64,
    "decode_warmup_steps": 8,
    "decode_prompt_len": 512,
    "copy_mib": 4096,
    "max_prompt_tokens": 1024,
    "max_response_tokens": 1024,
    "poisson_rate": 20.0,
    "engine_warmup_requests": 8,
    "name": "engine_h200",
}
SMALL_DEFAULTS: dict[str, Any] = {
    "requests_alpaca": 6,
    "requests_lima": 2,
    "max_num_seqs": 4,
    "hf_requests": 3,
    "decode_batch_sizes": [1, 2],
    "decode_steps": 3,
    "decode_warmup_steps": 1,
    "decode_prompt_len": 16,
    "copy_mib": 16,
    "max_prompt_tokens": 48,
    "max_response_tokens": 12,
    "poisson_rate": 50.0,
    "engine_warmup_requests": 2,
    "name": "engine_small",
}
ROOFLINE_METHOD = (
    "roofline_step_ms = bytes read by one decode step / measured copy rate. Bytes read = every "
    "parameter once (the tied embedding counted once: the lm_head matmul reads it) + the KV of "
    "every running sequence (b * context_len * 2 (K and V) * layers * kv_heads * head_dim * "
    "dtype bytes, context_len = the tokens each sequence attends to at that step, averaged over "
    "the timed steps). Copy rate = (bytes read + bytes written) / time of a device-to-device "
    "copy of copy_bandwidth.bytes (median of 10 after 3 warm-ups): a decode step is almost all "
    "reads, and HBM traffic is what bounds it, so the time of its traffic at the best rate "
    "measured for traffic is its lower bound. Activations, KV writes and logits are ignored "
    "(they are small at these sizes), so the ratio decode_step_ms / roofline_step_ms >= 1 "
    "measures how far a whole engine step (scheduling, input building, kernels, sampling) is "
    "from the memory bound."
)


class Progress:
    """Timestamped progress lines, flushed at once (the run is watched remotely)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)


# --- arguments ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.gpu", description=(__doc__ or "").split("\n\n")[0]
    )
    add = parser.add_argument
    add("--requests-alpaca", type=int, help="Alpaca random rows in the trace (800)")
    add("--requests-lima", type=int, help="LIMA records in the trace (200)")
    add("--max-num-seqs", type=int, help="engine batch limit, also the static batch size (256)")
    add("--max-num-batched-tokens", type=int, default=4096, help="engine tokens per step")
    add("--block-size", type=int, default=16)
    add("--kv-cache-gib", type=float, default=0.0, help="KV budget; 0 lets the engine size it")
    add("--poisson-rate", type=float, help="requests/s of the Poisson run (20)")
    add("--hf-requests", type=int, help="requests of the burst trace the baselines run (256)")
    add("--skip-hf", action="store_true", help="skip both transformers baselines")
    add("--skip-poisson", action="store_true")
    add("--engine-warmup-requests", type=int, help="short requests before each engine run (8)")
    add(
        "--hf-batch-api",
        choices=("manager", "generate_batch"),
        default="manager",
        help="continuous batching through the manager (per-request max_new_tokens) or one "
        "generate_batch call (one max_new_tokens for all)",
    )
    add("--decode-batch-sizes", type=int, nargs="+", help="decode sweep batch sizes")
    add("--decode-steps", type=int, help="timed decode steps per batch size (64)")
    add("--decode-warmup-steps", type=int, help="untimed decode steps before those (8)")
    add("--decode-prompt-len", type=int, help="prompt length of the decode sweep (512)")
    add("--copy-mib", type=int, help="size of the bandwidth copy in MiB (4096)")
    add("--max-prompt-tokens", type=int, help="prompt cap in tokens (1024)")
    add("--max-response-tokens", type=int, help="response cap in tokens (1024)")
    add("--tokenizer-dir", type=Path, default=None, help="GPT-2 tokenizer (../shared/...)")
    add("--data-dir", type=Path, default=None, help="corpora (../shared/datasets)")
    add("--seed", type=int, default=0)
    add("--name", default=None, help="result file name (engine_h200)")
    add("--results-dir", type=Path, default=None, help="where results go (bench/results)")
    add("--small", action="store_true", help="tiny model and trace: a smoke test")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--time-budget-s", type=float, default=120.0, help="cap of each transformers baseline")
    add("--engine-time-budget-s", type=float, default=150.0, help="cap of each engine run")
    add("--deadline-s", type=float, default=480.0, help="the whole run; later phases shrink")
    args = parser.parse_args(argv)
    defaults = SMALL_DEFAULTS if args.small else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _first_existing(candidates: Sequence[Path]) -> Path | None:
    for path in candidates:
        if path.exists():
            return path
    return None


def shared_path(explicit: Path | None, *parts: str) -> Path:
    """An explicit path, else the first of FEDLLM_SHARED_DIR, ../shared (from the working
    directory), and shared/ next to or inside the checkout that holds `parts`."""
    if explicit is not None:
        return explicit
    roots = [Path(os.environ["FEDLLM_SHARED_DIR"])] if os.environ.get("FEDLLM_SHARED_DIR") else []
    roots += [Path("../shared"), REPO_ROOT.parent / "shared", REPO_ROOT / "shared"]
    found = _first_existing([root.joinpath(*parts) for root in roots])
    return found if found is not None else roots[-3].joinpath(*parts)


def resolve_data_dir(explicit: Path | None) -> Path:
    if explicit is not None or os.environ.get("FEDLLM_DATA_DIR"):
        return default_data_dir(explicit)
    try:
        return default_data_dir(None)
    except Exception:
        return default_data_dir(shared_path(None, "datasets"))


# --- model -------------------------------------------------------------------------------


def build_model_dir(
    out: Path,
    shape: dict[str, Any],
    tokenizer_dir: Path,
    dtype: torch.dtype,
    seed: int,
    device: str,
) -> tuple[Path, str]:
    """Random LlamaForCausalLM of `shape` saved with the tokenizer; returns (dir, where built)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    config = LlamaConfig(**shape, bos_token_id=int(eos), eos_token_id=int(eos))
    torch.manual_seed(seed)
    model = None
    built_on = "cpu"
    if torch.device(device).type == "cuda":
        try:  # initialising 1.2B parameters on the GPU takes seconds instead of a minute
            with torch.device(device):
                model = LlamaForCausalLM(config)
            built_on = device
        except Exception as exc:
            print(f"  building on {device} failed ({exc!r}); building on the CPU", flush=True)
            model = None
            gc.collect()
            torch.cuda.empty_cache()
    if model is None:
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, built_on


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of every parameter once (parameters() yields a tied tensor once)."""
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters())


def model_facts(loaded: LoadedModel, shape: dict[str, Any], built_on: str) -> dict[str, Any]:
    spec = KVCacheSpec.from_config(loaded.model.config)
    params = sum(p.numel() for p in loaded.model.parameters())
    return {
        "architecture": "LlamaForCausalLM, random weights (transformers init), seeded",
        "shape": shape,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "built_on": built_on,
        "parameters": params,
        "weight_bytes": weight_bytes(loaded),
        "tied_embeddings": bool(getattr(loaded.model.config, "tie_word_embeddings", False)),
        "kv_spec": asdict(spec),
        "kv_bytes_per_token": kv_bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_size(loaded.dtype)
        ),
        "max_model_len": loaded.max_model_len,
        "tokenizer_tokens": len(loaded.tokenizer),
        "attn_implementation": getattr(loaded.model.config, "_attn_implementation", None),
    }


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- copy bandwidth ----------------------------------------------------------------------


def measure_copy_bandwidth(
    device: torch.device, nbytes: int, repeats: int = 10, warmup: int = 3
) -> dict[str, Any]:
    """Median time of dst.copy_(src) for `nbytes` bytes; the rate counts read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    times_ms: list[float] = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            event = getattr(torch.cuda, "Event")  # noqa: B009 (untyped in some torch releases)
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = float(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            dst.copy_(src)
            elapsed = (time.perf_counter() - began) * 1000.0
        if i >= warmup:
            times_ms.append(elapsed)
    del src, dst
    free_device_memory(device)
    median_ms = statistics.median(times_ms)
    rate = 2 * nbytes / (median_ms / 1000.0)
    return {
        "bytes": nbytes,
        "median_ms": median_ms,
        "min_ms": min(times_ms),
        "read_write_bytes_per_s": rate,
        "read_write_gb_per_s": rate / 1e9,
        "timing": "CUDA events" if device.type == "cuda" else "perf_counter",
        "note": "rate = (bytes read + bytes written) / median time",
    }


# --- engine runs -------------------------------------------------------------------------


def _kv_block_bytes(loaded: LoadedModel, block_size: int) -> int:
    spec = KVCacheSpec.from_config(loaded.model.config)
    return kv_cache_bytes_per_block(spec, block_size, loaded.dtype)


def _used_blocks_probe(engine: PagedEngine) -> tuple[Callable[[], int], str]:
    """Reading blocks in use every step: engine.stats() walks every queued sequence (a few ms
    with a thousand waiting), so the scheduler's block manager is read when it is there and
    agrees with stats(); otherwise stats() is called every step."""
    blocks: Any = getattr(getattr(engine, "_scheduler", None), "_blocks", None)
    value = getattr(blocks, "num_used_blocks", None)
    if isinstance(value, int) and value == engine.stats().kv_blocks_used:
        return (lambda: int(blocks.num_used_blocks)), "block manager, every step"
    return (lambda: engine.stats().kv_blocks_used), "engine.stats(), every step"


def _warm_up(engine: PagedEngine, vocab: int, count: int, seed: int) -> None:
    """A few short requests through the engine, so first-call costs stay out of the run."""
    rng = random.Random(seed)
    for i in range(count):
        prompt = tuple(rng.randrange(vocab) for _ in range(16 + 24 * i))
        engine.add_request(
            EngineRequest(
                f"warmup-{i}",
                prompt,
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            )
        )
    while engine.has_unfinished():
        engine.step()


def engine_config(args: argparse.Namespace, max_num_seqs: int | None = None) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=max_num_seqs or args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gib * GIB),
    )


def run_engine(
    loaded: LoadedModel,
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    *,
    name: str,
    arrivals: Sequence[float] | None,
    poisson_rate: float | None,
    budget_s: float,
    log: Progress,
    seed: int,
    warmup_requests: int,
) -> tuple[RunSummary, dict[str, Any]]:
    """Drives a fresh PagedEngine in-process: adds each request when its arrival time has come
    (all at t=0 for a burst) and calls step() until every request is done or the budget ends."""
    device = loaded.device
    times = list(arrivals) if arrivals is not None else [0.0] * len(requests)
    engine = PagedEngine(loaded, config)
    try:
        limits = engine.limits
        warmup_count = min(warmup_requests, config.max_num_seqs)
        _warm_up(engine, len(loaded.tokenizer), warmup_count, seed)
        base = engine.stats()
        probe, probe_method = _used_blocks_probe(engine)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timings = {
            r.request_id: RequestTiming(
                request_id=r.request_id,
                arrival_s=t,
                expected_tokens=r.output_tokens,
                prompt_tokens=len(r.prompt_token_ids),
            )
            for r, t in zip(requests, times, strict=True)
        }
        total = len(requests)
        next_index = steps = rejected = sampled = peak_blocks = finished = produced = 0
        truncated = False
        started = time.perf_counter()
        last_log = started
        while True:
            now = time.perf_counter() - started
            while next_index < total and times[next_index] <= now:
                request = requests[next_index]
                timings[request.request_id].submitted_s = now
                try:
                    engine.add_request(
                        EngineRequest(
                            request.request_id,
                            request.prompt_token_ids,
                            SamplingParams(
                                max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True
                            ),
                        )
                    )
                except RequestRejected as exc:
                    rejected += 1
                    if rejected == 1:
                        log(f"  {name}: request rejected: {exc}")
                next_index += 1
            if now > budget_s:
                truncated = True
                break
            if not engine.has_unfinished():
                if next_index >= total:
                    break
                wait = times[next_index] - (time.perf_counter() - started)
                if wait > 0:
                    time.sleep(min(wait, max(budget_s - now, 0.0) + 0.01))
                continue
            outputs = engine.step()
            steps += 1
            stamp = time.perf_counter() - started
            peak_blocks = max(peak_blocks, probe())
            sampled += len(outputs)
            for output in outputs:
                timing = timings.get(output.request_id)
                if timing is None:
                    continue
                timing.record_tokens(stamp, len(output.new_token_ids))
                produced += len(output.new_token_ids)
                if output.finish_reason is not None and timing.finish_s is None:
                    timing.finish_s = stamp
                    finished += 1
            if stamp + started - last_log > 15.0:
                last_log = stamp + started
                log(
                    f"  {name}: {finished}/{total} done, {next_index} submitted, "
                    f"{produced} tokens, {steps} steps, {produced / max(stamp, 1e-9):.0f} tok/s"
                )
        wall = time.perf_counter() - started
        stats = engine.stats()
        max_allocated = (
            int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        )
        summary = summarize_run(
            name,
            list(timings.values()),
            arrival="burst" if arrivals is None else "poisson",
            poisson_rate=poisson_rate,
            wall_s=wall,
            steps=steps,
            rejected=rejected,
            truncated=truncated,
            preemptions=stats.num_preemptions - base.num_preemptions,
            kv_block_bytes=_kv_block_bytes(loaded, config.block_size),
            kv_blocks_total=limits.kv_blocks_total,
            peak_kv_blocks=peak_blocks,
            max_memory_allocated_bytes=max_allocated,
            mean_running=sampled / steps if steps else 0.0,
        )
        extra = {
            "engine_config": asdict(config),
            "engine_name": limits.name,
            "kv_capacity_bytes": limits.kv_blocks_total * summary.kv_block_bytes,
            "kv_peak_sampling": probe_method,
            "mean_running_meaning": "mean number of sequences that produced a token per step",
            "warmup_requests": warmup_count,
            "budget_s": budget_s,
        }
        return summary, extra
    finally:
        del engine
        free_device_memory(device)


# --- decode sweep ------------------------------------------------------------------------


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
) -> list[dict[str, Any]]:
    """For each batch size b: b sequences of prompt length L in a fresh engine, run until all
    decode, then the median time of whole engine.step() calls that decode all b of them."""
    device = loaded.device
    spec = KVCacheSpec.from_config(loaded.model.config)
    per_block = _kv_block_bytes(loaded, args.block_size)
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
            ),
        )
        try:
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
            for _ in range(args.decode_warmup_steps):
                _decode_step(engine, generated)
            times_ms: list[float] = []
            kv_tokens: list[int] = []
            full_batches = 0
            for _ in range(args.decode_steps):
                # Each sequence attends to its prompt and every token generated so far.
                kv_tokens.append(sum(prompt_len + g for g in generated.values()))
                sync(device)
                began = time.perf_counter()
                count = _decode_step(engine, generated)
                sync(device)
                times_ms.append((time.perf_counter() - began) * 1000.0)
                full_batches += count == b
        finally:
            del engine
            free_device_memory(device)
        median_ms = statistics.median(times_ms)
        mean_kv_tokens = statistics.fmean(kv_tokens)
        kv_read = mean_kv_tokens * per_token
        roof = roofline_ms(weights + kv_read, bandwidth)
        row = {
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
        rows.append(row)
        log(
            f"  decode b={b}: {median_ms:.2f} ms/step (roofline {roof:.3f} ms, "
            f"x{median_ms / roof:.1f}), {row['decode_tok_s']:.0f} tok/s"
        )
    return rows


# --- results -----------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _dist(run: dict[str, Any], key: str, pct: str) -> Any:
    dist = run.get(key)
    return None if not dist else dist.get(f"{pct}_ms")


def report(payload: dict[str, Any]) -> str:
    """The Markdown of everything measured so far."""
    parts: list[str] = []
    runs: dict[str, Any] = payload.get("runs", {})
    hf: dict[str, Any] = payload.get("hf", {})
    subset = payload.get("hf_subset_requests")
    parts.append("## Throughput (output tokens/s)\n")
    headline = [
        ("this engine, burst, whole trace", payload.get("engine_tok_s"), ""),
        (
            f"this engine, burst, first {subset} requests",
            payload.get("engine_subset_tok_s"),
            "",
        ),
        (
            f"transformers generate, static batches, first {subset} requests",
            payload.get("hf_generate_tok_s"),
            "useful tokens only" + _status_note(hf.get("generate")),
        ),
        (
            f"transformers continuous batching, first {subset} requests",
            payload.get("hf_generate_batch_tok_s"),
            _status_note(hf.get("generate_batch")).removeprefix("; "),
        ),
        (
            f"this engine, Poisson {payload.get('config', {}).get('poisson_rate')} req/s",
            payload.get("poisson_tok_s"),
            "offered load, not capacity",
        ),
    ]
    parts.append(
        markdown_table(("run", "tok/s", "note"), [(n, _fmt(v), note) for n, v, note in headline])
    )
    if runs:
        parts.append("\n## Engine runs\n")
        rows = []
        for name, run in runs.items():
            if "error" in run and "summary" not in run:
                rows.append((name, "error", *["-"] * 12))
                continue
            s = run["summary"]
            gib = (s["max_memory_allocated_bytes"] or 0) / GIB
            rows.append(
                (
                    name,
                    f"{s['completed']}/{s['requests']}" + (" (cut)" if s["truncated"] else ""),
                    _fmt(s["wall_s"]),
                    _fmt(s["output_tok_s"]),
                    _fmt(s["requests_per_s"], 2),
                    _fmt(_dist(s, "ttft", "p50")),
                    _fmt(_dist(s, "ttft", "p99")),
                    _fmt(_dist(s, "tpot", "p50"), 2),
                    _fmt(_dist(s, "tpot", "p99"), 2),
                    _fmt(s["peak_kv_bytes"] / GIB, 2),
                    _fmt(gib, 1) if s["max_memory_allocated_bytes"] is not None else "-",
                    s["preemptions"],
                    _fmt(s["mean_running"]),
                )
            )
        parts.append(
            markdown_table(
                (
                    "run",
                    "done",
                    "wall s",
                    "out tok/s",
                    "req/s",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "TPOT p50 ms",
                    "TPOT p99 ms",
                    "peak KV GiB",
                    "max alloc GiB",
                    "preempt",
                    "mean batch",
                ),
                rows,
            )
        )
    if hf:
        parts.append("\n## transformers baselines (same model, same requests)\n")
        parts.append(
            markdown_table(
                (
                    "baseline",
                    "status",
                    "requests done",
                    "useful tokens",
                    "computed tokens",
                    "wall s",
                    "useful tok/s",
                    "warm-up s",
                ),
                [
                    (
                        name,
                        r["status"],
                        f"{r['completed_requests']}/{r['requests']}",
                        r["useful_tokens"],
                        r["generated_tokens"],
                        _fmt(r["wall_s"]),
                        _fmt(r["useful_tok_s"]),
                        _fmt(r["warmup_s"]),
                    )
                    for name, r in hf.items()
                ],
            )
        )
        for name, r in hf.items():
            parts.append(f"\n- {name}: {r['api']}")
            if r.get("error"):
                last = [line for line in str(r["error"]).strip().splitlines() if line.strip()]
                parts.append(f"  - error: `{last[-1][:300] if last else r['error'][:300]}`")
    sweep = payload.get("decode_sweep")
    if sweep:
        bw = payload.get("copy_bandwidth", {})
        parts.append(
            f"\n## Decode step vs HBM roofline (copy rate {_fmt(bw.get('read_write_gb_per_s'))} "
            "GB/s read+write)\n"
        )
        parts.append(
            markdown_table(
                (
                    "batch",
                    "context",
                    "step ms (median)",
                    "roofline ms",
                    "ratio",
                    "decode tok/s",
                    "weights MiB",
                    "KV read MiB",
                ),
                [
                    (
                        row["batch_size"],
                        _fmt(row["mean_context_len"], 0),
                        _fmt(row["decode_step_ms"], 2),
                        _fmt(row["roofline_step_ms"], 3),
                        _fmt(row["ratio_to_roofline"], 1),
                        _fmt(row["decode_tok_s"], 0),
                        _fmt(row["weight_bytes"] / MIB, 0),
                        _fmt(row["kv_bytes_read"] / MIB, 0),
                    )
                    if "decode_step_ms" in row
                    else (row["batch_size"], row.get("skipped", "-"), *["-"] * 6)
                    for row in sweep
                ],
            )
        )
    trace = payload.get("trace", {})
    config = payload.get("config", {})
    model = payload.get("model", {})
    if trace:
        parts.append(
            f"\nTrace: {trace.get('requests')} requests {trace.get('by_corpus')}, "
            f"{trace.get('prompt_tokens')} prompt / {trace.get('output_tokens')} output tokens, "
            f"prompt cap {trace.get('max_prompt_tokens')}, response cap "
            f"{trace.get('max_output_tokens')}, seed {trace.get('seed')}; {trace.get('replay')}."
        )
    if model:
        parts.append(
            f"\nModel: {model.get('parameters')} parameters, {model.get('dtype')} on "
            f"{model.get('device')}, weights {_fmt(model.get('weight_bytes', 0) / MIB, 0)} MiB."
        )
    if config:
        parts.append(
            f"\nEngine: max_num_seqs {config.get('max_num_seqs')}, max_num_batched_tokens "
            f"{config.get('max_num_batched_tokens')}, block size {config.get('block_size')}, "
            f"KV budget {config.get('kv_cache_gib') or 'engine default (share of free memory)'}."
        )
    errors = payload.get("errors")
    if errors:
        parts.append("\nErrors: " + "; ".join(f"{k}: {str(v)[:200]}" for k, v in errors.items()))
    phases = payload.get("phases_s")
    if phases:
        parts.append("\nPhases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    if not payload.get("complete"):
        parts.append("\n**Incomplete: the run has not finished (or was cut short).**")
    return "\n".join(parts)


def _status_note(result: dict[str, Any] | None) -> str:
    if not result:
        return ""
    status = result.get("status")
    return "" if status == "ok" else f"; {status}"


def save(args: argparse.Namespace, payload: dict[str, Any], command: str) -> Path:
    """bench.common.write_results, into --results-dir when given."""
    previous = common.RESULTS_DIR
    if args.results_dir is not None:
        common.RESULTS_DIR = Path(args.results_dir)
    try:
        return common.write_results(args.name, payload, report(payload), command)
    finally:
        common.RESULTS_DIR = previous


# --- orchestration -----------------------------------------------------------------------


class Deadline:
    """Shrinks each phase's budget so the phases after it keep their minimum."""

    def __init__(self, progress: Progress, total_s: float) -> None:
        self.progress = progress
        self.total_s = total_s

    def budget(self, nominal: float, reserve_after: float) -> float:
        left = self.total_s - self.progress.elapsed() - reserve_after
        return max(0.0, min(nominal, left))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m bench.engine.gpu" + "".join(f" {shlex.quote(a)}" for a in argv)
    log = Progress()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on the GPU machine or pass --device cpu")
    deadline = Deadline(log, args.deadline_s)
    tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    data_dir = resolve_data_dir(args.data_dir)
    shape = SMALL_SHAPE if args.small else LLAMA_1B_SHAPE
    phases: dict[str, float] = {}
    errors: dict[str, str] = {}
    payload: dict[str, Any] = {
        "complete": False,
        "engine_tok_s": None,
        "hf_generate_tok_s": None,
        "hf_generate_batch_tok_s": None,
        "decode_step_ms": {},
        "roofline_step_ms": {},
        "config": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
        }
        | {"tokenizer_dir": str(tokenizer_dir), "data_dir": str(data_dir)},
        "phases_s": phases,
        "errors": errors,
        "versions": _versions(),
    }
    log(f"bench.engine.gpu on {device} ({args.dtype}); results name {args.name}")
    if device.type == "cuda":
        log(f"  {torch.cuda.get_device_name(device)}, torch {torch.__version__}")

    def phase_done(name: str, began: float) -> None:
        phases[name] = time.perf_counter() - began
        path = save(args, payload, command)
        memory = ""
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            memory = f"; {free / GIB:.1f}/{total / GIB:.1f} GiB free"
        log(f"{name} done in {phases[name]:.1f}s (results so far in {path}{memory})")

    # Trace.
    began = time.perf_counter()
    spec = WorkloadSpec(
        counts=(("alpaca_random", args.requests_alpaca), ("lima", args.requests_lima)),
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_response_tokens,
        seed=args.seed,
    )
    tokenizer = load_tokenizer(tokenizer_dir)
    workload = load_workload(spec, tokenizer.encode, data_dir)
    payload["trace"] = describe_workload(workload, spec)
    arrivals = poisson_arrivals(len(workload), args.poisson_rate, args.seed)
    payload["trace"]["poisson"] = {
        "rate_per_s": args.poisson_rate,
        "span_s": arrivals[-1],
        "mean_gap_s": arrivals[-1] / len(arrivals),
    }
    subset = workload[: args.hf_requests]
    payload["hf_subset_requests"] = len(subset)
    payload["hf_subset"] = {
        "requests": len(subset),
        "which": "the first requests of the burst trace, in arrival order",
        "output_tokens": sum(r.output_tokens for r in subset),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in subset),
    }
    log(
        f"trace: {len(workload)} requests {payload['trace']['by_corpus']}, "
        f"{payload['trace']['output_tokens']} output tokens"
    )
    phases["trace"] = time.perf_counter() - began

    # Model.
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-engine-gpu-") as tmp:
        model_dir, built_on = build_model_dir(
            Path(tmp) / "llama",
            shape,
            tokenizer_dir,
            {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
                args.dtype
            ],
            args.seed,
            args.device,
        )
        log(f"model saved ({time.perf_counter() - began:.1f}s); loading it with load_model")
        loaded = load_model(model_dir, device=args.device, dtype=args.dtype)
    payload["model"] = model_facts(loaded, shape, built_on)
    log(
        f"model: {payload['model']['parameters'] / 1e9:.3f}B parameters, "
        f"{payload['model']['weight_bytes'] / GIB:.2f} GiB"
    )
    phase_done("model", began)

    # Copy bandwidth and decode sweep.
    began = time.perf_counter()
    bandwidth: float | None = None
    try:
        copy = measure_copy_bandwidth(device, args.copy_mib * MIB)
        payload["copy_bandwidth"] = copy
        bandwidth = float(copy["read_write_bytes_per_s"])
        log(f"copy bandwidth: {copy['read_write_gb_per_s']:.0f} GB/s (read + write)")
    except Exception as exc:
        errors["copy_bandwidth"] = f"{type(exc).__name__}: {exc}"
        log(f"copy bandwidth failed: {exc!r}")
    free_device_memory(device)
    if bandwidth is not None:
        try:
            budget = deadline.budget(90.0, reserve_after=5 * 20.0)
            rows = decode_sweep(loaded, args, bandwidth, budget, log)
            payload["decode_sweep"] = rows
            payload["roofline_method"] = ROOFLINE_METHOD
            done = [r for r in rows if "decode_step_ms" in r]
            payload["decode_step_ms"] = {str(r["batch_size"]): r["decode_step_ms"] for r in done}
            payload["roofline_step_ms"] = {
                str(r["batch_size"]): r["roofline_step_ms"] for r in done
            }
            payload["decode_vs_roofline"] = {
                str(r["batch_size"]): r["ratio_to_roofline"] for r in done
            }
        except Exception as exc:
            errors["decode_sweep"] = f"{type(exc).__name__}: {exc}"
            log(f"decode sweep failed: {exc!r}")
    free_device_memory(device)
    phase_done("decode_sweep", began)

    runs: dict[str, Any] = {}
    payload["runs"] = runs
    run_hf = not args.skip_hf and len(subset) > 0
    engine_plan: list[tuple[str, list[WorkloadRequest], list[float] | None]] = [
        ("engine_burst", workload, None)
    ]
    if run_hf:
        engine_plan.append(("engine_subset_burst", subset, None))
    if not args.skip_poisson:
        engine_plan.append(("engine_poisson", workload, arrivals))
    hf_phases = 2 if run_hf else 0
    for index, (name, requests, times) in enumerate(engine_plan):
        began = time.perf_counter()
        later = (len(engine_plan) - index - 1) * 30.0 + hf_phases * 45.0
        nominal = args.engine_time_budget_s
        if name == "engine_subset_burst":
            nominal = min(nominal, 90.0)  # a quarter of the trace
        budget = deadline.budget(nominal, reserve_after=later)
        if budget < 5.0:
            runs[name] = {"error": "skipped: the run's deadline left no time"}
            phase_done(name, began)
            continue
        log(f"{name}: {len(requests)} requests, budget {budget:.0f}s")
        try:
            summary, extra = run_engine(
                loaded,
                requests,
                engine_config(args),
                name=name,
                arrivals=times,
                poisson_rate=args.poisson_rate if times is not None else None,
                budget_s=budget,
                log=log,
                seed=args.seed,
                warmup_requests=args.engine_warmup_requests,
            )
            runs[name] = {"summary": asdict(summary), **extra}
            log(
                f"{name}: {summary.output_tok_s:.0f} tok/s, {summary.requests_per_s:.2f} req/s, "
                f"{summary.completed}/{summary.requests} done in {summary.wall_s:.1f}s, "
                f"{summary.preemptions} preemptions"
                + (" (cut by its budget)" if summary.truncated else "")
            )
            _headline(payload, name, summary)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            runs[name] = {"error": errors[name]}
            log(f"{name} failed: {exc!r}")
        free_device_memory(device)
        phase_done(name, began)

    hf: dict[str, Any] = {}
    payload["hf"] = hf
    if run_hf:
        pad = loaded.tokenizer.eos_token_id
        pad_id = int(pad) if pad is not None else 0
        began = time.perf_counter()
        budget = deadline.budget(args.time_budget_s, reserve_after=45.0)
        log(f"hf generate: {len(subset)} requests, budget {budget:.0f}s")
        result: BaselineResult = run_hf_generate(
            loaded.model,
            subset,
            max_batch_size=args.max_num_seqs,
            pad_token_id=pad_id,
            time_budget_s=max(budget, 1.0),
            log=log,
        )
        hf["generate"] = asdict(result)
        payload["hf_generate_tok_s"] = result.useful_tok_s
        log(f"hf generate: {_fmt(result.useful_tok_s)} useful tok/s ({result.status})")
        free_device_memory(device)
        phase_done("hf_generate", began)

        began = time.perf_counter()
        budget = deadline.budget(args.time_budget_s, reserve_after=0.0)
        log(f"hf continuous batching: {len(subset)} requests, budget {budget:.0f}s")
        result = run_hf_generate_batch(
            loaded.model,
            subset,
            max_batch_size=args.max_num_seqs,
            max_batch_tokens=args.max_num_batched_tokens,
            time_budget_s=max(budget, 1.0),
            log=log,
            # On CPU, transformers would size its cache from host memory: keep it small.
            num_blocks=None if device.type == "cuda" else 64,
            api=args.hf_batch_api,
        )
        hf["generate_batch"] = asdict(result)
        payload["hf_generate_batch_tok_s"] = result.useful_tok_s
        log(f"hf continuous batching: {_fmt(result.useful_tok_s)} tok/s ({result.status})")
        free_device_memory(device)
        phase_done("hf_generate_batch", began)

    payload["complete"] = True
    path = save(args, payload, command)
    print(report(payload), flush=True)
    print(f"wrote {path} (total {log.elapsed():.1f}s)", flush=True)
    return payload


def _headline(payload: dict[str, Any], name: str, summary: RunSummary) -> None:
    """Top-level keys of the results file for the engine runs."""
    ttft = {"p50": _p(summary.ttft, "p50"), "p99": _p(summary.ttft, "p99")}
    tpot = {"p50": _p(summary.tpot, "p50"), "p99": _p(summary.tpot, "p99")}
    key = {
        "engine_burst": "burst",
        "engine_subset_burst": "subset_burst",
        "engine_poisson": "poisson",
    }[name]
    payload.setdefault("ttft_ms", {})[key] = ttft
    payload.setdefault("tpot_ms", {})[key] = tpot
    payload.setdefault("requests_per_s", {})[key] = summary.requests_per_s
    payload.setdefault("peak_kv_bytes", {})[key] = summary.peak_kv_bytes
    payload.setdefault("max_memory_allocated_bytes", {})[key] = summary.max_memory_allocated_bytes
    payload.setdefault("preemptions", {})[key] = summary.preemptions
    if name == "engine_burst":
        payload["engine_tok_s"] = summary.output_tok_s
        payload["engine_requests_per_s"] = summary.requests_per_s
    elif name == "engine_subset_burst":
        payload["engine_subset_tok_s"] = summary.output_tok_s
    else:
        payload["poisson_tok_s"] = summary.output_tok_s
        payload["poisson_requests_per_s"] = summary.requests_per_s


def _versions() -> dict[str, str | None]:
    import transformers

    try:
        import triton

        triton_version: str | None = str(triton.__version__)
    except Exception:
        triton_version = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": str(transformers.__version__),
        "triton": triton_version,
        "python": sys.version.split()[0],
    }


def _p(dist: Any, pct: str) -> float | None:
    return None if dist is None else float(getattr(dist, f"{pct}_ms"))


if __name__ == "__main__":
    main()
    # A continuous-batching thread that ignored its stop must not keep the process alive.
    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
