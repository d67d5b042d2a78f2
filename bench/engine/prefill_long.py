"""Long-prompt prefill: this engine's chunked prefill against one transformers forward.

    python -m bench.engine.prefill_long   (bench/results/engine_prefill/engine_prefill_long_h100.*)
    python -m bench.engine.prefill_long --small --device cpu --dtype float32     (smoke test)

A Llama-3.2-1B-shaped random model with its real context (131,072 positions, Llama-3.1 rope
scaling), bf16, is built, saved and loaded back through site_engine.model_loading. For each
prompt length (2k, 8k, 16k, 32k tokens; random token ids, a fresh prompt for every repetition):

- hf: one transformers forward over the whole prompt (torch SDPA with the backend it picks:
  cuDNN's on an H100 with torch 2.11; `hf_flash` forces FlashAttention-2), as `generate` runs a
  prefill: `logits_to_keep=1` (only the last row's logits) and a KV cache. This
  is the comparison `engine_over_hf` uses. `hf_full_logits` is the same forward computing the
  logits of every position (transformers' default without `logits_to_keep`): it does ~13% more
  work at these lengths, and is reported apart, never used for the ratio.
- engine: one request with that prompt and max_tokens=1 through a PagedEngine (chunked prefill,
  `--chunk` tokens per step: the GPU default budget; CUDA graphs; async scheduling), from
  add_request to its token, device synchronised at both ends.

TFLOP/s count the same useful work for both: 2 x (parameters of the decoder's matrix products) per
token, causal attention (4 x head_dim x heads per visible (query, key) pair and layer) and the
lm_head of one row; the share of peak divides by a bf16 8192^3 matrix product measured in the same
run. The `kernels` phase times the attention alone (bench.engine.prefill_kernels), and
`--baseline-engine DIR` runs the engine phase with another commit's site_engine/engine first, in a
subprocess (the before of a before/after). `--long-prefill`, `--engine-tiles` and `--engine-chunks`
run the engine phase again in the same process with one thing changed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import bench.common as common
from bench.common import markdown_table
from bench.engine.harness import Progress, free_device_memory, sync
from bench.engine.model_setup import LLAMA_1B_LONG_SHAPE, SMALL_SHAPE, ensure_model
from bench.engine.paths import shared_path
from bench.engine.report import fmt, versions
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

PHASES = ("kernels", "hf", "engine")
DEFAULT_CONFIGS = ("128x64:8:2", "64x64:4:2")


def prefill_flops(shape: dict[str, Any], tokens: int) -> float:
    """Useful FLOPs of one prefill of `tokens` tokens: the decoder's matrix products, causal
    attention, and the lm_head of the last row."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_token = 2 * (projections + 3 * hidden * inter)
    attention = 4 * head_dim * heads * tokens * (tokens + 1) // 2
    layers = shape["num_hidden_layers"]
    return float(layers * (per_token * tokens + attention) + 2 * hidden * shape["vocab_size"])


def measure_matmul_peak(device: torch.device, size: int = 8192, reps: int = 10) -> float:
    """TFLOP/s of a bf16 size^3 matrix product on random data (median of `reps`)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        event = getattr(torch.cuda, "Event")  # noqa: B009 (untyped in some torch releases)
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1000)
    return float(2 * size**3 / statistics.median(times) / 1e12)


def _prompt(vocab: int, tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(tokens)]


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    sync(device)
    began = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - began) * 1000


def _sdpa_backend(flash: bool) -> Any:
    """SDPA forced onto FlashAttention's backend, or left to choose (cuDNN on an H100 with torch
    2.11, as the profiles show)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext()


def hf_phase(
    loaded: LoadedModel,
    prompts: Sequence[int],
    reps: int,
    log: Progress,
    profile_to: Path | None = None,
) -> dict[str, Any]:
    """Median ms of one transformers forward per prompt length: last-row and full logits."""
    model, device, vocab = loaded.model, loaded.device, loaded.vocab_size
    results: dict[str, dict[str, Any]] = {}
    for tokens in prompts:
        row: dict[str, Any] = {}
        for key, keep in (("hf_ms", 1), ("hf_full_logits_ms", 0), ("hf_flash_ms", 1)):
            times = []
            for rep in range(reps + 1):  # the first is a warm-up
                ids = torch.tensor([_prompt(vocab, tokens, 1000 * rep + tokens)], device=device)
                with torch.inference_mode(), _sdpa_backend(key == "hf_flash_ms"):
                    try:
                        ms = _timed(device, functools.partial(model, input_ids=ids,
                                                              logits_to_keep=keep))  # fmt: skip
                    except torch.OutOfMemoryError as exc:
                        row[key + "_error"] = str(exc)[:200]
                        break
                if rep:
                    times.append(ms)
                free_device_memory(device)
            if times:
                row[key] = statistics.median(times)
        results[str(tokens)] = row
        log(f"  hf {tokens}: {row}")
    if profile_to is not None:
        ids = torch.tensor([_prompt(vocab, max(prompts), 98)], device=device)
        with torch.inference_mode():
            table = profile_table(lambda: model(input_ids=ids, logits_to_keep=1), device)
        profile_to.write_text(table)
    return results


def profile_table(run: Callable[[], object], device: torch.device, host: bool = False) -> str:
    """The kernels of one run by device time (torch.profiler), top 25; with `host`, the host's
    operations by their own time (launches, copies, synchronizations)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync(device)
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    if host and cuda:
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        run()
        sync(device)
    key = "self_device_time_total" if cuda and not host else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90))


def engine_phase(
    loaded: LoadedModel,
    prompts: Sequence[int],
    reps: int,
    config: EngineConfig,
    log: Progress,
    profile_to: Path | None = None,
) -> dict[str, Any]:
    """Median ms from add_request to the first token, one request at a time, per prompt."""
    engine = PagedEngine(loaded, config)
    report = getattr(engine, "startup_report", None)
    results: dict[str, Any] = {"config": {k: getattr(config, k) for k in config.__slots__}}
    if report is not None:
        results["startup_report"] = str(report)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    device = loaded.device

    def prefill(name: str, tokens: int, seed: int) -> float:
        request = EngineRequest(name, tuple(_prompt(loaded.vocab_size, tokens, seed)), greedy)

        def run() -> None:
            engine.add_request(request)
            while engine.has_unfinished():
                engine.step()

        return _timed(device, run)

    # Warm-up: a first chunk and a continuing one of every size the runs will step through.
    prefill("warmup", min(max(prompts), 2 * config.max_num_batched_tokens + 100), 7)
    for tokens in prompts:
        times = [prefill(f"p{tokens}-{rep}", tokens, 2000 * rep + tokens) for rep in range(reps)]
        results[str(tokens)] = {"engine_ms": statistics.median(times), "engine_runs_ms": times}
        log(f"  engine {tokens}: {results[str(tokens)]}")
    if profile_to is not None:
        table = profile_table(lambda: prefill("profiled", max(prompts), 99), device)
        profile_to.write_text(table)
        host = profile_table(lambda: prefill("profiled-host", max(prompts), 98), device, True)
        profile_to.with_name(profile_to.stem + "_host.txt").write_text(host)
    close = getattr(engine, "close", None)  # a baseline engine may predate close()
    if close is not None:
        close()
    free_device_memory(device)
    return results


def run_baseline(args: argparse.Namespace, tokenizer: Path, log: Progress) -> dict[str, Any]:
    """The engine phase with --baseline-engine's package, in a subprocess; never raises."""
    from bench.engine.baseline_engine import hybrid_tree

    with tempfile.TemporaryDirectory(prefix="fedllm-prefill-baseline-") as tmp:
        root = Path(tmp)
        command = [
            sys.executable, "-m", "bench.engine.prefill_long", "--phases", "engine",
            "--model-dir", str(args.model_dir.resolve()), "--results-dir", str(root),
            "--tokenizer-dir", str(tokenizer), "--name", "baseline", "--chunk", str(args.chunk),
            "--reps", str(args.reps), "--max-num-seqs", str(args.max_num_seqs), "--prompts",
            *map(str, args.prompts),
        ] + (["--small", "--device", args.device, "--dtype", args.dtype]
             if args.small else [])  # fmt: skip
        result: dict[str, Any] = {"engine_dir": str(args.baseline_engine)}
        try:
            tree = hybrid_tree(args.baseline_engine.resolve(), root / "tree")
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
            done = subprocess.run(command, cwd=tree, env=env, timeout=420, check=False)
            result["returncode"] = done.returncode
            payload = json.loads((root / "baseline.json").read_text())
            result["engine"] = payload.get("engine")
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            log(f"baseline failed: {result['error']}")
        return result


def summarize(payload: dict[str, Any], shape: dict[str, Any]) -> None:
    """engine_over_hf and the TFLOP/s table from what the phases measured."""
    hf, engine = payload.get("hf", {}), payload.get("engine", {})
    baseline = (payload.get("baseline") or {}).get("engine") or {}
    peak = payload.get("bf16_peak_tflops")
    rows: dict[str, dict[str, Any]] = {}
    ratios: dict[str, float] = {}
    flash: dict[str, float] = {}
    for key in sorted({*hf, *engine}, key=lambda k: int(k) if k.isdigit() else -1):
        if not key.isdigit():
            continue
        flops = prefill_flops(shape, int(key))
        row: dict[str, Any] = {"flops": flops}
        for name, ms in (
            ("hf", hf.get(key, {}).get("hf_ms")),
            ("hf_full_logits", hf.get(key, {}).get("hf_full_logits_ms")),
            ("hf_flash", hf.get(key, {}).get("hf_flash_ms")),
            ("engine", engine.get(key, {}).get("engine_ms")),
            ("baseline_engine", baseline.get(key, {}).get("engine_ms")),
        ):
            if ms is None:
                continue
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / (ms / 1000) / 1e12
            if peak:
                row[f"{name}_peak_share"] = row[f"{name}_tflops"] / peak
        if "hf_ms" in row and "engine_ms" in row:
            ratios[key] = row["hf_ms"] / row["engine_ms"]
        if "hf_flash_ms" in row and "engine_ms" in row:
            flash[key] = row["hf_flash_ms"] / row["engine_ms"]
        rows[key] = row
    payload["table"] = rows
    payload["engine_over_hf"] = ratios
    payload["engine_over_hf_flash"] = flash


def markdown(payload: dict[str, Any]) -> str:
    rows = payload.get("table", {})
    peak = payload.get("bf16_peak_tflops")
    header = ["prompt tokens", "engine / HF (tok/s)", "engine ms", "HF ms", "engine TFLOP/s",
              "HF TFLOP/s", "engine % of peak", "HF % of peak", "engine / HF-flash",
              "HF full logits ms", "before: engine ms"]  # fmt: skip
    table = []
    for key, row in rows.items():
        ratio = payload.get("engine_over_hf", {}).get(key)
        table.append([
            f"{int(key):,}", fmt(ratio, 2), fmt(row.get("engine_ms"), 1), fmt(row.get("hf_ms"), 1),
            fmt(row.get("engine_tflops"), 0), fmt(row.get("hf_tflops"), 0),
            fmt(100 * row["engine_peak_share"], 0) if "engine_peak_share" in row else "-",
            fmt(100 * row["hf_peak_share"], 0) if "hf_peak_share" in row else "-",
            fmt(payload.get("engine_over_hf_flash", {}).get(key), 2),
            fmt(row.get("hf_full_logits_ms"), 1), fmt(row.get("baseline_engine_ms"), 1),
        ])  # fmt: skip
    parts = [
        "## Prefill of one long prompt: engine vs one transformers forward\n",
        f"bf16 peak measured in this run (8192^3 matrix product): {fmt(peak, 0)} TFLOP/s. "
        "The ratio is HF ms / engine ms (tok/s over tok/s), HF with `logits_to_keep=1` and SDPA "
        "left to choose its backend (cuDNN's on this GPU); engine / HF-flash: the same with SDPA "
        "forced onto FlashAttention. HF full logits: the same forward computing every "
        "position's logits (not used in any ratio).\n",
        markdown_table(header, table),
        "",
    ]
    parts += _variants_markdown(payload)
    kernels = payload.get("kernels")
    if kernels:
        parts += ["## Attention alone, one layer, whole prompt in chunks\n",
                  markdown_table(["prompt", "candidate", "ms", "TFLOP/s", "rel. error (tail)"],
                                 [[r["prompt"], r["candidate"], fmt(r.get("ms"), 2),
                                   fmt(r.get("tflops"), 0), fmt(r.get("rel_error_tail"), 5)
                                   if "error" not in r else r["error"][:80]]
                                  for r in kernels]), ""]  # fmt: skip
    parts += ["## Notes\n", "```", json.dumps({k: payload.get(k) for k in
              ("model", "engine_config", "kernel_environment", "versions")}, indent=1,
              default=str), "```"]  # fmt: skip
    return "\n".join(parts)


def _variants_markdown(payload: dict[str, Any]) -> list[str]:
    """The engine's reruns in this process (other long-chunk rules, tiles or step budgets):
    ms per prompt, and HF ms over it."""
    runs = {f"as above ({payload.get('chunk')} tokens a step)": payload.get("engine", {})}
    runs.update({k: v for k, v in payload.items() if k.startswith("engine_") and "[" in k})
    if len(runs) == 1:
        return []
    hf = payload.get("hf", {})
    prompts = list(payload.get("table", {}))
    table = []
    for name, result in runs.items():
        cells = []
        for p in prompts:
            ms = result.get(p, {}).get("engine_ms")
            hf_ms = hf.get(p, {}).get("hf_ms")
            cells.append(fmt(ms, 1) + (f" ({hf_ms / ms:.2f})" if ms and hf_ms else ""))
        table.append([name, *cells])
    header = ["engine run", *(f"{int(p):,}: ms (HF / engine)" for p in prompts)]
    return ["## The engine again in the same process, one thing changed\n",
            markdown_table(header, table), ""]  # fmt: skip


def save(args: argparse.Namespace, payload: dict[str, Any], command: str) -> Path:
    return common.write_results(args.name, payload, markdown(payload), command, args.results_dir)


def _profile_path(args: argparse.Namespace, what: str) -> Path | None:
    if not args.profile:
        return None
    return Path(args.results_dir) / f"{args.name}_profile_{what}.txt"


def _use_tiles(spec: str) -> None:
    """Every later engine uses these varlen-kernel tiles ('BLOCK_MxTILE:warps:stages')."""
    from site_engine.engine.cuda import paged_prefill

    tiles = paged_prefill.parse_tiles(spec)
    paged_prefill.default_tiles = lambda head_dim: tiles


def _use_long_prefill(spec: str) -> None:
    """Every later engine sends long chunks to cuDNN from 'MIN_TOKENS:MIN_CONTEXT' on, or
    never ('off'): CudaPagedAttention's cudnn_prefill path, as the runner builds it."""
    from site_engine.engine.cuda import cudnn_prefill

    cls = cudnn_prefill.CudnnLongPrefill
    original = getattr(cls, "_bench_original_create", cls.create)
    cls._bench_original_create = original  # type: ignore[attr-defined]

    def create(*_: Any, **__: Any) -> cudnn_prefill.CudnnLongPrefill | None:
        if spec == "off":
            return None
        tokens, context = (int(v) for v in spec.split(":"))
        return original(min_tokens=tokens, min_context=context)

    cls.create = create  # type: ignore[method-assign]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.prefill_long")
    add = parser.add_argument
    add("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    add("--prompts", type=int, nargs="+", default=None, help="prompt lengths in tokens")
    add("--chunk", type=int, default=None, help="engine tokens per step (8192)")
    add("--reps", type=int, default=3)
    add("--max-num-seqs", type=int, default=256, help="engine batch limit (prefill: 1)")
    add("--configs", nargs="*", default=list(DEFAULT_CONFIGS), help="Triton tile configs")
    add("--profile", action="store_true", help="kernel tables of one run at the longest prompt")
    add("--eager", action="store_true", help="the engine without CUDA graphs")
    add("--engine-tiles", nargs="*", default=[], help="engine runs again with these tiles")
    add(
        "--engine-chunks",
        type=int,
        nargs="*",
        default=[],
        help="engine runs again with these tokens per step (max_num_batched_tokens)",
    )
    add(
        "--long-prefill",
        nargs="*",
        default=[],
        help="engine runs again with long chunks on cuDNN from MIN_TOKENS:MIN_CONTEXT, or off",
    )
    add("--landed-kernel", type=Path, default=None, help="an older paged_prefill.py")
    add("--baseline-engine", type=Path, default=None, help="an older site_engine/engine folder")
    add("--model-dir", type=Path, default=None, help="built there when it holds no model")
    add("--tokenizer-dir", type=Path, default=None)
    add("--results-dir", type=Path, default=common.results_dir("engine_prefill"))
    add("--name", default="engine_prefill_long_h100")
    add("--small", action="store_true", help="tiny model and prompts: a smoke test")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    if args.prompts is None:
        args.prompts = [64, 200] if args.small else [2048, 8192, 16384, 32000]
    if args.chunk is None:
        args.chunk = 48 if args.small else 8192
    if args.small:
        args.max_num_seqs = min(args.max_num_seqs, 4)
    if args.model_dir is None:
        args.model_dir = Path("/tmp/fedllm-bench-small-long" if args.small
                              else "/tmp/fedllm-bench-llama1b-long")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = common.command_line("bench.engine.prefill_long", argv)
    log = Progress()
    phases = set(args.phases.split(","))
    device = torch.device(args.device)
    shape = {**SMALL_SHAPE, "max_position_embeddings": 4096} if args.small else LLAMA_1B_LONG_SHAPE
    payload: dict[str, Any] = {"complete": False, "versions": versions(), "model": shape,
                               "prompts": args.prompts, "chunk": args.chunk}  # fmt: skip
    if device.type == "cuda":
        payload["device"] = torch.cuda.get_device_name(device)
        payload["bf16_peak_tflops"] = measure_matmul_peak(device)
        log(f"{payload['device']}: bf16 matmul {payload['bf16_peak_tflops']:.0f} TFLOP/s")
    if "kernels" in phases and device.type == "cuda":
        from bench.engine.prefill_kernels import HeadLayout, environment, measure

        payload["kernel_environment"] = environment()
        layout = HeadLayout(shape["num_attention_heads"], shape["num_key_value_heads"],
                            shape["head_dim"])  # fmt: skip
        payload["kernels"] = measure(args.prompts, args.chunk, layout, args.configs,
                                     landed=args.landed_kernel, log=log)  # fmt: skip
        save(args, payload, command)
    tokenizer = shared_path(args.tokenizer_dir, "tokenizers", "gpt2").resolve()
    if args.baseline_engine is not None:
        # Built here first, so that the baseline's subprocess loads the same model.
        free_device_memory(device)
        ensure_model(args.model_dir, shape, tokenizer, log, dtype=args.dtype, device=args.device)
        free_device_memory(device)
        payload["baseline"] = run_baseline(args, tokenizer, log)
        save(args, payload, command)
    if phases & {"hf", "engine"}:
        loaded = ensure_model(args.model_dir, shape, tokenizer, log, dtype=args.dtype,
                              device=args.device)  # fmt: skip
        # The engine first, in a process that has run nothing else (as the baseline's
        # subprocess does): after the HF phase the first engine's short prompts measured 30-45%
        # slower than the same engine run second
        # (bench/results/engine_prefill/engine_prefill_long_h100_notes.md).
        if "engine" in phases:
            config = EngineConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.chunk,
                                  cuda_graphs=not args.eager)  # fmt: skip
            payload["engine_config"] = {k: getattr(config, k) for k in config.__slots__}
            payload["engine"] = engine_phase(loaded, args.prompts, args.reps, config, log,
                                             _profile_path(args, "engine"))  # fmt: skip
            save(args, payload, command)
        if "hf" in phases:
            payload["hf"] = hf_phase(loaded, args.prompts, args.reps, log,
                                     _profile_path(args, "hf"))  # fmt: skip
            save(args, payload, command)
        if "engine" in phases:
            # Step budgets first: the rules and tiles below patch every later engine.
            for chunk in args.engine_chunks:
                payload[f"engine_chunk[{chunk}]"] = engine_phase(
                    loaded,
                    args.prompts,
                    args.reps,
                    replace(config, max_num_batched_tokens=chunk),
                    log,
                )
            for spec in args.long_prefill:
                _use_long_prefill(spec)
                payload[f"engine_long_prefill[{spec}]"] = engine_phase(
                    loaded, args.prompts, args.reps, config, log
                )
            for tiles in args.engine_tiles:
                _use_tiles(tiles)
                payload[f"engine_tiles[{tiles}]"] = engine_phase(
                    loaded, args.prompts, args.reps, config, log
                )
    summarize(payload, shape)
    payload["complete"] = True
    path = save(args, payload, command)
    print(markdown(payload), flush=True)
    log(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
