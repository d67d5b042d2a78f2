"""The cells of one invocation (issue 78): every seed at every offered load, a load being a
multiple of the capacity measured before the arms (or one rate given outright), each cell run
by every arm on the same requests and written to a results file of its own.

A cell's requests carry a marker of their own per arm ("ARM/s11_x0.7"): one arm's gateway runs
every cell, and two cells of a seed share prompts (the same seed draws the same first prompts at
any rate), so without it a later cell would find an earlier one's prompts in the sites' caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import markdown_table
from bench.federation_real.compare import order


@dataclass(frozen=True, slots=True)
class Cell:
    seed: int
    rate_rps: float
    load: float | None = None  # x the measured capacity; None: the rate was given

    @property
    def label(self) -> str:
        return f"s{self.seed}" + ("" if self.load is None else f"_x{self.load:g}")

    def marker(self, arm: str) -> str:
        """What each of the cell's prompts starts with under `arm` (workload.marked)."""
        return f"{arm}/{self.label}"


def parse_list(text: str | None, kind: type[float] | type[int]) -> tuple[float, ...]:
    """A comma-separated list ("0.7,1.1"); empty for None."""
    if not text:
        return ()
    return tuple(kind(part) for part in text.split(",") if part.strip())


def cells(
    seeds: Sequence[int], loads: Sequence[float], capacity_rps: float | None, rate: float | None
) -> list[Cell]:
    """Seed by seed, each at every load (x `capacity_rps`), or at `rate` when loads are none."""
    if loads:
        if capacity_rps is None or capacity_rps <= 0:
            raise ValueError(f"loads {list(loads)} need a measured capacity, got {capacity_rps}")
        return [Cell(s, load * capacity_rps, load) for s in seeds for load in loads]
    if rate is None or rate <= 0:
        raise ValueError("no loads and no rate: give --rate or --loads")
    return [Cell(s, rate) for s in seeds]


def cell_name(base: str, cell: Cell, gridded: bool) -> str:
    """`base`, with the cell's label when the invocation runs more than one kind of cell."""
    return f"{base}_{cell.label}" if gridded else base


def _winner(arms: Mapping[str, Mapping[str, Any]], key: str, best: str) -> str:
    """The best arm by `key`, or those tied with it (within compare.TIE: one run per arm cannot
    order them) joined by " = "."""
    values = {arm: float(figures[key]) for arm, figures in arms.items()}
    if not values:
        return "-"
    sign = 1 if best == "max" else -1
    top = max(values, key=lambda arm: sign * values[arm])
    tied = [arm for arm in sorted(values) if order(values[arm], values[top]) == 0]
    return " = ".join(tied)


def winners(result: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """A comparison's winning arm, real and simulated: by goodput (the issue's rule at 1.1x)
    and by TTFT p99 (at 0.7x)."""
    real, sim = result["real_run"]["arms"], result["simulated"]
    return {
        "goodput": {"real": _winner(real, "goodput_rps", "max"),
                    "sim": _winner(sim, "goodput_rps", "max")},
        "ttft_p99": {"real": _winner(real, "ttft_p99_s", "min"),
                     "sim": _winner(sim, "ttft_p99_s", "min")},
    }  # fmt: skip


def _error(errors: Mapping[str, float | None], arm: str) -> str:
    value = errors.get(arm)
    return "-" if value is None else f"{value:.3f}"


def grid_markdown(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per cell and arm of the comparisons (compare.py's payloads): the goals and the
    ranking, and per cell the arm that wins on goodput (the issue's rule at 1.1x) and on TTFT
    p99 (at 0.7x), real and simulated."""
    rows, best = [], []
    for result in results:
        real, sim = result["real_run"]["arms"], result["simulated"]
        cell = str(result["real_run"].get("cell", "-"))
        for arm in real:
            rows.append([
                cell, arm, f"{real[arm]['goodput_rps']:.1f}", f"{sim[arm]['goodput_rps']:.1f}",
                _error(result["goodput_error"], arm), _error(result["ttft_p50_error"], arm),
                f"{real[arm]['ttft_p99_s']:.3f}", f"{sim[arm]['ttft_p99_s']:.3f}",
            ])  # fmt: skip
        won = winners(result)
        best.append([
            cell, won["goodput"]["real"], won["goodput"]["sim"], won["ttft_p99"]["real"],
            won["ttft_p99"]["sim"], "yes" if result["same_ranking"] else "no",
            "yes" if result["all_goals_met"] else "no",
        ])  # fmt: skip
    return "\n".join([
        "## Every cell, real against simulated", "",
        markdown_table(["cell", "arm", "goodput real", "sim", "goodput_error", "ttft_p50_error",
                        "TTFT p99 real", "sim"], rows),
        "", "## Winners per cell", "",
        markdown_table(["cell", "goodput real", "sim", "TTFT p99 real", "sim", "same_ranking",
                        "all goals met"], best),
    ])  # fmt: skip
