"""Command-line options of `python -m bench.federation`, validated into one frozen value."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import RESULTS_DIR
from bench.federation.cluster import ARMS, DEFAULT_ARMS
from bench.federation.topology import PRESETS, Preset

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_PREDICTOR = REPO_ROOT / "var" / "predictor" / "smollm2-135m-instruct"
PHASES = ("sweep", "scenarios", "decision")


def default_tokenizer() -> Path | None:
    """SmolLM2's tokenizer, from the converted model the demo and tests cache in var/models."""
    found = sorted((REPO_ROOT / "var" / "models").glob("SmolLM2-135M-Instruct-*/tokenizer.json"))
    return found[0].parent if found else None


@dataclass(frozen=True, slots=True)
class Options:
    preset: Preset
    arms: tuple[str, ...]
    phases: frozenset[str]
    tokenizer_dir: Path
    data_dir: Path | None
    predictor_dir: Path | None
    work_dir: Path
    out_dir: Path
    name: str
    seed: int
    quick: bool
    decisions: int

    def __post_init__(self) -> None:
        if "least_requests" not in self.arms and "sweep" in self.phases:
            raise ValueError("the sweep compares against least_requests: keep it in --arms")
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.federation",
        description="Routing policies on unequal sites behind a wide-area network, open loop.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 short rate, 2 arms")
    parser.add_argument("--arms", nargs="+", help=f"arms to compare (default {DEFAULT_ARMS})")
    parser.add_argument("--only", nargs="+", choices=PHASES, help="run only these phases")
    parser.add_argument("--rates", type=float, nargs="+", help="requests/s swept (preset's)")
    parser.add_argument("--duration-s", type=float, help="arrival window per run (preset's)")
    parser.add_argument("--drain-s", type=float, help="after the last arrival (preset's)")
    parser.add_argument("--tokenizer-dir", type=Path, help="default: var/models/SmolLM2-*")
    parser.add_argument("--data-dir", type=Path, help="datasets (default ../shared/datasets)")
    parser.add_argument("--predictor-dir", type=Path, default=DEFAULT_PREDICTOR)
    parser.add_argument("--no-predictor", action="store_true", help="predictor arms run without")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "var" / "bench-federation")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", help="result file name (default federation_<preset>)")
    parser.add_argument("--decisions", type=int, default=20_000, help="timed routing decisions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.quick:
        preset = replace(preset, rates=(2.0,), duration_s=6.0, drain_s=20.0)
    preset = replace(
        preset,
        rates=tuple(args.rates or preset.rates),
        duration_s=args.duration_s or preset.duration_s,
        drain_s=args.drain_s if args.drain_s is not None else preset.drain_s,
    )
    tokenizer = args.tokenizer_dir or default_tokenizer()
    if tokenizer is None:
        parser.error("no SmolLM2 tokenizer in var/models: pass --tokenizer-dir")
    predictor = None
    if not args.no_predictor and (args.predictor_dir / "manifest.json").is_file():
        predictor = args.predictor_dir.resolve()
    quick_arms = ("least_requests", "least_latency")
    arms = tuple(args.arms or (quick_arms if args.quick else DEFAULT_ARMS))
    phases = frozenset(args.only or (("sweep", "decision") if args.quick else PHASES))
    return Options(
        preset=preset,
        arms=arms,
        phases=phases,
        tokenizer_dir=tokenizer.resolve(),
        data_dir=args.data_dir,
        predictor_dir=predictor,
        work_dir=args.work_dir.resolve(),
        out_dir=args.out_dir,
        name=args.name or f"federation_{preset.name}{'_quick' if args.quick else ''}",
        seed=args.seed,
        quick=bool(args.quick),
        decisions=2_000 if args.quick else args.decisions,
    )
