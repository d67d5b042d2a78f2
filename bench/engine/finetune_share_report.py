"""The decision and the Markdown of bench.engine.finetune_share_profile: which way of training
beside serving its numbers favour against issue 70's targets, and why.

Both approaches are projected onto the serving at `load` that part 1 measured, from one call's
numbers (one seed; part 2's arms two interleaved blocks each):
- spatial sharing (the training graph on a low-priority stream, part 2): the job keeps the
  graph's throughput beside decode steps over its throughput alone; a serving step slows by
  the `low` arm's decode step p50 / the alone p50 (TPOT's proxy; p99 over p99 for TTFT's), and
  the delay training adds to a step is the arm's p99 step less the alone p50. Part 2 decodes
  256 rows, more than a step at 0.6x carries, which leaves training less room than at 0.6x.
- training rows in the step (part 3): each serving step carries N training tokens, its forward
  costs the marginal time of N rows in a step of the rows a 0.6x step decodes, and their
  backward, run in pieces between steps, its measured time: both delay that step. The job gets
  N tokens a step; the largest N whose added time fits the budget (TPOT: 0.2 x the step; and
  10 ms) is taken.
The job's alone throughput is the best measured alone: the training graph of part 2 or the
largest forward + backward graph of part 3.
"""

from __future__ import annotations

from typing import Any

from bench.common import markdown_table

TARGETS = {"job_vs_alone": 0.4, "ttft_p99_ratio": 1.3, "tpot_p99_ratio": 1.2, "delay_ms": 10.0}


def _alone_rate(result: dict[str, Any]) -> float:
    rates: list[float] = [result["priority"]["training_alone"]["tokens_per_s"]]
    for entries in result["rows"]["by_decode_rows"].values():
        for entry in entries:
            if entry.get("training_forward_backward_ms"):
                rates.append(1000 * entry["train_tokens"] / entry["training_forward_backward_ms"])
    return max(rates)


def _spatial(result: dict[str, Any], alone: float) -> dict[str, Any]:
    arm = result["priority"]["decode_step_ms"]["low"]
    job = arm.get("training_tokens_per_s", 0.0) / alone
    out = {
        "job_vs_alone": job,
        "tpot_p99_ratio": arm["p50_vs_alone"],
        "ttft_p99_ratio": arm["p99_vs_alone"],
        "delay_ms": arm["p99_added_ms"],
        "max_delay_ms": arm["max_added_ms"],
    }
    return out | {"meets": _meets(out)}


def _in_step(result: dict[str, Any], alone: float, step_ms: float) -> dict[str, Any]:
    sizes = result["rows"]["by_decode_rows"]
    rows = min(sizes, key=int)  # the size nearest a 0.6x step (part 1's median decode rows)
    budget = min(TARGETS["delay_ms"], (TARGETS["tpot_p99_ratio"] - 1) * step_ms)
    options = []
    for entry in sizes[rows]:
        if not entry["train_tokens"]:
            continue
        added = entry["marginal_ms"] + entry["backward_ms"]
        ratio = (step_ms + added) / step_ms
        rate = entry["train_tokens"] / ((step_ms + added) / 1000)
        options.append(
            {
                "train_tokens": entry["train_tokens"],
                "added_ms": added,
                "forward_ms": entry["marginal_ms"],
                "backward_ms": entry["backward_ms"],
                "job_vs_alone": rate / alone,
                "tpot_p99_ratio": ratio,
                "ttft_p99_ratio": ratio,
                "delay_ms": added,
            }
        )
    fitting = [o for o in options if o["added_ms"] <= budget]
    best = (
        max(fitting, key=lambda o: o["job_vs_alone"])
        if fitting
        else min(options, key=lambda o: o["added_ms"])
    )
    return best | {
        "decode_rows": int(rows),
        "budget_ms": budget,
        "fits_budget": bool(fitting),
        "meets": _meets(best),
        "options": options,
    }


def _meets(figures: dict[str, Any]) -> bool:
    return bool(
        figures["job_vs_alone"] >= TARGETS["job_vs_alone"]
        and figures["tpot_p99_ratio"] <= TARGETS["tpot_p99_ratio"]
        and figures["ttft_p99_ratio"] <= TARGETS["ttft_p99_ratio"]
        and figures["delay_ms"] <= TARGETS["delay_ms"]
    )


PARTS = ("serving", "priority", "rows")


def decide(result: dict[str, Any]) -> dict[str, Any]:
    """The approaches' projected figures and the one favoured (None on the CPU smoke, or when a
    part failed or did not run). The step time at the load is the unprofiled step() call's p50
    (the profiler's own cost left out)."""
    lost = [name for name in PARTS if "error" in result.get(name, {"error": "did not run"})]
    if lost:
        return {"favoured": None, "why": f"no decision: {', '.join(lost)} failed or did not run"}
    if "low" not in result["priority"]["decode_step_ms"]:
        return {"favoured": None, "why": "CPU smoke: a tiny model on a shared CPU decides nothing"}
    step_ms = result["serving"]["call_ms_unprofiled"]["p50"]
    alone = _alone_rate(result)
    spatial = _spatial(result, alone)
    in_step = _in_step(result, alone, step_ms)
    approaches = {"spatial sharing": spatial, "training rows in the step": in_step}
    meeting = {name: a for name, a in approaches.items() if a["meets"]}
    if meeting:
        favoured = max(meeting, key=lambda name: meeting[name]["job_vs_alone"])
        why = f"{favoured} meets every target with the higher job share"
    else:
        favoured = max(approaches, key=lambda name: _closeness(approaches[name]))
        why = (
            f"neither meets every target; {favoured} comes closest "
            f"(the worst of its figures over its target is the smallest)"
        )
    mix = (
        in_step["forward_ms"] <= in_step["budget_ms"] < in_step["added_ms"]
        and spatial["job_vs_alone"] >= TARGETS["job_vs_alone"]
    )
    mode = result["priority"]["training_mode"]
    if mode != "cuda graph":
        why += (
            f"; spatial sharing was measured with the training step run eagerly ({mode}): "
            "its launches held the engine's thread, so its figures are not the design's"
        )
    if mix:
        why += (
            "; a mix is worth building: the rows' forward fits the step's budget but not "
            "their backward, and the low-priority stream trains fast enough to take it"
        )
    return {
        "favoured": favoured,
        "why": why,
        "step_ms_at_load": step_ms,
        "job_alone_tokens_per_s": alone,
        "approaches": approaches,
        "mix_suggested": mix,
    }


def _closeness(figures: dict[str, Any]) -> float:
    """Minus the worst ratio of a figure to its target (-1 or more: every target met)."""
    worst = max(
        TARGETS["job_vs_alone"] / max(float(figures["job_vs_alone"]), 1e-9),
        float(figures["tpot_p99_ratio"]) / TARGETS["tpot_p99_ratio"],
        float(figures["ttft_p99_ratio"]) / TARGETS["ttft_p99_ratio"],
        float(figures["delay_ms"]) / TARGETS["delay_ms"],
    )
    return -worst


def report(result: dict[str, Any]) -> str:
    """The decision, then each part (or what became of it)."""
    parts = [_decision_md(result["decision"])]
    titles = {"serving": "## 1. Serving", "priority": "## 2. Beside decode steps",
              "rows": "## 3. Training rows in a decode step"}  # fmt: skip
    renders = {"serving": _serving_md, "priority": _priority_md, "rows": _rows_md}
    for name in PARTS:
        part = result.get(name)
        if part is None:
            parts.append(f"{titles[name]}\n\nNot measured: the run ended before it.")
        elif "error" in part:
            parts.append(f"{titles[name]}\n\nFailed: {part['error']}")
        else:
            parts.append(renders[name](part))
    return "\n\n".join(parts) + f"\n\nRun time: {result['seconds']:.0f} s.\n"


def _decision_md(decision: dict[str, Any]) -> str:
    if decision["favoured"] is None:
        return f"## Decision\n\n{decision['why']}."
    header = ["approach", "job vs alone", "TPOT p99 ratio", "TTFT p99 ratio", "delay ms", "meets"]
    table = markdown_table(
        header,
        [
            [
                name,
                a["job_vs_alone"],
                a["tpot_p99_ratio"],
                a["ttft_p99_ratio"],
                a["delay_ms"],
                a["meets"],
            ]
            for name, a in decision["approaches"].items()
        ],
    )
    in_step = decision["approaches"]["training rows in the step"]
    return (
        f"## Decision\n\n**Favoured: {decision['favoured']}** ({decision['why']}).\n\n{table}\n\n"
        f"Targets: job >= {TARGETS['job_vs_alone']}, TPOT p99 <= {TARGETS['tpot_p99_ratio']}, "
        f"TTFT p99 <= {TARGETS['ttft_p99_ratio']}, delay <= {TARGETS['delay_ms']} ms. Serving "
        f"step at the load: {decision['step_ms_at_load']:.2f} ms (p50, unprofiled); job alone: "
        f"{decision['job_alone_tokens_per_s']:.0f} tok/s. Training rows in the step: "
        f"{in_step['train_tokens']} tokens a step of {in_step['decode_rows']} decode rows, "
        f"forward {in_step['forward_ms']:.2f} ms + backward {in_step['backward_ms']:.2f} ms "
        f"against a budget of {in_step['budget_ms']:.2f} ms. Projections from one call (one "
        f"seed); the rows' forward is the serving forward (no autograd), a lower bound."
    )


def _q(figures: dict[str, float] | None) -> str:
    """A quantiles dict (finetune_share_timeline.quantiles) in one short line."""
    if not figures:
        return "-"
    shown = " / ".join(f"{k} {figures[k]:.3g}" for k in ("p10", "p50", "p90", "p99", "max"))
    return f"{shown} (n {figures['n']})"


def _serving_md(serving: dict[str, Any]) -> str:
    head = (
        f"## 1. Serving at {serving['load']}x capacity ({serving['rate_rps']:.1f} of "
        f"{serving['capacity_rps']:.1f} req/s)\n\n{serving['calls_profiled']} steps "
        f"profiled over {serving['profile_s']} s. step() call ms unprofiled: "
        f"{_q(serving['call_ms_unprofiled'])}; profiled: {_q(serving['call_ms_profiled'])}."
    )
    timeline = serving["timeline"]
    if not isinstance(timeline, dict):
        return f"{head}\n\nTimeline: {timeline}."
    rows = [
        ["busy (time-weighted)", timeline["busy_fraction_time_weighted"]],
        ["idle (time-weighted)", timeline["idle_fraction_time_weighted"]],
    ]
    rows += [[f"in {k} kernels", v] for k, v in timeline["share_of_step_time"].items()]
    for key in ("memory_bound_share_time_weighted", "compute_fraction_time_weighted"):
        if key in timeline:
            rows.append([key.replace("_", " "), timeline[key]])
    return (
        f"{head}\n\n{markdown_table(['share of step time', 'value'], rows)}\n\n"
        f"Per step ({timeline['steps']} steps): ms {_q(timeline['step_ms'])}; busy fraction "
        f"{_q(timeline['busy_fraction_per_step'])}; tokens {_q(timeline['tokens_per_step'])}; "
        f"decode rows {_q(timeline['decode_rows_per_step'])}; steps with prefill "
        f"{timeline['steps_with_prefill']:.2f}; roofline {serving.get('roofline')}."
    )


def _table(first: str, columns: tuple[tuple[str, str], ...], items: list[tuple[Any, Any]]) -> str:
    """A table of `items` (label, figures) with one column per (header, key); "-" where a row
    lacks the key."""
    header = [first, *(name for name, _ in columns)]
    return markdown_table(header, [[label, *(r.get(k, "-") for _, k in columns)]
                                   for label, r in items])  # fmt: skip


_ARM_COLUMNS = (("p50 ms", "p50"), ("p99 ms", "p99"), ("max ms", "max"),
                ("p50 vs alone", "p50_vs_alone"), ("p99 added ms", "p99_added_ms"),
                ("training tok/s", "training_tokens_per_s"),
                ("training vs alone", "training_vs_alone"))  # fmt: skip
_ROW_COLUMNS = (("N", "train_tokens"), ("step ms", "step_ms"), ("marginal ms", "marginal_ms"),
                ("us/token", "marginal_us_per_token"),
                ("training fwd ms", "training_forward_ms"), ("backward ms", "backward_ms"),
                ("backward us/token", "backward_us_per_token"),
                ("backward ms/layer", "backward_ms_per_layer"))  # fmt: skip


def _priority_md(priority: dict[str, Any]) -> str:
    table = _table("arm", _ARM_COLUMNS, list(priority["decode_step_ms"].items()))
    streams = priority.get("stream_priorities") or priority.get("streams")
    return (
        f"## 2. Decode steps of {priority['decode_rows']} rows beside a training step on "
        f"another stream\n\n{table}\n\nTraining: {priority['training_mode']}, "
        f"{priority['training_tokens']} tokens a replay; alone "
        f"{priority['training_alone']}. Streams: {streams}."
    )


def _rows_md(rows: dict[str, Any]) -> str:
    items = [(size, e) for size, entries in rows["by_decode_rows"].items() for e in entries]
    return (
        f"## 3. N training tokens in a decode step ({rows['decode_context']}-position "
        f"decode rows, training sequences of {rows['train_width']}; {', '.join(rows['modes'])} "
        f"timed by {rows['timing']}, median of {rows['reps']})\n\n"
        f"{_table('decode rows', _ROW_COLUMNS, items)}"
    )
