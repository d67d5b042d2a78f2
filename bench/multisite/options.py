"""Command-line options of `python -m bench.multisite`, validated into one frozen value."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import results_dir

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_PREDICTOR = REPO_ROOT / "var" / "predictor" / "default"
PHASES = ("table1", "ablation", "scenarios", "decision", "bad_input")


def grid_cells(
    site_counts: tuple[int, ...], max_batches: tuple[int, ...], shape: str, center: tuple[int, int]
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(max batch, site counts) pairs. "full": every combination; "cross": every site count at
    the center batch size, every batch size at the center site count (the center must be in
    the lists)."""
    if shape == "full":
        return tuple((batch, site_counts) for batch in max_batches)
    sites, batch = center
    if sites not in site_counts or batch not in max_batches:
        raise ValueError(f"the grid's center {center} must be one of the listed values")
    return tuple((b, site_counts if b == batch else (sites,)) for b in max_batches)


@dataclass(frozen=True, slots=True)
class Options:
    grid: tuple[tuple[int, tuple[int, ...]], ...]  # (max batch, site counts at it)
    queries: int
    scenario_queries: int
    scenario_max_batch: int
    ablation_sites: int
    ablation_max_batch: int
    phases: frozenset[str]
    answer_cap: int | None
    decisions: int
    seed: int
    data_dir: Path | None
    tokenizer_dir: Path
    predictor_dir: Path | None  # None: the gateways run without a predictor
    work_dir: Path
    out_dir: Path
    name: str
    quick: bool
    hold: bool = True

    def __post_init__(self) -> None:
        if not self.grid or min(min(c) for _, c in self.grid) < 1:
            raise ValueError("--sites needs at least one count >= 1")
        if min(b for b, _ in self.grid) < 1:
            raise ValueError("--max-batch needs at least one size >= 1")
        if min(self.queries, self.scenario_queries) < 1:
            raise ValueError("--queries and --scenario-queries must be >= 1")
        if "ablation" in self.phases and self.ablation_sites not in dict(self.grid).get(
            self.ablation_max_batch, ()
        ):
            raise ValueError("the ablation cell (--ablation SITES BATCH) must be in the grid")
        if "ablation" in self.phases and "table1" not in self.phases:
            raise ValueError("the ablation runs inside the table1 phase: keep table1")


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.multisite",
        description="MICO's Table 1 and more on real site engines behind the real gateway.",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny grid (smoke test)")
    parser.add_argument("--sites", type=int, nargs="+", help="site counts (default 2 3 6 9)")
    parser.add_argument("--max-batch", type=int, nargs="+", help="max batch sizes (2 6 10)")
    parser.add_argument(
        "--grid",
        choices=("cross", "full"),
        default="cross",
        help="cross (default): all site counts at max batch 6, all batch sizes at 3 sites; "
        "full: every combination (about three times longer)",
    )
    parser.add_argument("--queries", type=int, help="queries per Table 1 run (default 200)")
    parser.add_argument("--scenario-queries", type=int, help="queries per scenario run (200)")
    parser.add_argument("--scenario-max-batch", type=int, help="max batch in scenarios (6)")
    parser.add_argument(
        "--ablation", type=int, nargs=2, metavar=("SITES", "BATCH"), help="ablation cell (3 6)"
    )
    parser.add_argument("--only", nargs="+", choices=PHASES, help="run only these phases")
    parser.add_argument("--answer-cap", type=int, help="cut replayed answers (quick: 24)")
    parser.add_argument("--decisions", type=int, help="timed routing decisions per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, help="datasets (default ../shared/datasets)")
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument(
        "--predictor-dir",
        type=Path,
        default=DEFAULT_PREDICTOR,
        help="length-predictor artifact (make predictor-default); used when it exists",
    )
    parser.add_argument("--no-predictor", action="store_true", help="run the gateways without")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "var" / "bench-multisite")
    parser.add_argument(
        "--out-dir", type=Path, default=results_dir("multisite"), help="where results go"
    )
    parser.add_argument("--name", help="result file name (multisite; quick: multisite_quick)")
    parser.add_argument(
        "--no-hold",
        action="store_true",
        help="start each run with the first arrival instead of with every query queued",
    )
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    predictor = None
    if not args.no_predictor and (args.predictor_dir / "manifest.json").is_file():
        predictor = args.predictor_dir.resolve()
    phases = set(args.only or PHASES)
    if quick and not args.only:
        phases -= {"scenarios", "ablation"}
    ablation = tuple(args.ablation or ((2, 4) if quick else (3, 6)))
    site_counts = tuple(sorted(set(args.sites or ((2,) if quick else (2, 3, 6, 9)))))
    max_batches = tuple(sorted(set(args.max_batch or ((4,) if quick else (2, 6, 10)))))
    shape = "full" if quick or args.sites or args.max_batch else args.grid
    return Options(
        grid=grid_cells(site_counts, max_batches, shape, (ablation[0], ablation[1])),
        queries=args.queries or (16 if quick else 200),
        scenario_queries=args.scenario_queries or (16 if quick else 200),
        scenario_max_batch=args.scenario_max_batch or (4 if quick else 6),
        ablation_sites=ablation[0],
        ablation_max_batch=ablation[1],
        phases=frozenset(phases),
        answer_cap=args.answer_cap or (24 if quick else None),
        decisions=args.decisions or (2_000 if quick else 20_000),
        seed=args.seed,
        data_dir=args.data_dir,
        tokenizer_dir=args.tokenizer_dir,
        predictor_dir=predictor,
        work_dir=args.work_dir.resolve(),
        out_dir=args.out_dir,
        name=args.name or ("multisite_quick" if quick else "multisite"),
        quick=quick,
        hold=not args.no_hold,
    )
