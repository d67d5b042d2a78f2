"""Command-line options of `python -m bench.federation`, validated into one frozen value."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import results_dir
from bench.federation.cluster import ARMS, DEFAULT_ARMS, PREFIX_ARMS
from bench.federation.lora_workload import CPU_RUNS, GPU_RUNS, LoraRuns
from bench.federation.topology import PRESETS, PrefixRuns, Preset

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_PREDICTOR = REPO_ROOT / "var" / "predictor" / "smollm2-135m-instruct"
PHASES = ("sweep", "scenarios", "decision")
# `longprompt`: issue 21's long-prompt mix with its arms, a fixed grid of rates and the offload
# scenarios; the others (issue 34): prompts sent as text, the prefix arms, the knee bisected.
WORKLOADS = ("longprompt", "sharegpt", "trace", "shared_prefix", "text", "lora")
# `text` (the predictor's share): no predictor, the base one, the one adapted from served traffic
# and the true lengths, all with completion_cost; least_requests and mico beside them.
TEXT_ARMS = (
    "least_requests",
    "mico",
    "completion_cost_guess",
    "completion_cost",
    "completion_cost_adapted",
    "completion_cost_oracle",
)
# `lora` (issue 51): adapter-aware completion_cost against the adapter-blind least_requests and
# mico (bench/federation/lora_suite.py).
LORA_ARMS = ("least_requests", "mico", "completion_cost")
ADAPT_SAMPLES = 600  # train-split requests served before the text workload's sweep
SHARED = REPO_ROOT.parent / "shared" / "datasets" / "traces"
DEFAULT_SGLANG_ROUTER = REPO_ROOT / "var" / "sglang-router"


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
    workload: str = "longprompt"
    prefix: PrefixRuns | None = None
    trace_file: Path = SHARED / "mooncake_fast25_synthetic_trace.jsonl"
    mt_bench_file: Path = SHARED / "mt_bench_question.jsonl"
    # Where the sglang-router wheel is installed (`pip install --target`); None: not found, the
    # arm is left out and the report says so.
    sglang_router: Path | None = None
    # The `text` workload's adaptation (adapt.py): train-split requests served before the sweep
    # and the retrain's mode; only when an arm serves the adapted predictor.
    adapt_samples: int = ADAPT_SAMPLES
    adapt_mode: str = "retrain"
    # The `lora` workload's runs (bench/federation/lora_workload.py); None for the others.
    lora: LoraRuns | None = None

    @property
    def adapts(self) -> bool:
        return any(ARMS[name].source == "adapted" for name in self.arms)

    @property
    def reuse(self) -> bool:
        """The issue-34 workloads (text prompts, prefix arms, bisected knee)."""
        return self.workload != "longprompt"

    def __post_init__(self) -> None:
        if "least_requests" not in self.arms and "sweep" in self.phases:
            raise ValueError("the sweep compares against least_requests: keep it in --arms")
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")
        if self.adapts and (self.workload != "text" or self.predictor_dir is None):
            raise ValueError(
                "completion_cost_adapted adapts the base predictor (--predictor-dir) from the "
                "text workload's train split: it needs --workload text and a predictor"
            )
        if self.adapts and self.adapt_samples < 100:
            raise ValueError(f"--adapt-samples must be >= 100, got {self.adapt_samples}")


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
    parser.add_argument("--out-dir", type=Path, default=results_dir("federation"))
    parser.add_argument("--name", help="result file name (default federation_<preset>)")
    parser.add_argument("--decisions", type=int, default=20_000, help="timed routing decisions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=WORKLOADS, default="longprompt")
    parser.add_argument("--bisections", type=int, help="rates bisected per arm at its knee")
    parser.add_argument(
        "--trace-file", type=Path, default=SHARED / "mooncake_fast25_synthetic_trace.jsonl"
    )
    parser.add_argument("--mt-bench-file", type=Path, default=SHARED / "mt_bench_question.jsonl")
    parser.add_argument(
        "--adapt-samples",
        type=int,
        default=ADAPT_SAMPLES,
        help="text workload: train-split requests served before the sweep, to adapt from",
    )
    parser.add_argument("--adapt-mode", choices=("retrain", "calibrate"), default="retrain")
    parser.add_argument("--lora-adapters", type=int, help="lora workload: adapters (preset's)")
    parser.add_argument("--lora-slots", type=int, help="lora workload: device slots a site")
    parser.add_argument(
        "--sglang-router",
        type=Path,
        help="the sglang-router wheel installed with pip --target (default var/sglang-router; "
        "on the GPU machine it is importable from PYTHONPATH)",
    )
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
    prefix = _prefix_runs(args, preset)
    tokenizer = args.tokenizer_dir or default_tokenizer()
    if tokenizer is None:
        parser.error("no SmolLM2 tokenizer in var/models: pass --tokenizer-dir")
    predictor = None
    if not args.no_predictor and (args.predictor_dir / "manifest.json").is_file():
        predictor = args.predictor_dir.resolve()
    reuse = args.workload != "longprompt"
    arms = tuple(args.arms or _default_arms(args.workload, bool(args.quick)))
    router = _sglang_router(args.sglang_router)
    if router is None and not args.arms:
        arms = tuple(arm for arm in arms if ARMS[arm].router != "sglang")
    phases = frozenset(args.only or (("sweep", "decision") if args.quick or reuse else PHASES))
    return Options(
        preset=preset,
        arms=arms,
        phases=phases,
        tokenizer_dir=tokenizer.resolve(),
        data_dir=args.data_dir,
        predictor_dir=predictor,
        work_dir=args.work_dir.resolve(),
        out_dir=args.out_dir,
        name=args.name or _name(preset.name, args.workload, bool(args.quick)),
        seed=args.seed,
        quick=bool(args.quick),
        decisions=2_000 if args.quick else args.decisions,
        workload=args.workload,
        prefix=prefix,
        trace_file=args.trace_file,
        mt_bench_file=args.mt_bench_file,
        sglang_router=router,
        adapt_samples=args.adapt_samples,
        adapt_mode=args.adapt_mode,
        lora=_lora_runs(args, preset.name) if args.workload == "lora" else None,
    )


def _default_arms(workload: str, quick: bool) -> tuple[str, ...]:
    """The workload's arms; --quick: a smoke test's few."""
    quick_arms: tuple[str, ...]
    arms: tuple[str, ...]
    if workload == "lora":
        return LORA_ARMS
    if workload == "text":
        quick_arms, arms = ("completion_cost", "completion_cost_adapted"), TEXT_ARMS
    elif workload != "longprompt":
        quick_arms, arms = ("prefix_affinity", "completion_cost"), PREFIX_ARMS
    else:
        quick_arms, arms = ("least_latency",), DEFAULT_ARMS
    return ("least_requests", *quick_arms) if quick else arms


def _name(preset: str, workload: str, quick: bool) -> str:
    base = "federation" if workload == "longprompt" else f"federation_{workload}"
    return f"{base}_{preset}{'_quick' if quick else ''}"


def _prefix_runs(args: argparse.Namespace, preset: Preset) -> PrefixRuns | None:
    """The preset's prefix runs, as the command line changes them (--quick: one short rate)."""
    runs = preset.prefix
    if runs is None or args.workload in ("longprompt", "lora"):
        return runs
    rates = runs.rates[args.workload]
    if args.quick:
        runs = replace(runs, duration_s=6.0, drain_s=20.0, bisections=0)
        rates = rates[:1]
    return replace(
        runs,
        rates={**runs.rates, args.workload: tuple(args.rates or rates)},
        duration_s=args.duration_s or runs.duration_s,
        drain_s=args.drain_s if args.drain_s is not None else runs.drain_s,
        bisections=runs.bisections if args.bisections is None else args.bisections,
    )


def _lora_runs(args: argparse.Namespace, preset: str) -> LoraRuns:
    """The preset's lora runs as the command line changes them (--quick: one short rate)."""
    runs = CPU_RUNS if preset == "cpu" else GPU_RUNS
    if args.quick:
        runs = replace(runs, rates=runs.rates[:1], duration_s=6.0, drain_s=20.0)
    slots = args.lora_slots or runs.slots
    return replace(
        runs,
        adapters=args.lora_adapters or runs.adapters,
        slots=slots,
        cpu_loras=max(runs.cpu_loras, slots),
        rates=tuple(args.rates or runs.rates),
        duration_s=args.duration_s or runs.duration_s,
        drain_s=args.drain_s if args.drain_s is not None else runs.drain_s,
    )


def _sglang_router(path: Path | None) -> Path | None:
    """Where sglang_router imports from: the given folder, var/sglang-router, or already on
    PYTHONPATH (the GPU machine's wheels); None when nowhere."""
    for folder in (path, DEFAULT_SGLANG_ROUTER):
        if folder is not None and (folder / "sglang_router" / "router.py").is_file():
            return folder.resolve()
    found = importlib.util.find_spec("sglang_router")
    if found is not None and found.origin is not None:
        return Path(found.origin).resolve().parent.parent
    return None
