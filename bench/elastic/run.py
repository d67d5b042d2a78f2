"""`python -m bench.elastic`: the arms, one after the other on fresh processes, under the same
stepped open-loop load; the result files (bench/elastic/report.py).

1. A random model of the preset's shape with SmolLM2's tokenizer (bench/loadgen/models.py).
2. The unit rate (1x), unless given (`--unit-rps`, or the merged result's): a static one-site
   federation is sent 4 x its batch slots of the workload's requests at once; what it completes
   per second is one site's capacity, 1x is `unit_share` of it.
3. Each arm: its sites and gateway started (bench/elastic/arms.py), the load sent through the
   public API (bench/loadgen/client.py), the timeline sampled (bench/elastic/timeline.py),
   then the gateway's scaling events read from its database, and everything stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sqlite3
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import results_dir
from bench.elastic.arms import ARMS, ELASTIC_SITE, ArmProcesses, start_arm
from bench.elastic.presets import PRESETS, ElasticPreset
from bench.elastic.report import arm_result, write
from bench.elastic.timeline import Timeline
from bench.elastic.workload import arrival_times, templates, timed
from bench.engine.paths import shared_path
from bench.loadgen.client import run_open_loop
from bench.loadgen.models import default_tokenizer, write_model
from bench.loadgen.text_tokens import WordTokens
from bench.loadgen.workload import Request, describe
from devtools.forkserver import FORK_SERVER_ENV
from fedllm_contract.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = results_dir("elastic")
_STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.0f}s] {message}", flush=True)


@dataclass(frozen=True, slots=True)
class Options:
    preset: ElasticPreset
    arms: tuple[str, ...]
    unit_rps: float | None
    merge: tuple[Path, ...]
    tokenizer_dir: Path
    data_dir: Path | None
    trace_file: Path
    predictor_dir: Path | None
    work_dir: Path
    out_dir: Path
    name: str
    seed: int
    no_arms: bool


def with_gpus(preset: ElasticPreset, gpus: str) -> ElasticPreset:
    """The preset with its two places on the given devices ("2,3"): two arms of a four-GPU
    machine run side by side, each on GPUs of its own."""
    devices = [d.strip() for d in gpus.split(",")]
    if len(devices) != 2 or not all(d.isdigit() for d in devices):
        raise ValueError(f"--gpus takes two device indexes like 2,3, not {gpus!r}")
    places = tuple(
        replace(place, env=(*((k, v) for k, v in place.env if k != "CUDA_VISIBLE_DEVICES"),
                            ("CUDA_VISIBLE_DEVICES", device)))
        for place, device in zip(preset.places, devices, strict=True)
    )  # fmt: skip
    return replace(preset, places=(places[0], places[1]))


def merged_unit(paths: Sequence[Path]) -> float | None:
    """The 1x all merged results share (each arm must see the same requests), or None."""
    units = {float(json.loads(path.read_text())["unit_rps"]) for path in paths}
    if len(units) > 1:
        raise ValueError(f"the merged results were run at different 1x rates: {sorted(units)}")
    return units.pop() if units else None


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.elastic",
        description="Autoscaled 1-2 sites against static 1 and 2 under a 1x-3x-1x load step.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--unit-rps", type=float, help="1x in requests/s (default: calibrate)")
    parser.add_argument(
        "--unit-share", type=float, help="1x as a share of one site's calibrated capacity"
    )
    parser.add_argument("--phase-s", type=float, nargs=3, help="seconds of the 1x, 3x, 1x steps")
    parser.add_argument(
        "--merge", type=Path, nargs="+", default=[],
        help="results of other arms (same 1x and seed) to add these to",
    )  # fmt: skip
    parser.add_argument(
        "--gpus", help="the two device indexes of this run's sites (default: the preset's, 0,1)"
    )
    parser.add_argument(
        "--no-arms", action="store_true",
        help=(
            "run no arm: measure 1x (for arms run side by side after), or with --merge "
            "write the merged arms as one result"
        ),
    )  # fmt: skip
    parser.add_argument("--tokenizer-dir", type=Path, help="default: var/models/SmolLM2-*")
    parser.add_argument("--data-dir", type=Path, help="datasets (default ../shared/datasets)")
    parser.add_argument(
        "--trace-file",
        type=Path,
        default=shared_path(None, "datasets", "traces", "mooncake_fast25_synthetic_trace.jsonl"),
    )
    parser.add_argument(
        "--predictor-dir", type=Path, help="the gateways' length predictor (default: none)"
    )
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "var" / "bench-elastic")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", help="result file name (default elastic_<preset>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pool-size", type=int, help="the autoscaled arm's warm pool (default: the preset's, 0)"
    )
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.pool_size is not None:
        preset = replace(preset, pool_size=args.pool_size)
    if args.unit_share is not None:
        preset = replace(preset, unit_share=args.unit_share)
    if args.phase_s:
        phases = tuple(
            replace(p, seconds=s) for p, s in zip(preset.phases, args.phase_s, strict=True)
        )
        preset = replace(preset, phases=phases)
    if args.gpus:
        try:
            preset = with_gpus(preset, args.gpus)
        except ValueError as exc:
            parser.error(str(exc))
    tokenizer = args.tokenizer_dir or default_tokenizer()
    if tokenizer is None:
        parser.error("no SmolLM2 tokenizer in var/models: pass --tokenizer-dir")
    unit = args.unit_rps
    try:
        merged = merged_unit(args.merge)
    except ValueError as exc:
        parser.error(str(exc))
    if merged is not None:
        if unit is not None and abs(unit - merged) > 1e-3:
            parser.error(f"--unit-rps {unit} differs from the merged result's {merged}")
        unit = merged
    return Options(
        preset, tuple(dict.fromkeys(args.arms)), unit, tuple(args.merge), tokenizer.resolve(),
        args.data_dir, args.trace_file,
        args.predictor_dir.resolve() if args.predictor_dir else None, args.work_dir.resolve(),
        args.out_dir,
        args.name or f"elastic_{preset.name}", args.seed, args.no_arms,
    )  # fmt: skip


def calibrate(
    options: Options, model_dir: Path, requests: Sequence[Request], slots: int
) -> dict[str, float]:
    """One site's capacity (requests/s it completes with 4 x its slots sent at once)."""
    probe = [replace(r, at_s=0.0, id=f"probe-{i}") for i, r in enumerate(requests[: 4 * slots])]
    arm = start_arm("static1", options.preset, model_dir, options.tokenizer_dir,
                    options.work_dir / "calibration", options.predictor_dir)  # fmt: skip
    try:
        outcomes = asyncio.run(run_open_loop(arm.base_url, probe, drain_s=600.0))
    finally:
        arm.close()
    done = sum(o.ok for o in outcomes.outcomes)
    capacity = done / outcomes.wall_s
    log(f"calibration: {done}/{len(probe)} in {outcomes.wall_s:.1f}s: {capacity:.2f} req/s")
    return {"probe_requests": len(probe), "completed": done,
            "wall_s": round(outcomes.wall_s, 2), "capacity_rps": round(capacity, 3)}  # fmt: skip


def scaling_events(arm: ArmProcesses) -> list[dict[str, Any]]:
    path = arm.database_url.removeprefix("sqlite+aiosqlite:///")
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT created_at, action, site, actor, serving_sites, desired_sites, backlog_s, "
            "reason FROM scaling_events ORDER BY id"
        ).fetchall()
    return [
        {"at": datetime.fromisoformat(at).timestamp(), "action": action, "site": site,
         "actor": actor, "serving": serving, "desired": desired, "backlog_s": backlog,
         "reason": reason}
        for at, action, site, actor, serving, desired, backlog, reason in rows
    ]  # fmt: skip


def run_arm(
    name: str, options: Options, model_dir: Path, requests: Sequence[Request]
) -> dict[str, Any]:
    preset = options.preset
    log(f"arm {name}: starting its processes")
    arm = start_arm(
        name, preset, model_dir, options.tokenizer_dir, options.work_dir, options.predictor_dir
    )
    try:
        timeline = Timeline(arm.base_url, arm.watched)
        log(f"arm {name}: {len(requests)} requests over {preset.load_s:g}s")
        started_wall, started = time.time(), time.perf_counter()
        timeline.begin(started)
        outcomes = asyncio.run(run_open_loop(arm.base_url, requests, preset.drain_s))
        timeline.end()
        events = scaling_events(arm)
    finally:
        arm.close()
    result = arm_result(name, preset, outcomes, timeline, events, started_wall, ELASTIC_SITE)
    log(
        f"arm {name}: {result['completed']}/{result['requests']} ok, lost {result['lost']}, "
        f"SLO attained {result['slo_attainment']:.3f}, {result['site_seconds']:.0f} site-s, "
        f"TTFT p99 {result['ttft_s']['p99']}s"
    )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    # Sites run as processes of their own command line, never forks of a test's fork server:
    # the timeline finds them by it (/proc), and their GPU time is their processes' lifetime.
    os.environ.pop(FORK_SERVER_ENV, None)
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse(args)
    command = shlex.join(["python", "-m", "bench.elastic", *args])
    preset = options.preset
    tokenizer = load_tokenizer(options.tokenizer_dir)
    vocab = len(tokenizer)
    words = WordTokens.of(
        lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.decode, vocab
    )
    out = options.work_dir / "models" / f"{preset.shape.name}-{vocab}"
    model_dir = write_model(out, preset.shape, options.tokenizer_dir)
    slots = int(preset.places[0].args[preset.places[0].args.index("--max-num-seqs") + 1])
    # Enough templates for the calibration and for 3x everywhere (Poisson counts vary).
    most = math.ceil(3 * (options.unit_rps or 50.0) * preset.load_s * 1.3) + 4 * slots + 64
    pool = templates(preset, words, vocab, most, options.seed, options.data_dir, options.trace_file)
    previous = [json.loads(path.read_text()) for path in options.merge]
    # A calibration alone (no arms) serves any seed: it measured the sites, not a workload.
    seeds = {int(p.get("seed", 0)) for p in previous if p.get("arms")} | {options.seed}
    if len(seeds) > 1:
        raise SystemExit(f"the merged results were run with other seeds: {sorted(seeds)}")
    calibration = next((p["calibration"] for p in previous if p.get("calibration")), None)
    unit = options.unit_rps
    if unit is None:
        calibration = calibrate(options, model_dir, pool, slots)
        unit = preset.unit_share * calibration["capacity_rps"]
        if unit * 3 * preset.load_s * 1.3 > len(pool):
            pool = templates(preset, words, vocab, math.ceil(unit * 3 * preset.load_s * 1.3) + 64,
                             options.seed, options.data_dir, options.trace_file)  # fmt: skip
    requests = timed(pool, arrival_times(preset.phases, unit, options.seed))
    log(f"unit rate {unit:.3f} req/s: {len(requests)} requests")
    arms: dict[str, Any] = {name: arm for p in previous for name, arm in p["arms"].items()}
    payload: dict[str, Any] = {
        "preset": preset.name,
        "unit_rps": round(unit, 4),
        "calibration": calibration,
        "phases": [asdict(p) for p in preset.phases],
        "drain_s": preset.drain_s,
        "slo": {"ttft_s": preset.ttft_slo_s, "tpot_s": preset.tpot_slo_s},
        "scaling_rule": dict(preset.rule),
        "workload": describe(requests),
        "predictor": str(options.predictor_dir) if options.predictor_dir else None,
        "seed": options.seed,
    }
    commands = list(dict.fromkeys([*(c for p in previous for c in p.get("commands", [])), command]))
    for name in () if options.no_arms else options.arms:
        arms[name] = run_arm(name, options, model_dir, requests)
        write(options.out_dir, options.name, {**payload, "arms": arms, "commands": commands})
    path = write(options.out_dir, options.name, {**payload, "arms": arms, "commands": commands})
    log(f"wrote {path}")
    return 0
