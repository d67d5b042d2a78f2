"""The GPU's kernel timeline of serving steps, cut into steps at markers: how much of each step
the SMs had work, in which kinds of kernels, and how much of the card's compute the step's
tokens used (bench.engine.finetune_share_profile, part 1).

The driver launches one marker kernel (torch.cuda._sleep's `spin_kernel`, a few cycles) on the
engine's stream before every `step()` call. The engine's work is one stream, so step k's GPU
period runs from marker k's start to marker k+1's start, whether the engine overlaps its host
work with the device's (async scheduling: the step launched by call k runs while call k+1 is
being prepared) or not. A period after which the loop waited with nothing to run ends at its
last kernel: that wait is time between steps, not idle time inside one.

Per-kernel achieved occupancy is not in the torch profiler's trace (and ncu/nsys are not usable
on the lent machines), so "idle or under-occupied" is read two ways: the share of a step with no
kernel running (busy fraction), and the share spent in kernels that are memory-bound at the
step's size (they leave the tensor cores mostly idle): every attention and elementwise kernel,
and the GEMMs of a step with fewer tokens than the card's ridge point (peak FLOP/s over memory
bandwidth; a bf16 GEMM of M tokens does about M FLOP per weight byte). The model FLOPs of a step
over its period at the card's peak (`compute_fraction`) says the same from the other side.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "spin_kernel"
_GEMM = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "matmul")
_SM_WORK = ("gemm", "attention", "other")
_ATTENTION = ("paged_decode", "paged_prefill", "attention", "attn", "fmha", "flash")
# Dense bf16 tensor-core FLOP/s and HBM bytes/s by the vendor's datasheets (SXM parts).
CARDS: dict[str, tuple[float, float]] = {
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
}


@dataclass(frozen=True, slots=True)
class Interval:
    """One device activity: a kernel, a copy or a memset."""

    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class StepWork:
    """What the driver knows of the step one `step()` call launched."""

    prefill_tokens: int
    decode_rows: int
    sampled_rows: int
    wait_after: bool  # the loop waited with nothing to run before the next call


@dataclass(frozen=True, slots=True)
class Roofline:
    """The card's peak and the model's FLOPs per computed token and per sampled row."""

    peak_flops: float
    memory_bytes_per_s: float
    flops_per_token: float
    flops_per_sampled_row: float

    @property
    def ridge_tokens(self) -> float:
        return self.peak_flops / self.memory_bytes_per_s


def kind(name: str) -> str:
    """copy (a copy engine's, or a memset), sync (a wait the trace may draw on the device's
    row), gemm, attention or other (norms, rotary, activations, sampling, ...): the last three
    are the SMs' work."""
    if name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
        return "copy"
    if name.startswith(("Event Sync", "Stream Sync", "Context Sync", "Stream Wait")):
        return "sync"
    lowered = name.lower()
    if any(key in lowered for key in _ATTENTION):
        return "attention"
    if any(key in lowered for key in _GEMM):
        return "gemm"
    return "other"


def device_intervals(prof: Any) -> list[Interval]:
    """Every device activity a stopped torch profiler recorded, in start order: from its kineto
    results, or, where those lack the device type, from its chrome trace."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    out: list[Interval] = []
    if results is not None:
        for event in results.events():
            if str(event.device_type()).endswith("CUDA"):
                start = int(event.start_ns())
                out.append(Interval(event.name(), start, start + int(event.duration_ns())))
    if not out:
        out = _from_chrome_trace(prof)
    return sorted(out, key=lambda i: i.start_ns)


def _from_chrome_trace(prof: Any) -> list[Interval]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    return [
        Interval(e["name"], int(e["ts"] * 1000), int((e["ts"] + e.get("dur", 0)) * 1000))
        for e in events
        if e.get("cat") in device and "ts" in e
    ]


def _union_ns(spans: Iterable[tuple[int, int]]) -> int:
    total, end = 0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def split_steps(
    intervals: Sequence[Interval], work: Sequence[StepWork], roofline: Roofline | None
) -> list[dict[str, float]]:
    """One row per step whose period is closed by the next marker and that ran a kernel (an
    empty step, one that only applied the step before it, has none). `work[i]` belongs to the
    i-th marker; markers beyond `work` (or work beyond the markers) are left out."""
    markers = [i for i in intervals if MARKER in i.name]
    others = [i for i in intervals if MARKER not in i.name]
    rows: list[dict[str, float]] = []
    cursor = 0
    for index in range(min(len(markers) - 1, len(work))):
        begin, next_begin = markers[index].start_ns, markers[index + 1].start_ns
        while cursor < len(others) and others[cursor].start_ns < begin:
            cursor += 1
        inside: list[Interval] = []
        while cursor < len(others) and others[cursor].start_ns < next_begin:
            inside.append(others[cursor])
            cursor += 1
        if any(kind(i.name) in _SM_WORK for i in inside):
            rows.append(_step_row(begin, next_begin, inside, work[index], roofline))
    return rows


def _step_row(
    begin: int, next_begin: int, inside: list[Interval], work: StepWork, roofline: Roofline | None
) -> dict[str, float]:
    kernels = [i for i in inside if kind(i.name) in _SM_WORK]
    end = next_begin
    if work.wait_after:
        end = max([i.end_ns for i in inside], default=begin)
    window = max(end - begin, 1)
    busy = _union_ns(
        (max(i.start_ns, begin), min(i.end_ns, end)) for i in kernels if i.start_ns < end
    )
    by_kind = dict.fromkeys(("gemm", "attention", "other", "copy", "sync"), 0)
    for item in inside:
        by_kind[kind(item.name)] += item.end_ns - item.start_ns
    tokens = work.prefill_tokens + work.decode_rows
    row = {
        "window_ms": window / 1e6,
        "between_steps_ms": (next_begin - end) / 1e6,
        "busy_fraction": busy / window,
        "tokens": float(tokens),
        "decode_rows": float(work.decode_rows),
        "prefill_tokens": float(work.prefill_tokens),
        **{f"{k}_ms": v / 1e6 for k, v in by_kind.items()},
    }
    if roofline is not None:
        compute_bound = by_kind["gemm"] if tokens >= roofline.ridge_tokens else 0
        memory_bound = by_kind["gemm"] + by_kind["attention"] + by_kind["other"] - compute_bound
        flops = roofline.flops_per_token * tokens + roofline.flops_per_sampled_row * (
            work.sampled_rows
        )
        row["memory_bound_share"] = memory_bound / window
        row["compute_fraction"] = flops / (roofline.peak_flops * window / 1e9)
    return row


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """p10, p50, p90, p99 (nearest rank), max, mean and count of a non-empty list."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "p10": at(0.10),
        "p50": at(0.50),
        "p90": at(0.90),
        "p99": at(0.99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
        "n": len(ordered),
    }


def summarize(rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Time-weighted shares over all steps (each step's kind of time over the steps' total
    time) and the per-step distributions."""
    if not rows:
        return {"steps": 0}
    total = sum(r["window_ms"] for r in rows)
    busy = sum(r["busy_fraction"] * r["window_ms"] for r in rows)
    out: dict[str, Any] = {
        "steps": len(rows),
        "step_ms": quantiles([r["window_ms"] for r in rows]),
        "busy_fraction_time_weighted": busy / total,
        "idle_fraction_time_weighted": 1 - busy / total,
        "busy_fraction_per_step": quantiles([r["busy_fraction"] for r in rows]),
        "share_of_step_time": {
            k: sum(r[f"{k}_ms"] for r in rows) / total for k in ("gemm", "attention", "other")
        },
        "tokens_per_step": quantiles([r["tokens"] for r in rows]),
        "decode_rows_per_step": quantiles([r["decode_rows"] for r in rows]),
        "steps_with_prefill": sum(r["prefill_tokens"] > 0 for r in rows) / len(rows),
        "between_steps_ms_total": sum(r["between_steps_ms"] for r in rows),
    }
    if "compute_fraction" in rows[0]:
        out["memory_bound_share_time_weighted"] = (
            sum(r["memory_bound_share"] * r["window_ms"] for r in rows) / total
        )
        out["compute_fraction_time_weighted"] = (
            sum(r["compute_fraction"] * r["window_ms"] for r in rows) / total
        )
        out["compute_fraction_per_step"] = quantiles([r["compute_fraction"] for r in rows])
    return out
