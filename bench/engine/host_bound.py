"""Whether the engine's host path keeps up with the GPU at full batch, and whether overload stays
flat (issue 66), in one GPU run.

Two phases on one engine of the Llama-3.2-1B shape (1,024 sequences, 8,192-token steps, prefix
caching on, async scheduling, CUDA graphs):

- steps: b sequences (b = 256 and 1,024) decoding at once, every other row idle; the period of
  consecutive `engine.step()` calls (the device synchronized only around the run, as async
  scheduling runs) against the GPU time of the same steps (the sum of the device's kernel and
  copy times per step, from the torch profiler over a separate run of the same steps):
  `step_vs_gpu_time` {rows: period / GPU time}. The host's CPU time per step is kept beside it.
- overload: the short chat mix of bench.engine.serving (Alpaca and GSM8K prompts, LIMA answer
  lengths replayed with ignore_eos). The peak: the queue kept deeper than the engine can take for
  `--peak-s` seconds, output tokens per second over its second half. Then Poisson arrivals at
  `--overload` (1.25) times the capacity the peak gives (its tokens/s over the mix's mean answer
  length) for `--duration-s` seconds: output tokens per second over the arrivals' span after
  its first `--settle-s` seconds, over the peak's: `overload_tokens_vs_peak`. Past capacity the
  queue, not the step, should grow: the step time p50 of both phases is in the results.

    python -m bench.engine.host_bound --tokenizer-dir T --data-dir D --results-dir R
        (one GPU: bench/results/engine/host_bound_<card>.{json,md})
    python -m bench.engine.host_bound --small --device cpu --rows 8 16 --duration-s 2 --peak-s 2
        (the wiring, on the CPU)

With --baseline-engine DIR (another commit's site_engine/engine) the same phases first run with
that engine package in a subprocess on the same model (bench.engine.baseline_engine's hybrid
tree: this checkout's bench and site code, the baseline's engine), its figures in the results'
"baseline" section: a before and after in one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.harness import Progress, free_device_memory, sync
from bench.engine.model_setup import LLAMA_1B_SHAPE, SMALL_SHAPE, ensure_model
from bench.engine.paths import resolve_data_dir, shared_path
from bench.engine.serving_workload import build_mix, load_pools
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.engine_trace import WorkloadRequest, poisson_arrivals
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=16,
        kv_cache_bytes=args.kv_cache_gib << 30 if args.kv_cache_gib else 0,
        prefix_caching=True,
        model_name="host-bound",
        measure_step_time=True,
    )


def _request(request_id: str, prompt: Sequence[int], answer: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, tuple(prompt), sampling, predicted_tokens=answer)


# ---- steps --------------------------------------------------------------------------------


def _decoding(engine: PagedEngine, rows: int, prompt_len: int, answer: int, seed: int) -> None:
    """`rows` sequences of distinct prompts in the engine, stepped until all decode."""
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    for i in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(_request(f"b{rows}-{seed}-{i}", prompt, answer))
    for _ in range(10_000):
        waiting, running = engine.queue_lengths()
        engine.step()
        if not waiting and running == rows and engine.scheduler_stats().queued_prompt_tokens == 0:
            break
    for _ in range(4):  # the last prefill's tokens come back; every row decodes from here
        engine.step()


def _gpu_ms_per_step(engine: PagedEngine, steps: int) -> tuple[float, float]:
    """(device ms a step, kernels a step) of `steps` engine steps: the sum of the device's kernel
    and copy durations from the torch profiler (one stream: they do not overlap)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.runner.device)
    device_us = 0.0
    kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:  # type: ignore[attr-defined]
            device_us += event.device_time
            kernels += 1
    return device_us / 1000.0 / steps, kernels / steps


def step_phase(
    engine: PagedEngine, loaded: LoadedModel, args: argparse.Namespace, log: Progress
) -> dict[str, dict[str, float]]:
    """Per row count: the step period, the GPU time of a step, the host's CPU time a step."""
    out: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        answer = args.warmup_steps + 2 * args.steps + 64
        _decoding(engine, rows, args.prompt_len, answer, seed=rows)
        for _ in range(args.warmup_steps):
            engine.step()
        device = loaded.device
        cpu: list[float] = []
        sync(device)
        began = time.perf_counter()
        for _ in range(args.steps):
            cpu_began = time.thread_time()
            engine.step()
            cpu.append(time.thread_time() - cpu_began)
        sync(device)
        period_ms = (time.perf_counter() - began) * 1000.0 / args.steps
        gpu_ms, kernels = (
            _gpu_ms_per_step(engine, args.profile_steps)
            if device.type == "cuda"
            else (float("nan"), 0.0)
        )
        running = engine.queue_lengths()[1]
        out[str(rows)] = {
            "running": running,
            "step_ms": period_ms,
            "gpu_ms": gpu_ms,
            "step_vs_gpu_time": period_ms / gpu_ms if gpu_ms == gpu_ms else float("nan"),
            "host_cpu_ms_p50": statistics.median(cpu) * 1000.0,
            "kernels_per_step": kernels,
        }
        log(
            f"  {rows} rows ({running} running): step {period_ms:.2f} ms, GPU {gpu_ms:.2f} "
            f"ms, x{out[str(rows)]['step_vs_gpu_time']:.2f}; host CPU p50 "
            f"{out[str(rows)]['host_cpu_ms_p50']:.2f} ms"
        )
        _cancel_all(engine)
    return out


def _cancel_all(engine: PagedEngine) -> None:
    # A bench resets its engine: every request it holds.
    for request_id in list(engine._scheduler._roster.live):
        engine.abort(request_id, FinishReason.CANCELLED)
    while engine.has_unfinished():
        engine.step()


# ---- overload -----------------------------------------------------------------------------


class Meter:
    """Output tokens and step times over wall time, from the engine's outputs."""

    def __init__(self) -> None:
        self.token_times: list[tuple[float, int]] = []
        self.steps: list[tuple[float, float]] = []  # (when it ended, its ms)
        self.first_token: dict[str, float] = {}

    def step(self, engine: PagedEngine, now: float) -> None:
        began = time.perf_counter()
        outputs = engine.step()
        ended = time.perf_counter()
        self.steps.append((ended - now, (ended - began) * 1000.0))
        tokens = getattr(outputs, "tokens", None)
        if tokens is not None:  # StepOutputs: columns
            produced = len(tokens) - tokens.count(-1)
            ids = outputs.request_ids
        else:  # an engine from before issue 66: a list of RequestOutput
            produced = sum(len(o.new_token_ids) for o in outputs)
            ids = [o.request_id for o in outputs]
        if produced:
            self.token_times.append((ended - now, produced))
        for request_id in ids:
            self.first_token.setdefault(request_id, ended - now)

    def tokens_per_s(self, start: float, end: float) -> float:
        count = sum(n for t, n in self.token_times if start <= t < end)
        return count / (end - start)

    def step_ms_p50(self, start: float) -> float:
        times = [ms for t, ms in self.steps if t >= start]
        return statistics.median(times) if times else float("nan")


def peak_phase(
    engine: PagedEngine, requests: Sequence[WorkloadRequest], args: argparse.Namespace
) -> dict[str, float]:
    """The queue kept deeper than the engine can take: output tokens/s over the second half."""
    meter = Meter()
    pending = list(requests)
    began = time.perf_counter()
    depth = args.max_num_seqs
    while time.perf_counter() - began < args.peak_s:
        waiting, _ = engine.queue_lengths()
        while waiting < depth and pending:
            r = pending.pop()
            engine.add_request(_request(r.request_id, r.prompt_token_ids, r.output_tokens))
            waiting += 1
        meter.step(engine, began)
    half = args.peak_s / 2
    peak = meter.tokens_per_s(half, args.peak_s)
    step_ms = meter.step_ms_p50(half)
    _cancel_all(engine)
    return {
        "peak_tokens_per_s": peak,
        "step_ms_p50": step_ms,
        "running_at_end": float(engine.queue_lengths()[1]),
    }


def overload_phase(
    engine: PagedEngine,
    requests: Sequence[WorkloadRequest],
    rate: float,
    args: argparse.Namespace,
) -> dict[str, float]:
    """Poisson arrivals at `rate` for `--duration-s`: output tokens/s after `--settle-s`."""
    count = int(rate * args.duration_s)
    arrivals = poisson_arrivals(count, rate, args.seed)
    chosen = list(requests[:count])
    meter = Meter()
    began = time.perf_counter()
    index = 0
    span = arrivals[-1] if arrivals else args.duration_s
    while True:
        now = time.perf_counter() - began
        while index < count and arrivals[index] <= now:
            r = chosen[index]
            engine.add_request(_request(r.request_id, r.prompt_token_ids, r.output_tokens))
            index += 1
        if now >= span:
            break
        if engine.has_unfinished():
            meter.step(engine, began)
        else:
            time.sleep(0.0005)
    waiting, running = engine.queue_lengths()
    ttft = [meter.first_token[r.request_id] - arrivals[i] for i, r in enumerate(chosen)
            if r.request_id in meter.first_token]  # fmt: skip
    step_ms = meter.step_ms_p50(args.settle_s)
    _cancel_all(engine)
    return {
        "rate_rps": rate,
        "requests": count,
        "tokens_per_s": meter.tokens_per_s(args.settle_s, span),
        "step_ms_p50": step_ms,
        "waiting_at_end": waiting,
        "running_at_end": running,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else float("nan"),
    }


def overload(
    engine: PagedEngine, loaded: LoadedModel, args: argparse.Namespace, log: Progress
) -> dict[str, Any]:
    tokenizer = load_tokenizer(args.tokenizer_dir)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    pools = load_pools(encode, loaded.vocab_size, args.data_dir, max_prompt_tokens=2048)
    requests = build_mix(pools, "short", args.pool_requests, args.seed)
    mean_answer = statistics.fmean(r.output_tokens for r in requests)
    warm = build_mix(pools, "short", 64, args.seed + 1)
    for r in warm:
        engine.add_request(_request(r.request_id, r.prompt_token_ids, 8))
    while engine.has_unfinished():
        engine.step()
    peak = peak_phase(engine, requests, args)
    capacity = peak["peak_tokens_per_s"] / mean_answer
    tok_s, step_ms = peak["peak_tokens_per_s"], peak["step_ms_p50"]
    log(f"  peak {tok_s:.0f} tok/s (step p50 {step_ms:.2f} ms): capacity {capacity:.1f} "
        f"req/s at {mean_answer:.0f} tokens an answer")  # fmt: skip
    rate = capacity * args.overload
    fresh = build_mix(pools, "short", max(int(rate * args.duration_s) + 1, 1), args.seed + 2)
    load = overload_phase(engine, fresh, rate, args)
    ratio = load["tokens_per_s"] / peak["peak_tokens_per_s"]
    log(f"  overload {rate:.1f} req/s: {load['tokens_per_s']:.0f} tok/s = x{ratio:.3f} of "
        f"the peak, step p50 {load['step_ms_p50']:.2f} ms, {load['waiting_at_end']} "
        "waiting at the end")  # fmt: skip
    return {
        "mean_answer_tokens": mean_answer,
        "capacity_rps": capacity,
        "peak": peak,
        "overload": load,
        "overload_tokens_vs_peak": ratio,
    }


# ---- the run ------------------------------------------------------------------------------


def _section(payload: dict[str, Any], title: str) -> str:
    rows = [
        [rows, m["running"], m["step_ms"], m["gpu_ms"], m["step_vs_gpu_time"],
         m["host_cpu_ms_p50"], m["kernels_per_step"]]
        for rows, m in payload.get("steps", {}).items()
    ]  # fmt: skip
    steps = markdown_table(
        ["decode rows", "running", "step ms", "GPU ms", "step / GPU", "host CPU ms p50",
         "kernels a step"],
        rows,
    )  # fmt: skip
    text = f"## {title}: steps at full batch\n\n{steps}\n"
    load = payload.get("overload")
    if load:
        peak, over = load["peak"], load["overload"]
        text += (
            f"\n## {title}: overload\n\n"
            f"Peak {peak['peak_tokens_per_s']:.0f} output tok/s (step p50 "
            f"{peak['step_ms_p50']:.2f} ms); capacity {load['capacity_rps']:.1f} req/s at "
            f"{load['mean_answer_tokens']:.0f} tokens an answer. At {over['rate_rps']:.1f} "
            f"req/s ({payload['settings']['overload']}x): {over['tokens_per_s']:.0f} tok/s, "
            f"**overload_tokens_vs_peak {load['overload_tokens_vs_peak']:.3f}**, step p50 "
            f"{over['step_ms_p50']:.2f} ms, {over['waiting_at_end']} waiting and "
            f"{over['running_at_end']} running at the end, TTFT p50 {over['ttft_p50_s']:.2f} s.\n"
        )
    return text


def report(payload: dict[str, Any]) -> str:
    text = _section(payload, "This engine")
    before = payload.get("baseline")
    if before:
        if "error" in before:
            text += f"\n## Baseline\n\nFailed: {before['error']}\n"
        else:
            text += "\n" + _section(before, f"Baseline ({before.get('engine_dir')})")
    return text


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.host_bound", description=__doc__)
    add = parser.add_argument
    add("--rows", type=int, nargs="+", default=[256, 1024])
    add("--max-num-seqs", type=int, default=1024)
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--kv-cache-gib", type=int, default=0, help="0: the memory trial's plan")
    add("--prompt-len", type=int, default=128)
    add("--steps", type=int, default=100)
    add("--warmup-steps", type=int, default=30)
    add("--profile-steps", type=int, default=20)
    add("--peak-s", type=float, default=20.0)
    add("--duration-s", type=float, default=30.0)
    add("--settle-s", type=float, default=10.0)
    add("--overload", type=float, default=1.25)
    add("--pool-requests", type=int, default=20000)
    add("--seed", type=int, default=0)
    add("--phases", default="steps,overload")
    add("--small", action="store_true", help="a tiny model (CPU smoke runs)")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16")
    add("--model-dir", type=Path, default=Path("/tmp/fedllm-bench-host-bound"))
    add("--tokenizer-dir", type=Path, default=None)
    add("--data-dir", type=Path, default=None)
    add("--results-dir", type=Path, default=results_dir("engine"))
    add("--name", default=None)
    add("--baseline-engine", type=Path, default=None)
    add("--baseline-timeout-s", type=float, default=280.0)
    return parser.parse_args(argv)


def baseline(args: argparse.Namespace, argv: Sequence[str], log: Progress) -> dict[str, Any]:
    """The same phases with the engine package of --baseline-engine, in a subprocess."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from bench.engine.baseline_engine import hybrid_tree

    with tempfile.TemporaryDirectory(prefix="fedllm-baseline-") as tmp:
        root = Path(tmp)
        skip = {"--baseline-engine", "--results-dir", "--name", "--model-dir"}
        kept: list[str] = []
        items = list(argv)
        while items:
            item = items.pop(0)
            if item in skip:
                items.pop(0)
                continue
            kept.append(item)
        command = [sys.executable, "-m", "bench.engine.host_bound", *kept,
                   "--model-dir", str(args.model_dir.resolve()),
                   "--tokenizer-dir", str(Path(args.tokenizer_dir).resolve()),
                   "--data-dir", str(Path(args.data_dir).resolve()),
                   "--results-dir", str(root / "results"), "--name", "baseline"]  # fmt: skip
        result: dict[str, Any] = {"engine_dir": str(args.baseline_engine)}
        try:
            tree = hybrid_tree(args.baseline_engine.resolve(), root / "tree")
            log(f"baseline engine from {args.baseline_engine}, in a subprocess")
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
            done = subprocess.run(command, cwd=tree, env=env, timeout=args.baseline_timeout_s,
                                  check=False)  # fmt: skip
            result["returncode"] = done.returncode
            result |= json.loads((root / "results" / "baseline.json").read_text())
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            log(f"baseline failed: {result['error']}")
        return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    args.data_dir = resolve_data_dir(args.data_dir)
    log = Progress()
    shape = SMALL_SHAPE if args.small else LLAMA_1B_SHAPE
    loaded = ensure_model(args.model_dir, shape, args.tokenizer_dir, log,
                          dtype=args.dtype, device=args.device)  # fmt: skip
    if loaded.device.type == "cpu":
        torch.set_num_threads(1)
    card = torch.cuda.get_device_name(0) if loaded.device.type == "cuda" else "cpu"
    name = args.name or "host_bound_" + ("h200" if "H200" in card else "h100" if "H100" in card
                                          else "cpu")  # fmt: skip
    phases = set(args.phases.split(","))
    argv_list = list(sys.argv[1:] if argv is None else argv)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload: dict[str, Any] = {"settings": settings, "card": card}
    if args.baseline_engine is not None:
        payload["baseline"] = baseline(args, argv_list, log)
        free_device_memory(loaded.device)
    # One engine for both phases: its graphs are captured once.
    engine = PagedEngine(loaded, engine_config(args))
    log(f"engine: {engine.startup_report}")
    try:
        if "steps" in phases:
            log("steps at full batch")
            steps = payload["steps"] = step_phase(engine, loaded, args, log)
            payload["step_vs_gpu_time"] = {k: v["step_vs_gpu_time"] for k, v in steps.items()}
        if "overload" in phases:
            log("overload")
            load = payload["overload"] = overload(engine, loaded, args, log)
            payload["overload_tokens_vs_peak"] = load["overload_tokens_vs_peak"]
    finally:
        engine.close()
        free_device_memory(loaded.device)
    payload.setdefault("steps", {})
    markdown = report(payload)
    write_results(name, payload, markdown, command_line("bench.engine.host_bound", argv),
                  args.results_dir)  # fmt: skip
    print(markdown, flush=True)
    return payload


if __name__ == "__main__":
    main()
