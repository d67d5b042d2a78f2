"""The elastic benchmark's figures and files: NAME.json (every arm, the keys), NAME.md (the
tables and the autoscaled arm's scaling events) and NAME.png (load, sites and TTFT over time).

- `slo_attainment` of an arm: the share of its requests whose own TTFT and TPOT met the SLO (a
  request cut off at the drain's end while streaming is judged on what it streamed, one that
  failed or never streamed misses; bench/loadgen/client.py).
- `site_seconds` (GPU-seconds): its site processes' lifetimes within the run (first arrival to
  the last answer or the cut), sampled from /proc: a site starting or draining is paid for.
- `lost`: requests that got an error (the drain's cut is not an error: the benchmark hung up).
- Keys (the autoscaled arm against static 2 sites): `slo_attainment_vs_static2` (goal >= 0.95),
  `gpu_seconds_vs_static2` (goal <= 0.7), `lost_requests` (goal 0), `scale_out_to_serving_s`
  (the first scale-out decision to the new site serving, its start with CUDA graphs included;
  goal <= 60 s).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import markdown_table
from bench.elastic.presets import ElasticPreset
from bench.elastic.timeline import Timeline
from bench.loadgen.client import CUT_OFF, Outcome, RunOutcomes, percentile

GOALS = {
    "slo_attainment_vs_static2": (">=", 0.95),
    "gpu_seconds_vs_static2": ("<=", 0.7),
    "lost_requests": ("<=", 0),
    "scale_out_to_serving_s": ("<=", 60.0),
}
BUCKET_S = 10.0


def _meets(outcome: Outcome, preset: ElasticPreset) -> bool:
    tpot = outcome.tpot_s
    return (
        (outcome.ok or outcome.cut_off_streaming)
        and outcome.ttft_s is not None
        and outcome.ttft_s <= preset.ttft_slo_s
        and tpot is not None
        and tpot <= preset.tpot_slo_s
    )


def _num(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def _phase_of(at_s: float, preset: ElasticPreset) -> int:
    end = 0.0
    for i, phase in enumerate(preset.phases):
        end += phase.seconds
        if at_s < end:
            return i
    return len(preset.phases) - 1


def arm_result(
    name: str,
    preset: ElasticPreset,
    run: RunOutcomes,
    timeline: Timeline,
    events: Sequence[Mapping[str, Any]],
    started_wall: float,
    elastic_site: str,
) -> dict[str, Any]:
    outcomes = run.outcomes
    lost = [o for o in outcomes if not o.ok and not o.cut_off_streaming and o.error != CUT_OFF]
    ttfts = [o.ttft_s if o.ttft_s is not None else math.inf for o in outcomes]
    phases = []
    for i, phase in enumerate(preset.phases):
        mine = [o for o in outcomes if _phase_of(o.sent_s, preset) == i]
        phases.append({
            "multiple": phase.multiple,
            "requests": len(mine),
            "slo_attainment": round(sum(_meets(o, preset) for o in mine) / max(len(mine), 1), 4),
            "ttft_p90_s": _num(percentile([t or math.inf for t in (o.ttft_s for o in mine)], 0.9)),
        })  # fmt: skip
    served: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.ok and outcome.site:
            served[outcome.site] = served.get(outcome.site, 0) + 1
    result: dict[str, Any] = {
        "arm": name,
        "requests": len(outcomes),
        "completed": sum(o.ok for o in outcomes),
        "cut_off_at_drain": sum(o.error == CUT_OFF for o in outcomes),
        "lost": len(lost),
        "lost_errors": [o.error for o in lost[:5]],
        "slo_attainment": round(sum(_meets(o, preset) for o in outcomes) / max(len(outcomes), 1),
                                4),
        "ttft_s": {"p50": _num(percentile(ttfts, 0.5)), "p90": _num(percentile(ttfts, 0.9)),
                   "p99": _num(percentile(ttfts, 0.99))},
        "wall_s": round(run.wall_s, 2),
        "site_seconds": round(timeline.site_seconds(run.wall_s), 1),
        "phases": phases,
        "requests_per_site": dict(sorted(served.items())),
        "timeline": [[s.t, s.alive, s.healthy, s.desired, s.backlog_s] for s in timeline.samples],
        "ttft_by_sent_s": [[round(o.sent_s, 2), _num(o.ttft_s) if o.ttft_s is not None else None]
                           for o in outcomes],
        "scaling_events": [{**e, "t": round(e["at"] - started_wall, 2)} for e in events],
    }  # fmt: skip
    outs = [e for e in events if e["action"] == "scale_out"]
    joins = [e for e in events if e["action"] == "join" and e["site"] == elastic_site]
    if outs and joins:
        result["scale_out_to_serving_s"] = round(joins[0]["at"] - outs[0]["at"], 2)
        firsts = [started_wall + o.sent_s + o.ttft_s for o in outcomes
                  if o.site == elastic_site and o.ttft_s is not None]  # fmt: skip
        if firsts:
            result["scale_out_to_first_token_s"] = round(min(firsts) - outs[0]["at"], 2)
    return result


def keys(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    auto, static2 = arms.get("autoscaled"), arms.get("static2")
    found: dict[str, Any] = {
        "slo_attainment_vs_static2": None,
        "gpu_seconds_vs_static2": None,
        "lost_requests": auto["lost"] if auto else None,
        "scale_out_to_serving_s": auto.get("scale_out_to_serving_s") if auto else None,
    }
    if auto and static2:
        if static2["slo_attainment"] > 0:
            found["slo_attainment_vs_static2"] = round(
                auto["slo_attainment"] / static2["slo_attainment"], 3
            )
        if static2["site_seconds"] > 0:
            found["gpu_seconds_vs_static2"] = round(
                auto["site_seconds"] / static2["site_seconds"], 3
            )
    return found


def goals_met(found: Mapping[str, Any]) -> dict[str, bool | None]:
    met: dict[str, bool | None] = {}
    for key, (how, goal) in GOALS.items():
        value = found.get(key)
        met[key] = None if value is None else (value >= goal if how == ">=" else value <= goal)
    return met


def write(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    found = keys(payload["arms"])
    payload = {**payload, **found, "goals_met": goals_met(found),
               "written_at": datetime.now(UTC).isoformat(timespec="seconds")}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(payload))
    plot(payload, out_dir / f"{name}.png")
    return path


def markdown(payload: Mapping[str, Any]) -> str:
    arms = payload["arms"]
    rows = [
        [name, a["requests"], a["completed"], a["lost"], a["cut_off_at_drain"],
         a["slo_attainment"], *(p["slo_attainment"] for p in a["phases"]),
         a["ttft_s"]["p50"], a["ttft_s"]["p99"], a["site_seconds"]]
        for name, a in arms.items()
    ]  # fmt: skip
    phases = " -> ".join(f"{p['multiple']:g}x {p['seconds']:g}s" for p in payload["phases"])
    header = ["arm", "requests", "ok", "lost", "cut at drain", "SLO attained",
              *(f"SLO {p['multiple']:g}x #{i + 1}" for i, p in enumerate(payload["phases"])),
              "TTFT p50 s", "TTFT p99 s", "site-seconds"]  # fmt: skip
    lines = [
        f"# Elastic capacity: preset {payload['preset']}",
        "",
        *(f"`{command}`" for command in payload.get("commands", [])),
        "",
        f"Load {phases} (1x = {payload['unit_rps']} req/s), drain {payload['drain_s']:g}s; SLO "
        f"TTFT <= {payload['slo']['ttft_s']}s and TPOT <= {payload['slo']['tpot_s']}s per request.",
        "",
        "## Keys (autoscaled against static 2 sites)",
        "",
        markdown_table(["key", "value", "goal", "met"], [
            [key, payload.get(key), f"{how} {goal}", payload["goals_met"].get(key)]
            for key, (how, goal) in GOALS.items()
        ]),
        "",
        "## Arms",
        "",
        markdown_table(header, rows),
        "",
    ]  # fmt: skip
    auto = arms.get("autoscaled")
    if auto:
        lines += ["## The autoscaled arm's scaling events", ""]
        lines += [markdown_table(
            ["t s", "action", "site", "actor", "serving", "desired", "reason"],
            [[e["t"], e["action"], e["site"] or "", e["actor"], e["serving"], e["desired"],
              e["reason"]] for e in auto["scaling_events"]],
        ), ""]  # fmt: skip
    return "\n".join(lines)


def plot(payload: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (load, sites, ttft) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t, rate = 0.0, []
    for phase in payload["phases"]:
        rate += [(t, phase["multiple"] * payload["unit_rps"]),
                 (t + phase["seconds"], phase["multiple"] * payload["unit_rps"])]  # fmt: skip
        t += phase["seconds"]
    load.plot(*zip(*rate, strict=True), color="black")
    load.set_ylabel("offered req/s")
    load.set_title(f"Elastic capacity, preset {payload['preset']}")
    for name, arm in payload["arms"].items():
        timeline = arm["timeline"]
        if timeline:
            sites.step([s[0] for s in timeline], [s[1] for s in timeline], where="post",
                       label=f"{name} ({arm['site_seconds']:.0f} site-s)")  # fmt: skip
        buckets: dict[int, list[float]] = {}
        for sent, value in arm["ttft_by_sent_s"]:
            buckets.setdefault(int(sent // BUCKET_S), []).append(
                value if value is not None else math.inf
            )
        xs = sorted(buckets)
        ys = [min(percentile(buckets[x], 0.9), 60.0) for x in xs]
        ttft.plot([(x + 0.5) * BUCKET_S for x in xs], ys, marker=".", label=name)
    sites.set_ylabel("site processes")
    sites.legend(loc="upper left", fontsize=8)
    ttft.axhline(payload["slo"]["ttft_s"], color="grey", linestyle=":", label="TTFT SLO")
    ttft.set_ylabel(f"TTFT p90 per {BUCKET_S:g}s (s)")
    ttft.set_yscale("log")
    ttft.set_xlabel("seconds since the first arrival")
    ttft.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
