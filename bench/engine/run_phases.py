"""The phases of a GPU engine benchmark run, in the order bench/engine/gpu.py's main runs them.

This module owns the run's sequence of measurements and how each one lands in the results
payload: the trace (and its Poisson arrivals and baseline subset), the model, copy bandwidth with
the decode sweep, this engine's runs (burst, subset burst, Poisson), and the two transformers
baselines. Each phase shrinks its budget through the run's Deadline, records a failure under
"errors" instead of raising, and rewrites the results files when it is done (RunContext.phase_done),
so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine.decode_sweep import decode_sweep
from bench.engine.engine_runs import engine_config, run_engine
from bench.engine.harness import GIB, MIB, Deadline, Progress, free_device_memory
from bench.engine.hf_baselines import BaselineResult, run_hf_generate
from bench.engine.hf_continuous import run_hf_generate_batch
from bench.engine.metrics import describe_workload
from bench.engine.model_setup import build_model_dir, model_facts
from bench.engine.report import fmt, record_headline, save
from bench.engine.roofline import ROOFLINE_METHOD, measure_copy_bandwidth
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.engine_trace import WorkloadRequest, WorkloadSpec, load_workload, poisson_arrivals
from site_engine.model_loading import LoadedModel, load_model


@dataclass(slots=True)
class RunContext:
    """What every phase of a run shares: the arguments, the clock and the results so far
    (`phases` and `errors` are the payload's "phases_s" and "errors")."""

    args: argparse.Namespace
    command: str
    log: Progress
    device: torch.device
    deadline: Deadline
    payload: dict[str, Any]
    phases: dict[str, float]
    errors: dict[str, str]

    def phase_done(self, name: str, began: float) -> None:
        self.phases[name] = time.perf_counter() - began
        path = save(self.args, self.payload, self.command)
        memory = ""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            memory = f"; {free / GIB:.1f}/{total / GIB:.1f} GiB free"
        self.log(f"{name} done in {self.phases[name]:.1f}s (results so far in {path}{memory})")


def trace_phase(
    run: RunContext, tokenizer_dir: Path, data_dir: Path
) -> tuple[list[WorkloadRequest], list[WorkloadRequest], list[float]]:
    """The trace, its Poisson arrival times and the subset the baselines run."""
    args, payload, log = run.args, run.payload, run.log
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
    run.phases["trace"] = time.perf_counter() - began
    return workload, subset, arrivals


def model_phase(run: RunContext, shape: dict[str, Any], tokenizer_dir: Path) -> LoadedModel:
    """Builds the random model, saves it and loads it back through load_model."""
    args, log = run.args, run.log
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
    run.payload["model"] = model_facts(loaded, shape, built_on)
    log(
        f"model: {run.payload['model']['parameters'] / 1e9:.3f}B parameters, "
        f"{run.payload['model']['weight_bytes'] / GIB:.2f} GiB"
    )
    run.phase_done("model", began)
    return loaded


def decode_phase(run: RunContext, loaded: LoadedModel) -> None:
    """Copy bandwidth, then the decode sweep against the roofline it gives."""
    args, payload, errors, log, device = run.args, run.payload, run.errors, run.log, run.device
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
            budget = run.deadline.budget(90.0, reserve_after=5 * 20.0)
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
    run.phase_done("decode_sweep", began)


def engine_phases(
    run: RunContext,
    loaded: LoadedModel,
    workload: list[WorkloadRequest],
    subset: list[WorkloadRequest],
    arrivals: list[float],
    run_hf: bool,
) -> None:
    """This engine: burst on the trace, burst on the subset, Poisson on the trace."""
    args, payload, errors, log = run.args, run.payload, run.errors, run.log
    runs: dict[str, Any] = {}
    payload["runs"] = runs
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
        budget = run.deadline.budget(nominal, reserve_after=later)
        if budget < 5.0:
            runs[name] = {"error": "skipped: the run's deadline left no time"}
            run.phase_done(name, began)
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
            record_headline(payload, name, summary)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            runs[name] = {"error": errors[name]}
            log(f"{name} failed: {exc!r}")
        free_device_memory(run.device)
        run.phase_done(name, began)


def hf_phases(
    run: RunContext, loaded: LoadedModel, subset: list[WorkloadRequest], hf: dict[str, Any]
) -> None:
    """The transformers baselines on the subset: static `generate`, continuous batching."""
    args, payload, log, device = run.args, run.payload, run.log, run.device
    pad = loaded.tokenizer.eos_token_id
    pad_id = int(pad) if pad is not None else 0
    began = time.perf_counter()
    budget = run.deadline.budget(args.time_budget_s, reserve_after=45.0)
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
    log(f"hf generate: {fmt(result.useful_tok_s)} useful tok/s ({result.status})")
    free_device_memory(device)
    run.phase_done("hf_generate", began)

    began = time.perf_counter()
    budget = run.deadline.budget(args.time_budget_s, reserve_after=0.0)
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
    log(f"hf continuous batching: {fmt(result.useful_tok_s)} tok/s ({result.status})")
    free_device_memory(device)
    run.phase_done("hf_generate_batch", began)
