"""The results of the GPU engine benchmark: the JSON payload's summary keys and the Markdown.

This module owns how a run's measurements become its results files: the top-level headline
keys of the engine runs (tok/s, TTFT/TPOT percentiles, peak KV, preemptions), the library
versions recorded with them, the Markdown report of everything measured so far (throughput,
engine runs, transformers baselines, decode step vs roofline, trace/model/engine notes), and
writing both through bench.common.write_results, into --results-dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import bench.common as common
from bench.common import markdown_table
from bench.engine.harness import GIB, MIB
from bench.engine.metrics import RunSummary


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _dist(run: dict[str, Any], key: str, pct: str) -> Any:
    dist = run.get(key)
    return None if not dist else dist.get(f"{pct}_ms")


def report(payload: dict[str, Any]) -> str:
    """The Markdown of everything measured so far."""
    parts: list[str] = []
    runs: dict[str, Any] = payload.get("runs", {})
    hf: dict[str, Any] = payload.get("hf", {})
    parts += _throughput_section(payload, hf)
    if runs:
        parts += _engine_runs_section(runs)
    if hf:
        parts += _hf_section(hf)
    sweep = payload.get("decode_sweep")
    if sweep:
        parts += _decode_sweep_section(payload, sweep)
    parts += _notes_section(payload)
    return "\n".join(parts)


def _throughput_section(payload: dict[str, Any], hf: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    subset = payload.get("hf_subset_requests")
    parts.append("## Throughput (output tokens/s)\n")
    headline = [
        ("this engine, burst, whole trace", payload.get("engine_tok_s"), ""),
        (
            f"this engine, burst, first {subset} requests",
            payload.get("engine_subset_tok_s"),
            "",
        ),
        (
            f"transformers generate, static batches, first {subset} requests",
            payload.get("hf_generate_tok_s"),
            "useful tokens only" + _status_note(hf.get("generate")),
        ),
        (
            f"transformers continuous batching, first {subset} requests",
            payload.get("hf_generate_batch_tok_s"),
            _status_note(hf.get("generate_batch")).removeprefix("; "),
        ),
        (
            f"this engine, Poisson {payload.get('config', {}).get('poisson_rate')} req/s",
            payload.get("poisson_tok_s"),
            "offered load, not capacity",
        ),
    ]
    parts.append(
        markdown_table(("run", "tok/s", "note"), [(n, fmt(v), note) for n, v, note in headline])
    )
    return parts


def _engine_runs_section(runs: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    parts.append("\n## Engine runs\n")
    rows = []
    for name, run in runs.items():
        if "error" in run and "summary" not in run:
            rows.append((name, "error", *["-"] * 12))
            continue
        s = run["summary"]
        gib = (s["max_memory_allocated_bytes"] or 0) / GIB
        rows.append(
            (
                name,
                f"{s['completed']}/{s['requests']}" + (" (cut)" if s["truncated"] else ""),
                fmt(s["wall_s"]),
                fmt(s["output_tok_s"]),
                fmt(s["requests_per_s"], 2),
                fmt(_dist(s, "ttft", "p50")),
                fmt(_dist(s, "ttft", "p99")),
                fmt(_dist(s, "tpot", "p50"), 2),
                fmt(_dist(s, "tpot", "p99"), 2),
                fmt(s["peak_kv_bytes"] / GIB, 2),
                fmt(gib, 1) if s["max_memory_allocated_bytes"] is not None else "-",
                s["preemptions"],
                fmt(s["mean_running"]),
            )
        )
    parts.append(
        markdown_table(
            (
                "run",
                "done",
                "wall s",
                "out tok/s",
                "req/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "peak KV GiB",
                "max alloc GiB",
                "preempt",
                "mean batch",
            ),
            rows,
        )
    )
    return parts


def _hf_section(hf: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    parts.append("\n## transformers baselines (same model, same requests)\n")
    parts.append(
        markdown_table(
            (
                "baseline",
                "status",
                "requests done",
                "useful tokens",
                "computed tokens",
                "wall s",
                "useful tok/s",
                "warm-up s",
            ),
            [
                (
                    name,
                    r["status"],
                    f"{r['completed_requests']}/{r['requests']}",
                    r["useful_tokens"],
                    r["generated_tokens"],
                    fmt(r["wall_s"]),
                    fmt(r["useful_tok_s"]),
                    fmt(r["warmup_s"]),
                )
                for name, r in hf.items()
            ],
        )
    )
    for name, r in hf.items():
        parts.append(f"\n- {name}: {r['api']}")
        if r.get("error"):
            last = [line for line in str(r["error"]).strip().splitlines() if line.strip()]
            parts.append(f"  - error: `{last[-1][:300] if last else r['error'][:300]}`")
    return parts


def _decode_sweep_section(payload: dict[str, Any], sweep: list[dict[str, Any]]) -> list[str]:
    parts: list[str] = []
    bw = payload.get("copy_bandwidth", {})
    parts.append(
        f"\n## Decode step vs HBM roofline (copy rate {fmt(bw.get('read_write_gb_per_s'))} "
        "GB/s read+write)\n"
    )
    parts.append(
        markdown_table(
            (
                "batch",
                "context",
                "step ms",
                "roofline ms",
                "ratio",
                "step ms, sync",
                "decode tok/s",
                "weights MiB",
                "KV read MiB",
            ),
            [
                (
                    row["batch_size"],
                    fmt(row["mean_context_len"], 0),
                    fmt(row["decode_step_ms"], 2),
                    fmt(row["roofline_step_ms"], 3),
                    fmt(row["ratio_to_roofline"], 1),
                    fmt(row.get("sync_step_ms"), 2),
                    fmt(row["decode_tok_s"], 0),
                    fmt(row["weight_bytes"] / MIB, 0),
                    fmt(row["kv_bytes_read"] / MIB, 0),
                )
                if "decode_step_ms" in row
                else (row["batch_size"], row.get("skipped", "-"), *["-"] * 7)
                for row in sweep
            ],
        )
    )
    return parts


def _notes_section(payload: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    trace = payload.get("trace", {})
    config = payload.get("config", {})
    model = payload.get("model", {})
    if trace:
        parts.append(
            f"\nTrace: {trace.get('requests')} requests {trace.get('by_corpus')}, "
            f"{trace.get('prompt_tokens')} prompt / {trace.get('output_tokens')} output tokens, "
            f"prompt cap {trace.get('max_prompt_tokens')}, response cap "
            f"{trace.get('max_output_tokens')}, seed {trace.get('seed')}; {trace.get('replay')}."
        )
    if model:
        parts.append(
            f"\nModel: {model.get('parameters')} parameters, {model.get('dtype')} on "
            f"{model.get('device')}, weights {fmt(model.get('weight_bytes', 0) / MIB, 0)} MiB."
        )
    if config:
        parts.append(
            f"\nEngine: max_num_seqs {config.get('max_num_seqs')}, max_num_batched_tokens "
            f"{config.get('max_num_batched_tokens')}, block size {config.get('block_size')}, "
            f"KV budget {config.get('kv_cache_gib') or 'engine default (share of free memory)'}."
        )
    errors = payload.get("errors")
    if errors:
        parts.append("\nErrors: " + "; ".join(f"{k}: {str(v)[:200]}" for k, v in errors.items()))
    phases = payload.get("phases_s")
    if phases:
        parts.append("\nPhases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    if not payload.get("complete"):
        parts.append("\n**Incomplete: the run has not finished (or was cut short).**")
    return parts


def _status_note(result: dict[str, Any] | None) -> str:
    if not result:
        return ""
    status = result.get("status")
    return "" if status == "ok" else f"; {status}"


def save(args: argparse.Namespace, payload: dict[str, Any], command: str) -> Path:
    """bench.common.write_results, into --results-dir (bench/results/engine by default)."""
    return common.write_results(
        args.name, payload, report(payload), command, Path(args.results_dir)
    )


def record_headline(payload: dict[str, Any], name: str, summary: RunSummary) -> None:
    """Top-level keys of the results file for the engine runs."""
    ttft = {"p50": _p(summary.ttft, "p50"), "p99": _p(summary.ttft, "p99")}
    tpot = {"p50": _p(summary.tpot, "p50"), "p99": _p(summary.tpot, "p99")}
    key = {
        "engine_burst": "burst",
        "engine_subset_burst": "subset_burst",
        "engine_poisson": "poisson",
    }[name]
    payload.setdefault("ttft_ms", {})[key] = ttft
    payload.setdefault("tpot_ms", {})[key] = tpot
    payload.setdefault("requests_per_s", {})[key] = summary.requests_per_s
    payload.setdefault("peak_kv_bytes", {})[key] = summary.peak_kv_bytes
    payload.setdefault("max_memory_allocated_bytes", {})[key] = summary.max_memory_allocated_bytes
    payload.setdefault("preemptions", {})[key] = summary.preemptions
    if name == "engine_burst":
        payload["engine_tok_s"] = summary.output_tok_s
        payload["engine_requests_per_s"] = summary.requests_per_s
    elif name == "engine_subset_burst":
        payload["engine_subset_tok_s"] = summary.output_tok_s
    else:
        payload["poisson_tok_s"] = summary.output_tok_s
        payload["poisson_requests_per_s"] = summary.requests_per_s


def versions() -> dict[str, str | None]:
    import transformers

    try:
        import triton

        triton_version: str | None = str(triton.__version__)
    except Exception:
        triton_version = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": str(transformers.__version__),
        "triton": triton_version,
        "python": sys.version.split()[0],
    }


def _p(dist: Any, pct: str) -> float | None:
    return None if dist is None else float(getattr(dist, f"{pct}_ms"))
