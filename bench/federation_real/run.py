"""`python -m bench.federation_real`: the routing arms on a real federation, then the same
scenario in fedsim, side by side (bench/federation_real/__init__.py).

    python -m bench.federation_real --preset gpu [--gpus N | --gpu-sites SHAPE@MS,...] [--arms ...]
        [--workload sharegpt|PATH]
        [--loads 0.7,1.1] [--seeds 11,12] [--rate R] [--duration-s S] [--no-compare]
    python -m bench.federation_real --compare DIR/NAME_real.json ...   # the comparison alone

The real run (bench/federation_real/real.py) writes per cell (a seed at a load: grid.py)
NAME_real.json (sites, card, capacity, workload spec and fingerprint, each arm's figures) and
NAME_requests.json.gz (every request's outcome); the comparison writes NAME.json and NAME.md
(real, simulated, errors, goals, ranking), and for several cells BASE_grid.{json,md}, by default
into bench/results/federation_real/. The loads are multiples of the pair's capacity, measured
through the gateway before the arms (capacity.py); `--rate` gives one rate instead. The gpu
preset's grid on two GPUs is one device call: bench/federation_real/gpu_call.sh.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import results_dir, write_results
from bench.engine.paths import shared_path
from bench.federation_real.compare import compare, markdown
from bench.federation_real.federation import card_of
from bench.federation_real.grid import grid_markdown, parse_list, winners
from bench.federation_real.presets import Preset, choose, parse_layout
from bench.federation_real.real import Invocation, real_run
from bench.federation_real.sim import SERVING, SITE_CPU, STEP_SOURCES, simulate
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.step_models import STEP_MODELS

RESULTS = results_dir("federation_real")
_STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.0f}s] {message}", flush=True)


def _run_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--preset", choices=("cpu", "gpu"), default="gpu")
    add("--gpus", type=int, default=None, help="sites (one a GPU); default all")
    add("--gpu-sites", default=None, help="each GPU's site as SHAPE@MS one way, in GPU order "
        "(e.g. llama1b@150: the 1B site alone); default: --gpus alternating 8B and 1B")  # fmt: skip
    add("--arms", nargs="*", default=None)
    add("--workload", default="sharegpt", help="sharegpt, or a trace's path")
    add("--loads", default=None, help="offered loads x the measured capacity (gpu: 0.7,1.1)")
    add("--rate", type=float, default=None, help="req/s outright, no capacity phase (cpu: 3)")
    add("--capacity-rps", type=float, default=None, help="the capacity, given, not measured")
    add("--capacity-streams", type=int, default=None, help="the saturation phase's streams")
    add("--duration-s", type=float, default=None)
    add("--drain-s", type=float, default=None)
    add("--seed", type=int, default=0)
    add("--seeds", default=None, help="several seeds, e.g. 11,12")
    add("--clients", type=int, default=None, help="client processes")
    add("--tokenizer-dir", type=Path, default=None)
    add("--work-dir", type=Path, default=Path("/tmp/fedllm-federation-real"))
    add("--out-dir", type=Path, default=RESULTS)
    add("--name", default=None, help="default federation_real_<preset|card>")
    add("--no-compare", action="store_true", help="the real run alone")


def _compare_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--compare", type=Path, nargs="+", default=None, help="NAME_real.json files to compare")
    add("--step-models", type=Path, default=STEP_MODELS)
    add(
        "--step-source",
        choices=STEP_SOURCES,
        default=None,
        help="the twin's step time: the card's fitted models (the GPU's default) or the cost "
        "each site learned while the cell ran (the CPU's)",
    )
    add(
        "--serving-costs",
        choices=SERVING,
        default="bench",
        help="the twin's serving path: the CPU bench's costs, those scaled to the gateway CPU "
        "the run measured, or none",
    )
    add(
        "--site-cpu",
        choices=SITE_CPU,
        default="process",
        help="a site's serving thread in the twin: in its engine's process (one interpreter "
        "lock: a step lasts at least its tokens over what the serving-path bench's site "
        "delivered at most on the card) or on a CPU of its own (the twin before issue 78's r91)",
    )
    add(
        "--twin-chunks-min-per-s",
        type=float,
        default=None,
        help="the twin's gateway with this chunk-budget floor (GATEWAY_STREAM_CHUNKS_MIN_PER_S) "
        "instead of the one the real run had: what the governor would have done there",
    )
    add("--traces", type=Path, default=None, help="where --compare finds a trace")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.federation_real", description=__doc__)
    _run_options(parser)
    _compare_options(parser)
    return parser.parse_args(argv)


def _preset(args: argparse.Namespace) -> tuple[Preset, str]:
    """The preset with the command's overrides, and the card its sites run on."""
    layout = parse_layout(args.gpu_sites) if args.gpu_sites else None
    preset = choose(args.preset, args.gpus, layout)
    loads = tuple(parse_list(args.loads, float)) if args.loads else preset.loads
    capacity = preset.capacity
    if args.capacity_streams is not None:
        capacity = replace(capacity, streams=args.capacity_streams)
    return replace(
        preset,
        arms=tuple(args.arms) if args.arms else preset.arms,
        loads=() if args.rate else loads,
        rate_rps=args.rate or preset.rate_rps,
        duration_s=args.duration_s or preset.duration_s,
        drain_s=args.drain_s if args.drain_s is not None else preset.drain_s,
        clients=args.clients or preset.clients,
        capacity=capacity,
    ), card_of(preset.sites)


def invocation(args: argparse.Namespace, command: str) -> Invocation:
    preset, card = _preset(args)
    tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    return Invocation(
        preset=preset,
        card=card,
        seeds=tuple(int(s) for s in parse_list(args.seeds, int)) or (args.seed,),
        workload=args.workload,
        rate=None if preset.loads else preset.rate_rps,
        capacity_rps=args.capacity_rps,
        command=command,
        base=args.name or f"federation_real_{preset.name if card == 'cpu' else card}",
        out_dir=args.out_dir,
        work_dir=args.work_dir,
        tokenizer_dir=tokenizer_dir,
        vocab=len(load_tokenizer(tokenizer_dir)),
        log=log,
    )


def _notes(real: dict[str, Any], path: Path, sim_info: str) -> list[str]:
    capacity = real.get("capacity")
    spec = real["workload_spec"]
    notes = [
        f"Real run: `{real['command']}` ({path.name}); {real['workload']['requests']} requests "
        f"over {spec['duration_s']:g} s at {spec['rate_rps']:.1f} req/s, seed {spec['seed']}, "
        f"workload {spec['source']}, card {real['card']}.",
        "Sites: "
        + "; ".join(
            f"{s['name']} ({s['shape']}, {s['max_num_seqs']} slots, {s['max_num_batched_tokens']} "
            f"tokens a step, {s['one_way_ms']:g} ms one way, {s['kv_blocks_total']} KV blocks)"
            for s in real["sites"]
        )
        + ".",
        f"SLO: TTFT <= {real['slo']['ttft_p99_s']} s and TPOT <= {real['slo']['tpot_p99_s']} s "
        "per request for goodput; the same at p99 for `p99 SLO met`.",
        f"Simulated: {sim_info}.",
    ]
    if capacity:
        notes.insert(1, (
            f"Load {real['load']:g}x the capacity measured before the arms: "
            f"{capacity['rps']:.1f} req/s ({capacity['tokens_per_s']:,.0f} answer tokens/s over "
            f"a mean answer of {capacity['mean_answer_tokens']:.0f}; answers that ended: "
            f"{capacity['finished_rps']:.1f} req/s), {capacity['method']}."
        ))  # fmt: skip
    return notes


def compare_run(path: Path, args: argparse.Namespace, command: str) -> tuple[Path, dict[str, Any]]:
    real = json.loads(path.read_text())
    log(f"simulating {sorted(real['arms'])} on {real['card']} ({path.name})")
    source = args.step_source or ("learned" if real["card"] == "cpu" else "fitted")
    traces = args.traces or shared_path(None, "datasets", "traces")
    sim, info = simulate(
        real,
        args.step_models,
        traces,
        args.serving_costs,
        source,
        args.site_cpu,
        args.twin_chunks_min_per_s,
    )
    result = compare(real["arms"], sim)
    name = path.name.removesuffix("_real.json")
    payload = {"real_run": real, "simulated": sim, **result, "simulation": info}
    notes = _notes(real, path, info["summary"])
    out = write_results(name, payload, markdown(real["arms"], sim, result, notes), command,
                        args.out_dir)  # fmt: skip
    log(f"wrote {out}")
    return out, payload


def compare_all(paths: Sequence[Path], args: argparse.Namespace, command: str) -> None:
    """Each cell's comparison; for several, BASE_grid.{json,md} over them (grid.py)."""
    results = [compare_run(p, args, command)[1] for p in paths]
    if len(results) < 2:
        return
    cells = [str(r["real_run"].get("cell")) for r in results]
    base = paths[0].name.removesuffix("_real.json").removesuffix(f"_{cells[0]}")
    by_cell = dict(zip(cells, results, strict=True))
    summary = {
        "cells": cells,
        "same_ranking_in_all": all(r["same_ranking"] for r in results),
        "all_goals_met_in_all": all(r["all_goals_met"] for r in results),
        **{
            key: {cell: r[key] for cell, r in by_cell.items()}
            for key in ("same_ranking", "all_goals_met", "goodput_error", "ttft_p50_error")
        },
        "winners": {cell: winners(r) for cell, r in by_cell.items()},
    }
    out = write_results(f"{base}_grid", summary, grid_markdown(results), command, args.out_dir)
    log(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = parse(given)
    command = shlex.join(["python", "-m", "bench.federation_real", *given])
    if args.compare is not None:
        compare_all(args.compare, args, command)
        return 0
    paths = real_run(invocation(args, command))
    if not args.no_compare:
        compare_all(paths, args, command)
    return 0
