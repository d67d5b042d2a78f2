"""The serving benchmark's results files: JSON, a Markdown report and the PNG of the curves."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import bench.common as common
from bench.common import markdown_table
from bench.engine.report import fmt


def save(args: argparse.Namespace, payload: dict[str, Any], command: str) -> Path:
    """bench.common.write_results into --results-dir (bench/results/engine_serving by default),
    and the plot next to it."""
    path = common.write_results(
        args.name, payload, report(payload), command, Path(args.results_dir)
    )
    if payload.get("sweeps"):
        plot(payload, path.with_suffix(".png"))
    return path


def report(payload: dict[str, Any]) -> str:
    parts = _headline(payload)
    if payload.get("step_shapes"):
        parts += _steps_section(payload)
    for mix, rows in (payload.get("sweeps") or {}).items():
        parts += _sweep_section(mix, rows, payload)
    parts += _cache_section(payload)
    if payload.get("hf_continuous_batching"):
        parts += _hf_section(payload)
    if payload.get("burst") or payload.get("baseline"):
        parts += _burst_section(payload)
    if payload.get("decode_sweep"):
        parts += _decode_section(payload)
    if payload.get("mixes"):
        parts += _mixes_section(payload["mixes"])
    errors = payload.get("errors") or {}
    if errors:
        parts.append("\n## Errors\n")
        parts += [
            f"- {name}: `{text.strip().splitlines()[-1][:300]}`" for name, text in errors.items()
        ]
    return "\n".join(parts)


def _headline(payload: dict[str, Any]) -> list[str]:
    rates = payload.get("goodput_rate_rps") or {}
    tok_s = payload.get("goodput_output_tok_s") or {}
    slo = payload.get("slo") or {}
    before = payload.get("baseline") or {}
    before_rates = before.get("goodput_rate_rps") or {}
    before_tok_s = before.get("goodput_output_tok_s") or {}
    rows = [
        (mix, _rate(rates.get(mix)), fmt(tok_s.get(mix), 0), _rate(before_rates.get(mix)),
         fmt(before_tok_s.get(mix), 0))
        for mix in ("short", "long", "longctx") if mix in rates
    ]  # fmt: skip
    parts = ["## Goodput\n"]
    if rows:
        parts.append(
            f"Highest swept rate holding TTFT p99 <= {fmt(slo.get('ttft_p99_ms'), 0)} ms and "
            f"TPOT p99 <= {fmt(slo.get('tpot_p99_ms'), 0)} ms (every lower rate holding too); "
            "before: the --baseline-engine's sweep in the same run, when it ran one:\n"
        )
        header = ("prompt mix", "goodput req/s", "output tok/s", "before: req/s",
                  "before: tok/s")  # fmt: skip
        parts.append(markdown_table(header, rows))
        ratio = payload.get("goodput_long_vs_short")
        parts.append(
            f"\nLong-prompt goodput over short-prompt goodput (output tok/s): {fmt(ratio, 2)}"
        )
    ratios = payload.get("mixed_vs_parts") or {}
    if ratios:
        text = ", ".join(f"{name} x{value:.2f}" for name, value in ratios.items())
        parts.append(f"\nMixed step over the sum of its parts: {text}")
    return parts


def _rate(value: float | None) -> str:
    """A swept rate as given (1.5 req/s, not "2"): bisected rates are fractions."""
    return "-" if value is None else f"{value:g}"


def _steps_section(payload: dict[str, Any]) -> list[str]:
    baseline = {
        row["shape"]: row for row in ((payload.get("baseline") or {}).get("step_shapes") or [])
    }
    rows = [
        (
            row["shape"], row["decode_rows"], row["prefill_tokens"],
            f"{row['prefill_chunks']} ({row['continuing_chunks']})",
            fmt(row["mixed_ms"], 2), fmt(row["prefill_only_ms"], 2), fmt(row["decode_only_ms"], 2),
            fmt(row["mixed_vs_parts"], 2),
            fmt(baseline.get(row["shape"], {}).get("mixed_ms"), 2),
            fmt(baseline.get(row["shape"], {}).get("mixed_vs_parts"), 2),
        )
        for row in payload["step_shapes"]
    ]  # fmt: skip
    header = ("shape", "decode rows", "prefill tokens", "chunks (continuing)", "mixed ms",
              "prefill-only ms", "decode-only ms", "mixed / parts", "baseline mixed ms",
              "baseline mixed / parts")  # fmt: skip
    notes = [
        f"- {row['shape']}: {row['description']} (mixed step: {row.get('mixed_path', '?')})"
        for row in payload["step_shapes"]
    ]
    return [
        "\n## Mixed steps vs their parts (median of whole `ModelRunner.execute` calls)\n",
        markdown_table(header, rows),
        "",
        *notes,
    ]


def _sweep_section(mix: str, rows: list[dict[str, Any]], payload: dict[str, Any]) -> list[str]:
    table = [
        (
            _rate(r["rate_rps"]), fmt(r["output_tok_s"], 0),
            fmt(r.get("offered_output_tok_s"), 0), fmt(r["ttft_p50_ms"], 0),
            fmt(r["ttft_p99_ms"], 0), fmt(r["tpot_p50_ms"], 1), fmt(r["tpot_p99_ms"], 1),
            fmt(r["queue_depth_mean"], 1), fmt(r["queue_depth_max"]),
            f"{r['completed']}/{r['requests']}", "yes" if r["meets_slo"] else "no",
        )
        for r in rows
    ]  # fmt: skip
    header = ("req/s", "output tok/s", "offered tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
              "TPOT p99 ms", "queue mean", "queue max", "done", "SLO")  # fmt: skip
    return [f"\n## Open loop, {mix} prompts\n", markdown_table(header, table)]


def _hf_section(payload: dict[str, Any]) -> list[str]:
    rows = []
    sweeps = payload.get("sweeps") or {}
    for mix, hf in payload["hf_continuous_batching"].items():
        ours: dict[str, Any] = next(
            (r for r in sweeps.get(mix, []) if r["rate_rps"] == hf.get("rate_rps")), {}
        )
        rows.append((
            mix, fmt(hf.get("rate_rps"), 0), fmt(ours.get("output_tok_s"), 0),
            fmt(hf.get("output_tok_s"), 0), fmt(ours.get("ttft_p99_ms"), 0),
            fmt(hf.get("ttft_p50_ms"), 0), fmt(hf.get("ttft_p99_ms"), 0),
            fmt(hf.get("tpot_p99_ms"), 1),
            f"{hf.get('completed')}/{hf.get('submitted')}",
            "error" if hf.get("error") else f"{fmt(hf.get('wall_s'), 0)} s",
        ))  # fmt: skip
    header = ("mix", "req/s", "engine tok/s", "transformers tok/s", "engine TTFT p99 ms",
              "transformers TTFT p50 ms", "transformers TTFT p99 ms",
              "transformers TPOT p99 ms", "transformers done", "transformers ran")  # fmt: skip
    return [
        "\n## transformers continuous batching at the goodput rate (same requests and arrivals)\n",
        markdown_table(header, rows),
        "\ntransformers TTFT counts only requests that produced a token before its time budget"
        " ended; its tok/s counts every token produced, finished requests or not.",
    ]


def _burst_section(payload: dict[str, Any]) -> list[str]:
    def line(label: str, burst: dict[str, Any] | None) -> tuple[Any, ...]:
        summary = (burst or {}).get("summary") or {}
        ttft = summary.get("ttft") or {}
        return (label, fmt(summary.get("output_tok_s"), 0), fmt(summary.get("wall_s"), 2),
                f"{summary.get('completed')}/{summary.get('requests')}",
                fmt(ttft.get("p50_ms"), 0), summary.get("preemptions"))  # fmt: skip

    rows = [line("this engine", payload.get("burst"))]
    baseline = payload.get("baseline")
    if baseline:
        rows.insert(0, line(f"baseline ({baseline.get('engine_dir')})", baseline.get("burst")))
    header = ("engine", "output tok/s", "wall s", "done", "TTFT p50 ms", "preemptions")
    return [
        "\n## The 1,000-request Alpaca+LIMA burst of engine_h200 (back to back)\n",
        markdown_table(header, rows),
    ]


def _decode_section(payload: dict[str, Any]) -> list[str]:
    rows = [
        (r["batch_size"], fmt(r["mean_context_len"], 0), fmt(r["decode_step_ms"], 2),
         fmt(r["roofline_step_ms"], 3), fmt(r["ratio_to_roofline"], 2))
        for r in payload["decode_sweep"] if "decode_step_ms" in r
    ]  # fmt: skip
    rate = (payload.get("copy_bandwidth") or {}).get("read_write_gb_per_s")
    return [
        f"\n## Pure decode steps vs the HBM roofline (copy rate {fmt(rate, 0)} GB/s)\n",
        markdown_table(("batch", "context", "step ms", "roofline ms", "ratio"), rows),
    ]


def _mixes_section(mixes: dict[str, Any]) -> list[str]:
    rows = []
    for mix, info in mixes.items():
        prompt, answer = info["prompt_tokens"], info["answer_tokens"]
        rows.append((mix, ", ".join(f"{k} {v}" for k, v in info["by_source"].items()),
                     fmt(prompt["p50"], 0), fmt(prompt["mean"], 0), fmt(prompt["p99"], 0),
                     fmt(answer["p50"], 0), fmt(answer["mean"], 0)))  # fmt: skip
    header = ("mix", "sources (of 2,000 drawn)", "prompt p50", "prompt mean", "prompt p99",
              "answer p50", "answer mean")  # fmt: skip
    return ["\n## Prompt mixes (GPT-2 tokens; answers replayed with ignore_eos)\n",
            markdown_table(header, rows)]  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> None:
    """Output tok/s, TTFT p99, TPOT p99 and queue depth against the offered rate, per mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = payload.get("slo") or {}
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        ("output_tok_s", "output tokens/s", None),
        ("ttft_p99_ms", "TTFT p99 (ms)", slo.get("ttft_p99_ms")),
        ("tpot_p99_ms", "TPOT p99 (ms)", slo.get("tpot_p99_ms")),
        ("queue_depth_mean", "mean queue depth (waiting requests)", None),
    )
    for axis, (key, label, limit) in zip(axes.flat, panels, strict=True):
        for mix, rows in payload["sweeps"].items():
            points = [(r["rate_rps"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=f"{mix} prompts")
        for mix, hf in (payload.get("hf_continuous_batching") or {}).items():
            if hf.get(key) is not None:
                axis.scatter([hf["rate_rps"]], [hf[key]], marker="x", s=60,
                             label=f"transformers CB, {mix}")  # fmt: skip
        if limit is not None:
            axis.axhline(limit, color="grey", linestyle="--", linewidth=1, label="SLO")
        if key.startswith(("ttft", "tpot")):
            axis.set_yscale("log")
        axis.set_xlabel("offered load (requests/s, Poisson)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("Site engine under open-loop traffic (Llama-3.2-1B shape, bf16)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _cache_section(payload: dict[str, Any]) -> list[str]:
    """The Markdown section of the cache phase (bench.engine.serving_cache; empty without one)."""
    result = payload.get("prefix_cache")
    if not result:
        return []
    rows = [
        (arm, i, f"{r['output_tok_s']:.0f}", _fmt(r["tpot_p50_ms"]), _fmt(r["ttft_p99_ms"]),
         "yes" if r["meets_slo"] else "no", _fmt(r.get("prefix_cache_hit_fraction"), 3))
        for arm in ("on", "off") for i, r in enumerate(result["runs"][arm])
    ]  # fmt: skip
    header = ("cache", "pair", "output tok/s", "TPOT p50 ms", "TTFT p99 ms", "SLO",
              "hit fraction")  # fmt: skip
    return [
        f"\n## Prefix cache on vs off at {result['rate_rps']:g} req/s\n",
        markdown_table(header, rows),
        f"\nprefix_cache_goodput_ratio (on/off output tok/s, least pair): "
        f"{_fmt(payload.get('prefix_cache_goodput_ratio'), 3)}; prefix_cache_tpot_p50_ratio "
        f"(largest pair): {_fmt(payload.get('prefix_cache_tpot_p50_ratio'), 3)}",
    ]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
