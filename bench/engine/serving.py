"""The engine under serving traffic: open-loop rate sweeps with short and long prompts, mixed
steps against their parts, transformers continuous batching at the goodput rate, and the
1,000-request burst of engine_h200 before and after, in one run on one GPU.

    python -m bench.engine.serving --baseline-engine ../site_engine/engine
        (writes bench/results/engine_serving/engine_serving_h200.{json,md,png})
    python -m bench.engine.serving --small --device cpu --dtype float32    (smoke test)

Phases (--phases picks some; results are rewritten after each, "complete": false until the end):

- steps: the step-time table (bench.engine.step_shapes): mixed steps vs prefill-only +
  decode-only steps of the same chunks, per step shape ("mixed_vs_parts");
- decode: pure decode steps at batch 64/128/256 against the HBM roofline (the stretch goal);
- sweep: Poisson arrivals at ascending rates for each prompt mix (bench.engine.serving_workload)
  through one warmed-up engine, until a rate misses the SLO, then one rate between the last
  that held and the first that missed; the goodput per mix ("goodput_rate_rps");
- cache: prefix caching on and off in turn at one rate, short prompts unique and repeated
  (bench.engine.serving_cache: prefix_cache_goodput_ratio, prefix_cache_tpot_p50_ratio);
- burst: the 1,000-request Alpaca+LIMA burst of engine_h200 (same trace and engine settings);
- hf: transformers continuous batching with the requests and arrival times of the goodput rate.

With --baseline-engine DIR (another commit's site_engine/engine), the phases --baseline-phases
("steps,burst" unless given) first run with that engine package in a subprocess on the same model
and loads, then this engine's phases: a before and after in one run.

--mixes picks the prompt mixes of the sweep: short and long (chat-sized, bench.engine.
serving_workload), and longctx (lengths of the Azure conversation and Mooncake traces,
bench.engine.serving_traces), which needs --long-context: the Llama-3.2-1B shape with its real
131,072-position context (Llama-3.1 rope scaling) instead of 4,096 positions. For example:

    python -m bench.engine.serving --long-context --phases sweep --mixes longctx \
        --max-num-seqs 1024 --max-num-batched-tokens 8192 --rates 1 2 4 6 8 12 16 \
        --baseline-engine .bench_baseline/site_engine/engine --baseline-phases sweep \
        --name engine_serving_longctx_h100
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.common import results_dir
from bench.engine import serving_cache
from bench.engine.baseline_engine import run_baseline
from bench.engine.engine_runs import engine_config, run_engine, warm_up
from bench.engine.harness import exit_if_threads_linger, free_device_memory
from bench.engine.hf_open_loop import run_hf_open_loop
from bench.engine.model_setup import LLAMA_1B_LONG_SHAPE, LLAMA_1B_SHAPE, SMALL_SHAPE, ensure_model
from bench.engine.open_loop import Slo, goodput, sweep
from bench.engine.serving_run import Run
from bench.engine.serving_workload import (
    MIXES,
    build_mix,
    describe_mix,
)
from bench.engine.step_shapes import SHAPES, PrefillChunk, StepShape, measure_shapes
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.engine_trace import WorkloadSpec, load_workload, poisson_arrivals
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

PHASES = ("steps", "decode", "sweep", "cache", "burst", "hf")
SWEEP_MIXES = (*MIXES, "longctx")
SMALL_SHAPES = (StepShape("tiny", "a continuing chunk, a fresh one, 3 decode rows", 3, 20,
                          (PrefillChunk(10, 6), PrefillChunk(0, 5))),)  # fmt: skip
FULL: dict[str, Any] = {
    "rates": [32.0, 64.0, 96.0, 128.0, 160.0, 192.0, 224.0],
    "duration_s": 12.0,
    "drain_s": 20.0,
    "max_num_seqs": 256,
    "decode_batch_sizes": [64, 128, 256],
    "hf_budget_s": 40.0,
    "step_reps": 15,
    "name": "engine_serving_h200",
}
SMALL: dict[str, Any] = {
    "rates": [2.0, 4.0],
    "duration_s": 1.0,
    "drain_s": 20.0,
    "max_num_seqs": 4,
    "decode_batch_sizes": [2],
    "hf_budget_s": 20.0,
    "step_reps": 2,
    "name": "engine_serving_small",
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.serving")
    add = parser.add_argument
    add("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    add("--rates", type=float, nargs="+", help="requests/s swept per mix, ascending")
    add("--duration-s", type=float, help="seconds of arrivals per rate")
    add("--drain-s", type=float, help="seconds after the last arrival before a run is cut")
    add("--max-num-seqs", type=int, help="engine batch limit")
    add("--max-num-batched-tokens", type=int, default=2048, help="token budget of the sweeps")
    add("--decode-batch-sizes", type=int, nargs="+")
    add("--step-reps", type=int, help="timed repetitions per step shape")
    add("--hf-budget-s", type=float, help="seconds transformers runs at the goodput rate")
    add("--hf-mixes", nargs="*", default=["short", "long"], choices=MIXES)
    add("--mixes", nargs="+", default=list(MIXES), choices=SWEEP_MIXES, help="swept mixes")
    add("--long-context", action="store_true", help="the 1B shape with 131,072 positions")
    add("--baseline-phases", default="steps,burst", help="what --baseline-engine runs")
    add("--context-cap", type=int, default=0, help="longctx: prompt + answer cap (0: the model's)")
    add("--slo-ttft-ms", type=float, default=Slo().ttft_p99_ms, help="TTFT p99 limit")
    add("--slo-tpot-ms", type=float, default=Slo().tpot_p99_ms, help="TPOT p99 limit")
    add("--baseline-timeout-s", type=float, default=400.0)
    add("--profile-steps", action="store_true", help="print the first step shape's profiles")
    add("--baseline-engine", type=Path, default=None, help="an older site_engine/engine folder")
    add("--model-dir", type=Path, default=None, help="built there when it holds no model")
    add("--tokenizer-dir", type=Path, default=None)
    add("--data-dir", type=Path, default=None)
    add("--traces-dir", type=Path, default=None, help="../shared/datasets/traces")
    add("--results-dir", type=Path, default=results_dir("engine_serving"))
    add("--name", default=None)
    add("--seed", type=int, default=0)
    add("--small", action="store_true", help="tiny model and loads: a smoke test")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--deadline-s", type=float, default=570.0, help="the whole run; sweeps stop in time")
    serving_cache.add_arguments(parser)
    add("--reserve-s", type=float, default=170.0, help="kept from the sweeps for later phases")
    args = parser.parse_args(argv)
    for key, value in (SMALL if args.small else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s) {sorted(unknown)}")
    if "longctx" in args.mixes and not (args.long_context or args.small):
        parser.error("the longctx mix needs --long-context (a model of 131,072 positions)")
    if args.model_dir is None:
        args.model_dir = Path("/tmp/fedllm-bench-llama1b-long" if args.long_context
                              else "/tmp/fedllm-bench-llama1b")  # fmt: skip
    return args


def steps_phase(run: Run, loaded: LoadedModel) -> None:
    shapes = SMALL_SHAPES if run.args.small else SHAPES
    kv_gib = 0.05 if run.args.small else 8.0
    rows = measure_shapes(loaded, shapes, reps=run.args.step_reps, kv_gib=kv_gib, log=run.log,
                          profile=run.args.profile_steps)  # fmt: skip
    run.payload["step_shapes"] = rows
    run.payload["mixed_vs_parts"] = {row["shape"]: row["mixed_vs_parts"] for row in rows}


def decode_phase(run: Run, loaded: LoadedModel) -> None:
    from bench.engine.decode_sweep import decode_sweep
    from bench.engine.roofline import ROOFLINE_METHOD, measure_copy_bandwidth

    copy = measure_copy_bandwidth(loaded.device, (16 if run.args.small else 4096) << 20)
    sweep_args = argparse.Namespace(
        decode_prompt_len=16 if run.args.small else 512,
        max_num_batched_tokens=8192,
        block_size=16,
        decode_batch_sizes=run.args.decode_batch_sizes,
        decode_warmup_steps=1 if run.args.small else 8,
        decode_steps=2 if run.args.small else 48,
        seed=run.args.seed,
    )
    rows = decode_sweep(
        loaded, sweep_args, copy["read_write_bytes_per_s"], 120.0, run.log, with_sync=False
    )
    run.payload["copy_bandwidth"] = copy
    run.payload["decode_sweep"] = rows
    run.payload["roofline_method"] = ROOFLINE_METHOD
    run.payload["decode_vs_roofline"] = {
        str(r["batch_size"]): r["ratio_to_roofline"] for r in rows if "ratio_to_roofline" in r
    }


def sweep_phase(run: Run, loaded: LoadedModel) -> None:
    args = run.args
    pools = run.pools()
    config = EngineConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    run.payload["slo"] = asdict(run.slo)
    run.payload["engine_config"] = asdict(config)
    run.payload["mixes"] = {
        mix: describe_mix(run.requests(mix, 2000, args.seed)) for mix in args.mixes
    }
    sweeps: dict[str, list[dict[str, Any]]] = run.payload.setdefault("sweeps", {})
    engine = PagedEngine(loaded, config)
    warm_up(engine, pools.vocab, min(8, args.max_num_seqs), args.seed)
    # The burst (with its baseline) and transformers phases come after the sweeps; the mixes
    # share what is left before them equally.
    reserve = 0.0 if args.small else args.reserve_s
    share = run.time_left(reserve) / len(args.mixes)
    for index, mix in enumerate(args.mixes):
        later = (len(args.mixes) - index - 1) * share + reserve
        sweeps[mix] = _sweep_mix(run, engine, loaded, config, mix, later)
        run.save(f"sweep {mix}")
    del engine
    free_device_memory(loaded.device)
    _goodput_keys(run.payload, sweeps)


def _sweep_mix(
    run: Run,
    engine: PagedEngine,
    loaded: LoadedModel,
    config: EngineConfig,
    mix: str,
    reserve_s: float,
) -> list[dict[str, Any]]:
    """The ascending sweep of one mix, then one rate between the last held and first missed."""
    args = run.args

    def rates_run(rates: Sequence[float]) -> list[dict[str, Any]]:
        return sweep(
            engine, loaded, config, lambda count, seed: run.requests(mix, count, seed),
            mix=mix, rates=rates, duration_s=args.duration_s, drain_s=args.drain_s,
            seed=args.seed, slo=run.slo, log=run.log, stop_after_failures=1,
            time_left=lambda: run.time_left(reserve_s),
        )  # fmt: skip

    rows = rates_run(args.rates)
    refine = _refinement(rows)
    if refine is not None:
        rows = sorted(rows + rates_run([refine]), key=lambda r: float(r["rate_rps"]))
    return rows


def _refinement(rows: Sequence[dict[str, Any]]) -> float | None:
    """The rate halfway between the last that held the SLO and the first that missed it."""
    held = [float(r["rate_rps"]) for r in rows if r["meets_slo"]]
    missed = [float(r["rate_rps"]) for r in rows if not r["meets_slo"]]
    if not held or not missed or min(missed) < max(held):
        return None
    return (max(held) + min(missed)) / 2


def _goodput_keys(payload: dict[str, Any], sweeps: dict[str, list[dict[str, Any]]]) -> None:
    rates: dict[str, float | None] = {}
    tok_s: dict[str, float | None] = {}
    for mix, rows in sweeps.items():
        best = goodput(rows)
        rates[mix] = best["rate_rps"] if best else None
        tok_s[mix] = best["output_tok_s"] if best else None
    payload["goodput_rate_rps"] = rates
    payload["goodput_output_tok_s"] = tok_s
    short, long = tok_s.get("short"), tok_s.get("long")
    payload["goodput_long_vs_short"] = long / short if short and long is not None else None


def burst_phase(run: Run, loaded: LoadedModel) -> None:
    args = run.args
    burst_args = argparse.Namespace(
        max_num_seqs=4 if args.small else 256, max_num_batched_tokens=4096, block_size=16,
        kv_cache_gib=0.0,
    )  # fmt: skip
    spec = WorkloadSpec(
        counts=(("alpaca_random", 6 if args.small else 800), ("lima", 2 if args.small else 200)),
        max_prompt_tokens=48 if args.small else 1024,
        max_output_tokens=8 if args.small else 1024,
        seed=args.seed,
    )
    trace = load_workload(spec, load_tokenizer(run.tokenizer_dir).encode, run.data_dir)
    summary, extra = run_engine(
        loaded, trace, engine_config(burst_args), name="burst", arrivals=None,
        poisson_rate=None, budget_s=150.0, log=run.log, seed=args.seed, warmup_requests=8,
    )  # fmt: skip
    run.payload["burst"] = {"summary": asdict(summary), **extra, "trace_requests": len(trace)}
    run.log(f"burst: {summary.output_tok_s:.0f} tok/s, {summary.completed}/{summary.requests}")


def hf_phase(run: Run, loaded: LoadedModel) -> None:
    args = run.args
    results: dict[str, Any] = run.payload.setdefault("hf_continuous_batching", {})
    pools = run.pools()
    for mix in args.hf_mixes:
        rate = (run.payload.get("goodput_rate_rps") or {}).get(mix) or args.rates[0]
        count = max(1, round(rate * args.duration_s))
        rate_seed = args.seed * 1000 + round(rate * 10)  # the sweep's requests at that rate
        requests = build_mix(pools, mix, count, rate_seed)
        arrivals = poisson_arrivals(count, rate, rate_seed)
        budget = min(args.hf_budget_s, max(5.0, run.time_left() - 20.0))
        results[mix] = run_hf_open_loop(
            loaded.model, requests, arrivals, rate=rate, max_batch_size=args.max_num_seqs,
            max_batch_tokens=args.max_num_batched_tokens, budget_s=budget, log=run.log,
        )  # fmt: skip
        run.log(f"  hf {mix} @ {rate:g}: {results[mix].get('output_tok_s')} tok/s")
        run.save(f"hf {mix}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m bench.engine.serving" + "".join(f" {shlex.quote(a)}" for a in argv)
    run = Run(args, command)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on the GPU machine or pass --device cpu")
    if device.type == "cuda":
        run.log(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    shape = SMALL_SHAPE if args.small else LLAMA_1B_LONG_SHAPE if args.long_context else (
        LLAMA_1B_SHAPE)  # fmt: skip
    loaded = ensure_model(args.model_dir, shape, run.tokenizer_dir, run.log, dtype=args.dtype,
                          device=args.device, seed=args.seed)  # fmt: skip
    run.context = loaded.max_model_len
    run.payload["model"] = {"shape": shape, "dtype": args.dtype, "dir": str(args.model_dir)}
    if args.baseline_engine is not None:
        run.payload["baseline"] = run_baseline(
            args, run.tokenizer_dir, run.data_dir, run.log, run.traces_dir
        )
        run.save("baseline")
    for name, phase in (("steps", steps_phase), ("decode", decode_phase),
                        ("sweep", sweep_phase), ("cache", serving_cache.cache_phase)):  # fmt: skip
        if name in run.phases:
            _guarded(run, name, phase, loaded)
    if "burst" in run.phases:
        _guarded(run, "burst", burst_phase, loaded)
    if "hf" in run.phases:
        _guarded(run, "hf", hf_phase, loaded)
    run.payload["complete"] = True
    run.save("all phases")
    return run.payload


def _guarded(run: Run, name: str, phase: Any, loaded: LoadedModel) -> None:
    """Runs a phase; a failure is recorded under "errors" and the run goes on."""
    try:
        phase(run, loaded)
    except Exception as exc:
        import traceback

        run.payload["errors"][name] = traceback.format_exc()[-3000:]
        run.log(f"{name} failed: {type(exc).__name__}: {exc}")
    free_device_memory(loaded.device)
    run.save(name)


if __name__ == "__main__":
    main()
    # A continuous-batching thread that ignored its stop must not keep the process alive.
    exit_if_threads_linger()
