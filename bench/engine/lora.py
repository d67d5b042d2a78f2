"""Multi-LoRA serving against the base model alone (issue 51).

    python -m bench.engine.lora               (GPU: bench/results/engine_lora/engine_lora_<gpu>.*)
    python -m bench.engine.lora --preset cpu  (CPU smoke run of a tiny model; numbers mean little)

A Llama-3-8B-shaped random model in bf16 and random PEFT-format adapters of rank 16 on all
seven projections (q, k, v, o, gate, up, down), written here (lora_driver.py; no peft needed).
Steps:
1. The base engine (no LoRA): a burst of requests gives its capacity (requests/s); `base`:
   Poisson arrivals at `load` x that capacity for `window_s`, ShareGPT-like lengths; a decode
   step of 256 rows, timed.
2. The LoRA engine (max_loras 64 GPU slots, a host LRU of max_cpu_loras): the same arrivals
   with each request's adapter drawn with Zipf(1) popularity over 8, 64 and 1,000 adapters;
   a decode step of 256 rows over 64 distinct adapters (4 rows each), timed.
3. The knee: on each engine (the base; LoRA with `knee_adapters` adapters, Zipf(1)) a ladder of
   loads (`knee_loads` x the base's burst capacity, `knee_window_s` each), stopped at the first
   rung where fewer than 90% of requests meet both SLOs; the knee is the rate where that share
   crosses 90% (linear between rungs).
Keys (issue 59's goals): `decode_step_vs_base` (<= 1.15 at 64 adapters), `tpot_p50_vs_base`
{adapters: LoRA TPOT p50 / base TPOT p50} (<= 1.15 at 8 and 64), `goodput_vs_base` {adapters:
goodput / base goodput} (goodput: requests per second that finish within the TTFT and TPOT
SLOs; >= 0.9 at 1,000) and `capacity_vs_base` (the LoRA knee over the base's, >= 0.85).
`--seeds N` runs it all for N seeds in one process (one model build): the headline keys are
then the worst seed's, `range` holds each key's [min, max] and `by_seed` each seed's.
`--lora-unified-slots` runs the LoRA engine with slots out of the KV block pool (the site's
`--lora-unified-slots`; `--max-loras` is then a cap on resident adapters), `--max-loras`/
`--max-cpu-loras` with other slot and host-LRU sizes than the preset's; the results' `engine`
says which.
`merged`: one adapter merged into the base weights is the base model with other numbers in its
matrices, so its step and goodput are the base's (not measured apart); serving N adapters that
way takes N deployments, N GPUs of this size, each loaded 1/N as much, against one GPU here.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, write_results
from bench.engine.engine_runs import warm_up
from bench.engine.harness import Progress
from bench.engine.lora_driver import (
    KNEE_ATTAINMENT,
    Lengths,
    adapter_names,
    burst_rps,
    decode_step_s,
    drive,
    knee_phase,
    make_requests,
    with_adapters,
    write_adapters,
    zipf_choices,
)
from bench.engine.lora_report import across_seeds, plot, report
from bench.engine.model_setup import LLAMA_8B_SHAPE, ensure_model
from bench.engine.presets import chosen, device_label, kv_bytes, preset_parser, tiny_shape
from bench.engine.priority_driver import poisson_arrivals
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "shape": {**LLAMA_8B_SHAPE, "max_position_embeddings": 4096, "rope_scaling": None},
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "max_loras": 64,
        "max_cpu_loras": 160,  # ~13 GB of host memory at 84 MB an adapter
        "rank": 16,
        "adapters": (8, 64, 1000),
        "distinct_weights": 16,  # slots hold copies: the bytes need not differ (lora_driver.py)
        "lengths": Lengths(prompt=(200, 1500, 2048), answer=(120, 500, 512)),
        "burst_requests": 256,
        "window_s": 30.0,
        "drain_s": 10.0,
        # One device command (10 minutes) holds the GPU tests too: an arm that would end after
        # this many seconds of the bench is skipped (and said so in the results).
        "deadline_s": 470.0,
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "decode_rows": 256,
        "decode_adapters": 64,
        "decode_steps": 30,
        "knee_adapters": 64,
        "knee_loads": (0.6, 0.8, 1.0, 1.2),
        "knee_window_s": 15.0,
    },
    "cpu": {
        "shape": tiny_shape(512),
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_loras": 4,
        "max_cpu_loras": 6,
        "rank": 8,
        "adapters": (2, 4, 10),
        "distinct_weights": 4,
        "lengths": Lengths(prompt=(24, 96, 128), answer=(8, 24, 32)),
        "burst_requests": 16,
        "window_s": 2.0,
        "drain_s": 6.0,
        "deadline_s": 600.0,
        "slo": {"ttft_s": 2.0, "tpot_s": 0.5},
        "decode_rows": 8,
        "decode_adapters": 4,
        "decode_steps": 5,
        "knee_adapters": 4,
        "knee_loads": (0.6, 1.0, 1.4),
        "knee_window_s": 1.0,
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    runs = ("window_s", "drain_s", "deadline_s")
    parser, add = preset_parser("bench.engine.lora", __doc__, PRESETS, "engine_lora", *runs)
    add("--adapter-dir", type=Path, default=None, help="adapters written there first if missing")
    add("--load", type=float, default=0.6, help="arrival rate / the base's burst capacity")
    add("--seed", type=int, default=0, help="the first seed")
    add("--seeds", type=int, default=1, help="seeds run (min-max reported)")
    add("--knee-window-s", type=float, default=None, help="seconds of arrivals per knee rung")
    add("--knee-loads", type=float, nargs="+", default=None, help="the knee's ladder of loads")
    add("--max-lora-loads", type=int, default=None, help="loader threads (default: the site's)")
    add("--lora-unified-slots", action="store_true", help="slots out of the KV block pool")
    add("--max-loras", type=int, default=None, help="device slots (a cap when unified)")
    add("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory")
    args = parser.parse_args(argv)
    if not 0 < args.load < 1:
        parser.error("--load must be in (0, 1)")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    args.p = chosen(args, PRESETS, *runs, "knee_window_s", "knee_loads")
    if args.max_lora_loads is not None and args.max_lora_loads < 1:
        parser.error("--max-lora-loads must be >= 1")
    loads = args.max_lora_loads
    args.p["max_loads"] = LoraSettings(Path()).max_loads if loads is None else loads
    for key in ("max_loras", "max_cpu_loras"):
        if getattr(args, key) is not None:
            args.p[key] = getattr(args, key)
    if args.p["max_cpu_loras"] < args.p["max_loras"]:
        parser.error("--max-cpu-loras must be >= --max-loras")
    args.p["unified_slots"] = args.lora_unified_slots
    return args


def build_engine(loaded: LoadedModel, p: dict[str, Any], lora: LoraSettings | None) -> PagedEngine:
    config = EngineConfig(
        max_num_seqs=p["max_num_seqs"],
        max_num_batched_tokens=p["max_num_batched_tokens"],
        block_size=16,
        kv_cache_bytes=0 if loaded.device.type == "cuda" else kv_bytes(loaded, 256),
        prefix_caching=False,  # random prompts share nothing
        lora=lora,
    )
    return PagedEngine(loaded, config)


def _close(engine: PagedEngine) -> None:
    engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def base_phase(
    loaded: LoadedModel, args: argparse.Namespace, seed: int, log: Progress
) -> tuple[dict[str, Any], list[tuple[float, Any]]]:
    """Capacity, the base arm, the base decode step and the base's knee, on an engine without
    LoRA."""
    p, vocab = args.p, loaded.model.config.vocab_size
    engine = build_engine(loaded, p, None)
    warm_up(engine, vocab, min(4, p["max_num_seqs"]), seed)
    rps = burst_rps(
        engine, make_requests(p["burst_requests"], p["lengths"], vocab, seed + 1, "cap")
    )
    rate = args.load * rps
    times = poisson_arrivals(rate, p["window_s"], seed + 2)
    requests = make_requests(len(times), p["lengths"], vocab, seed + 3)
    arrivals = list(zip(times, requests, strict=True))
    log(f"base capacity {rps:.2f} req/s; arrivals at {rate:.2f}/s, {len(times)} requests")
    slo = p["slo"]
    base = drive(engine, arrivals, p["window_s"], p["drain_s"]).summary(
        slo["ttft_s"], slo["tpot_s"]
    )
    log(f"base: {base}")
    step = decode_step_s(engine, vocab, p["decode_rows"], [None], p["decode_steps"], seed + 4)
    log(f"base decode step of {p['decode_rows']} rows: {step * 1000:.2f} ms")
    knee = knee_phase(engine, vocab, p, rps, seed, [], log)
    _close(engine)
    result = {"capacity_rps": rps, "rate_rps": rate, "base": base, "base_step_s": step}
    return result | {"base_knee": knee}, arrivals


def lora_phase(
    loaded: LoadedModel,
    args: argparse.Namespace,
    seed: int,
    base: dict[str, Any],
    arrivals: list[tuple[float, Any]],
    root: Path,
    log: Progress,
) -> dict[str, Any]:
    p, vocab, slo = args.p, loaded.model.config.vocab_size, args.p["slo"]
    settings = LoraSettings(
        root, p["max_loras"], p["max_cpu_loras"], p["rank"], max_loads=p["max_loads"],
        unified=p["unified_slots"],
    )  # fmt: skip
    engine = build_engine(loaded, p, settings)
    warm_up(engine, vocab, min(4, p["max_num_seqs"]), seed)
    names = adapter_names(max(p["adapters"]))
    step_adapters: list[str | None] = list(names[: p["decode_adapters"]])
    step = decode_step_s(
        engine, vocab, p["decode_rows"], step_adapters, p["decode_steps"], seed + 4
    )
    log(f"decode step, {p['decode_adapters']} adapters: {step * 1000:.2f} ms")
    arms: dict[str, Any] = {}
    requests = [r for _, r in arrivals]
    for count in p["adapters"]:
        if log.elapsed() + p["window_s"] + p["drain_s"] > p["deadline_s"]:
            arms[str(count)] = {"skipped": f"would end after the {p['deadline_s']} s deadline"}
            log(f"{count} adapters: skipped (deadline)")
            continue
        chosen: list[str | None] = list(zipf_choices(names[:count], len(requests), seed + count))
        tagged = with_adapters(requests, chosen, f"n{count}")
        timed = [(t, r) for (t, _), r in zip(arrivals, tagged, strict=True)]
        arm = drive(engine, timed, p["window_s"], p["drain_s"])
        arms[str(count)] = arm.summary(slo["ttft_s"], slo["tpot_s"]) | {
            "distinct_adapters_used": len(set(chosen))
        }
        log(f"{count} adapters: {arms[str(count)]}")
    knee = knee_phase(
        engine, vocab, p, base["capacity_rps"], seed, names[: p["knee_adapters"]], log
    )
    _close(engine)
    return {"arms": arms, "lora_step_s": step, "lora_knee": knee}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def run_seed(
    loaded: LoadedModel, args: argparse.Namespace, seed: int, root: Path, log: Progress
) -> dict[str, Any]:
    """Every phase for one seed: the result keys of one run."""
    p = args.p
    base, arrivals = base_phase(loaded, args, seed, log)
    lora = lora_phase(loaded, args, seed, base, arrivals, root, log)
    base_run = base["base"]
    arms = lora["arms"]
    ratios = {count: _ratio(arm.get("goodput_rps"), base_run["goodput_rps"])
              for count, arm in arms.items()}  # fmt: skip
    tpot = {count: _ratio(arm.get("tpot_p50_ms"), base_run["tpot_p50_ms"])
            for count, arm in arms.items()}  # fmt: skip
    knees = {"base": base["base_knee"], "lora": lora["lora_knee"]}
    return {
        "seed": seed,
        "goodput_vs_base": ratios,
        "tpot_p50_vs_base": tpot,
        "decode_step_vs_base": lora["lora_step_s"] / base["base_step_s"],
        "capacity_vs_base": _ratio(knees["lora"]["knee_rps"], knees["base"]["knee_rps"]),
        "decode_step_ms": {"base": base["base_step_s"] * 1000, "lora": lora["lora_step_s"] * 1000},
        "runs": {"base": base_run, **{f"{k}_adapters": v for k, v in arms.items()}},
        "knee": knees | {"adapters": p["knee_adapters"], "loads": list(p["knee_loads"]),
                         "window_s": p["knee_window_s"], "attainment": KNEE_ATTAINMENT},
        "merged": merged_comparison(ratios, base_run["goodput_rps"]),
        "capacity_rps": base["capacity_rps"],
        "rate_rps": base["rate_rps"],
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    log = Progress()
    p = args.p
    model_dir = args.model_dir or Path(f"/tmp/fedllm-bench-lora-{args.preset}")
    loaded = ensure_model(model_dir, p["shape"], args.tokenizer_dir, log, dtype=p["dtype"],
                          device=p["device"], seed=args.seed)  # fmt: skip
    if loaded.device.type == "cpu":
        torch.set_num_threads(1)
    root = args.adapter_dir or Path(f"/tmp/fedllm-bench-lora-adapters-{args.preset}")
    base_shapes = BaseShapes.of_model(loaded.model)
    write_adapters(root, base_shapes, max(p["adapters"]), p["distinct_weights"], p["rank"])
    log(f"{max(p['adapters'])} adapters in {root}")
    seeds = range(args.seed, args.seed + args.seeds)
    runs = [run_seed(loaded, args, seed, root, log) for seed in seeds]
    device = device_label(loaded)
    result: dict[str, Any] = {
        "preset": args.preset,
        "device": device,
        **runs[0],
        **across_seeds(runs),
        "seeds": list(seeds),
        "load": args.load,
        "slo": p["slo"],
        "window_s": p["window_s"],
        "drain_s": p["drain_s"],
        "lengths": {"prompt": p["lengths"].prompt, "answer": p["lengths"].answer},
        "engine": {
            k: p[k]
            for k in (
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_loras",
                "max_cpu_loras",
                "max_loads",
                "rank",
                "distinct_weights",
                "unified_slots",
            )
        },
        "decode": {k: p[k] for k in ("decode_rows", "decode_adapters", "decode_steps")},
        "shape": p["shape"],
    }
    name = args.name or f"engine_lora_{device}"
    path = write_results(
        name, result, report(result), command_line("bench.engine.lora", argv), args.results_dir
    )
    plot(result, path.with_suffix(".png"))
    log(f"wrote {path}")


def merged_comparison(ratios: dict[str, float | None], base_goodput: float) -> dict[str, Any]:
    """One deployment per adapter, each with its adapter merged into a copy of the base: each
    runs at the base's speed (the same matrices' shapes), so N adapters need N GPUs; at the same
    total load each of them gets 1/N of the requests."""
    return {
        "step_vs_base": 1.0,
        "note": "a merged adapter is the base model with other weights: its step and goodput "
        "at a given load are the base's; N adapters need N such deployments (N GPUs)",
        "by_adapters": {
            count: {
                "gpus_merged": int(count),
                "gpus_multi_lora": 1,
                "goodput_per_gpu_merged_rps": base_goodput / int(count),
                "goodput_per_gpu_multi_lora_rps": (ratio or 0.0) * base_goodput,
            }
            for count, ratio in ratios.items()
        },
    }


if __name__ == "__main__":
    main()
