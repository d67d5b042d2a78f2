"""Real against simulated, per arm and metric: the relative error, the goals (goodput within 15%,
TTFT p50 within 25%: `goodput_error` and `ttft_p50_error` per arm, issue 78's keys), and whether
the arms rank the same by goodput (`same_ranking`). Beside them, what explains a miss: per site
the requests routing placed first and those it completed, each site's mean step time, and the
gateway's CPU and chunks.

A pair of arms whose goodputs differ by less than TIE (relative) counts as tied on that side: one
run per arm cannot order them. `rank_agrees`: every pair ordered the same way, or tied, on both
sides; `rank_contradicted`: some pair ordered one way real and the other way simulated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

from bench.common import markdown_table

COMPARED = ("goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
GOALS = {"goodput_rps": 0.15, "ttft_p50_s": 0.25}
TIE = 0.025


def relative_error(real: object, sim: object) -> float | None:
    """|sim - real| / real; 0 when both are 0; None when it is undefined (real 0 or missing)."""
    if not isinstance(real, int | float) or not isinstance(sim, int | float):
        return None
    if not (math.isfinite(real) and math.isfinite(sim)):
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return abs(sim - real) / abs(real)


def order(a: float, b: float) -> int:
    """1: a above b, -1: below, 0: tied (within TIE of the larger)."""
    top = max(abs(a), abs(b))
    if top == 0 or abs(a - b) <= TIE * top:
        return 0
    return 1 if a > b else -1


def ranking(real: Mapping[str, float], sim: Mapping[str, float]) -> dict[str, Any]:
    orders = [
        (a, b, order(real[a], real[b]), order(sim[a], sim[b]))
        for a, b in combinations(sorted(real), 2)
    ]
    pairs = [{"arms": [a, b], "real": r, "sim": s} for a, b, r, s in orders]
    return {
        "real_order": sorted(real, key=lambda arm: -real[arm]),
        "sim_order": sorted(sim, key=lambda arm: -sim[arm]),
        "pairs": pairs,
        "rank_agrees": all(r == s for _, _, r, s in orders),
        "rank_contradicted": any(r * s < 0 for _, _, r, s in orders),
        "tie_tolerance": TIE,
    }


def compare(
    real: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    arms = [arm for arm in real if arm in sim]
    errors = {
        arm: {key: relative_error(real[arm][key], sim[arm][key]) for key in COMPARED}
        for arm in arms
    }
    goals = {
        arm: {
            key: (errors[arm][key] is not None and float(errors[arm][key] or 0.0) <= bound)
            for key, bound in GOALS.items()
        }
        for arm in arms
    }
    goodput = {arm: float(real[arm]["goodput_rps"]) for arm in arms}
    sim_goodput = {arm: float(sim[arm]["goodput_rps"]) for arm in arms}
    ranked = ranking(goodput, sim_goodput)
    return {
        "errors": errors,
        "goodput_error": {arm: errors[arm]["goodput_rps"] for arm in arms},
        "ttft_p50_error": {arm: errors[arm]["ttft_p50_s"] for arm in arms},
        "same_ranking": ranked["rank_agrees"],
        "goals": {"bounds": GOALS, "met": goals},
        "all_goals_met": all(all(g.values()) for g in goals.values()),
        "ranking_by_goodput": ranked,
        "by_site": {
            arm: {
                side: {key: figures[arm].get(key) for key in ("by_site", "placed_first")}
                for side, figures in (("real", real), ("sim", sim))
            }
            for arm in arms
        },
    }


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "inf"
        return f"{value:.4g}"
    return str(value)


def _site_rows(
    real: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Mapping[str, Any]]
) -> tuple[list[list[str]], list[list[str]]]:
    """Per arm and site: completed and placed first, real and simulated; mean step times."""
    placed, steps = [], []
    for arm in real:
        r, s = real[arm], sim.get(arm, {})
        names = sorted(set(r.get("by_site") or {}) | set(s.get("by_site") or {}) - {"-"})
        for name in names:
            placed.append(
                [arm, name] + [_cell((f.get(key) or {}).get(name)) for key in
                               ("by_site", "placed_first") for f in (r, s)]
            )  # fmt: skip
            real_site = (r.get("sites") or {}).get(name) or {}
            sim_site = (s.get("sites") or {}).get(name) or {}
            mean = [real_site.get("step_s_mean"), sim_site.get("step_s_mean")]
            if mean[0] is not None:  # the twin's step holds the loop's time outside it (arms.py)
                mean[0] += real_site.get("step_overhead_s") or 0.0
            steps.append(
                [arm, name, *(_cell(None if m is None else 1000 * m) for m in mean),
                 _cell(relative_error(mean[0], mean[1])), _cell(real_site.get("steps")),
                 _cell(sim_site.get("steps"))]
            )  # fmt: skip
    return placed, steps


def _gateway_rows(
    real: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Mapping[str, Any]]
) -> list[list[str]]:
    return [
        [arm, _cell((real[arm].get("cpu_s") or {}).get("gateway")),
         _cell(sim.get(arm, {}).get("gateway_cpu_s")), _cell(real[arm].get("chunks")),
         _cell(sim.get(arm, {}).get("chunks")), _cell(sim.get(arm, {}).get("gateway_chunks")),
         _cell(real[arm].get("refused")),
         _cell(sim.get(arm, {}).get("refused")), _cell(real[arm].get("offloads")),
         _cell(sim.get(arm, {}).get("offloads"))]
        for arm in real
    ]  # fmt: skip


_GATEWAY_HEADER = ["arm", "gateway CPU s real", "sim", "chunks real", "sim", "streamed sim",
                   "refused real", "sim", "offloads real", "sim"]  # fmt: skip


def _explaining(
    real: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """The tables that explain a miss: per site, the gateway."""
    placed, steps = _site_rows(real, sim)
    return [
        "Requests per site: completed (by the site that ended them, after any offload; real: "
        "the gateway's counters) and placed first by routing.",
        "",
        markdown_table(["arm", "site", "completed real", "sim", "placed first real", "sim"],
                       placed),
        "",
        markdown_table(["arm", "site", "mean step ms real (+ loop)", "sim", "error", "steps real",
                        "sim"],
                       steps),
        "",
        "The gateway: CPU seconds over the cell (real: its process; simulated: its loop's "
        "modelled work), chunks with text the clients got (as they count them; simulated: "
        "SiteSpec.text_share) and, simulated, every chunk the gateway streamed, requests "
        "refused, offloads.",
        "",
        markdown_table(_GATEWAY_HEADER, _gateway_rows(real, sim)),
        "",
    ]  # fmt: skip


def markdown(
    real: Mapping[str, Mapping[str, Any]],
    sim: Mapping[str, Mapping[str, Any]],
    result: Mapping[str, Any],
    notes: Sequence[str],
) -> str:
    rows = []
    for arm, errors in result["errors"].items():
        for key in COMPARED:
            goal = GOALS.get(key)
            met = result["goals"]["met"][arm].get(key) if goal is not None else None
            rows.append(
                [arm, key, _cell(real[arm][key]), _cell(sim[arm][key]), _cell(errors[key]),
                 f"<= {goal:g}: {_cell(met)}" if goal is not None else ""]
            )  # fmt: skip
    extra = [
        [arm, _cell(real[arm]["prefix_hit_share"]), _cell(sim[arm]["prefix_hit_share"]),
         _cell(real[arm]["slo_p99_met"]), _cell(sim[arm]["slo_p99_met"])]
        for arm in result["errors"]
    ]  # fmt: skip
    rank = result["ranking_by_goodput"]
    lines = [
        "## Real against simulated",
        "",
        markdown_table(["arm", "metric", "real", "simulated", "error", "goal"], rows),
        "",
        f"- All goals met: **{_cell(result['all_goals_met'])}**.",
        f"- Arms by goodput, real: {', '.join(rank['real_order'])}; simulated: "
        f"{', '.join(rank['sim_order'])}. `same_ranking` (ties within {TIE:.1%}): "
        f"**{_cell(rank['rank_agrees'])}**; contradicted: {_cell(rank['rank_contradicted'])}.",
        "",
        markdown_table(["arm", "prefix hits real", "sim", "p99 SLO met real", "sim"], extra),
        "",
        *_explaining(real, sim),
        *(f"- {note}" for note in notes),
    ]
    return "\n".join(lines)
