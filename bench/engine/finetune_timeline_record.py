"""What bench.engine.finetune_timeline records of each call of the job's `run_unit` and of each
serving step, and how it names the cause of a call over the bound.

A call is one piece of a unit (or the trainer's build): the engine's thread is held for all of
it, so its host time is the delay it adds to the serving step after it. Beside the piece's own
record (FineTuneJobs.on_piece: shape, where it ended, first piece of its unit), each call keeps
its device span (CUDA events around it, the end waited for here: the span is its kernels and
the gaps between them; the site itself leaves a piece queued as it ends), the caching
allocator's counters across it (a retry is a cudaFree of
every cached block, which synchronises the device), the time the garbage collector ran inside
it, and the host time of the serving step that followed.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.engine.gc_pauses import GcPauses
from site_engine.finetune.job_state import PieceRecord
from site_engine.idle_work import IdleWork

_ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free")


@dataclass(slots=True)
class Call:
    phase: str
    t_s: float  # since the timeline began
    total_ms: float  # the engine thread's hold, queued device work waited for included
    took_ms: float  # the piece's own time, the delay it adds to serving (CUDA: its span)
    # CUDA event span around the call (None off CUDA): from when the device reached the call
    # (after the work queued before it) to its end; idle gaps included, so not busy time.
    device_ms: float | None
    beside: bool  # a request was in the engine (not an idle-sized call)
    piece: dict[str, Any] | None  # the PieceRecord, None for a call that ran no piece
    alloc_retries: int = 0
    device_allocs: int = 0  # cudaMalloc calls inside the call
    device_frees: int = 0
    reserved_mib: float = 0.0  # the allocator's reserve after the call
    gc_ms: float = 0.0
    new_shape: bool = False  # the unit's (rows, width) first seen in this call
    next_step_ms: float | None = None  # the serving step right after the call


@dataclass(slots=True)
class Timeline:
    """Every call and serving step, by phase; `phase` is set by the driver."""

    cuda: bool
    layers: int  # the model's decoder layers (names the last layer's backward)
    phase: str = "build"
    mark: bool = False  # each call and step marked for torch.profiler ("ft_call", "serve_step")
    calls: list[Call] = field(default_factory=list)
    steps: dict[str, list[float]] = field(default_factory=dict)  # host ms of serving steps
    _began: float = field(default_factory=time.perf_counter)
    _pieces: list[PieceRecord] = field(default_factory=list)
    _shapes: set[tuple[int, int]] = field(default_factory=set)
    _collector: GcPauses = field(default_factory=GcPauses)
    _last_was_call: bool = False

    def __post_init__(self) -> None:
        self._collector.__enter__()

    def close(self) -> None:
        self._collector.__exit__(None, None, None)

    @property
    def _gc_ms(self) -> float:
        return sum(ms for _, ms in self._collector.pauses)

    def on_piece(self, record: PieceRecord) -> None:
        self._pieces.append(record)

    def _allocator(self) -> dict[str, int]:
        if not self.cuda:
            return dict.fromkeys((*_ALLOCATOR, "reserved_bytes.all.current"), 0)
        stats = torch.cuda.memory_stats()
        return {k: int(stats.get(k, 0)) for k in (*_ALLOCATOR, "reserved_bytes.all.current")}

    def timed_call(self, run: Callable[[], float], beside: bool) -> float:
        before, gc_before, pieces_before = self._allocator(), self._gc_ms, len(self._pieces)
        events = [_event() for _ in range(2)] if self.cuda else []
        began = time.perf_counter()
        if events:
            events[0].record()
        with _marked("ft_call", self.mark):
            took = run()
        if events:
            events[1].record()
            events[1].synchronize()
        total = time.perf_counter() - began
        after = self._allocator()
        piece = self._pieces[-1] if len(self._pieces) > pieces_before else None
        shape = piece.unit_shape if piece is not None else None
        new_shape = shape is not None and shape not in self._shapes
        if shape is not None:
            self._shapes.add(shape)
        device_ms = events[0].elapsed_time(events[1]) if events else None
        # On CUDA run_unit reports the piece before it (its own is left queued: pieces.py's
        # PieceLedger); the call's own piece is its span here, which waits for it above.
        own_ms = device_ms if device_ms is not None and piece is not None else 1000 * took
        self.calls.append(
            Call(
                self.phase,
                began - self._began,
                1000 * total,
                own_ms,
                device_ms,
                beside,
                None if piece is None else asdict(piece),
                after["num_alloc_retries"] - before["num_alloc_retries"],
                after["num_device_alloc"] - before["num_device_alloc"],
                after["num_device_free"] - before["num_device_free"],
                after["reserved_bytes.all.current"] / 2**20,
                self._gc_ms - gc_before,
                new_shape,
            )
        )
        self._last_was_call = True
        return took

    def serving_step(self, step: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        with _marked("serve_step", self.mark):
            out = step()
        ms = 1000 * (time.perf_counter() - began)
        self.steps.setdefault(self.phase, []).append(ms)
        if self._last_was_call and self.calls:
            self.calls[-1].next_step_ms = ms
        self._last_was_call = False
        return out


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _marked(name: str, mark: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.profiler.record_function(name) if mark else contextlib.nullcontext()


class TimedWork:
    """The job's work (IdleWork) with each call recorded on the timeline."""

    def __init__(self, work: IdleWork, timeline: Timeline) -> None:
        self.work, self.timeline = work, timeline

    def has_work(self) -> bool:
        return self.work.has_work()

    def next_unit_s(self) -> float:
        return self.work.next_unit_s()

    def run_unit(self, alone: bool) -> float:
        return self.timeline.timed_call(lambda: self.work.run_unit(alone), beside=not alone)


class TimedEngine:
    """The engine with each step's host time on the timeline (everything else passed on)."""

    def __init__(self, engine: Any, timeline: Timeline) -> None:
        self._engine, self._timeline = engine, timeline

    def step(self) -> Any:
        return self._timeline.serving_step(self._engine.step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def causes(call: Call, bound_ms: float, layers: int) -> list[str]:
    """What made a call over the bound, from what it recorded (several may hold)."""
    piece = call.piece
    found = []
    if piece is not None and piece["boundaries"] == 1:
        if piece["ended_at"] == "forward 1":
            found.append("layer 0's forward alone: the unit's first attention at its length")
        if piece["ended_at"] == f"backward {layers - 2}":
            found.append("the last layer's backward alone: the first attention backward")
    if piece is None:
        found.append("trainer build (no piece)")
    if call.alloc_retries:
        found.append("allocator retry (cudaFree of the cache, a device sync)")
    if call.device_allocs or call.device_frees:
        found.append("allocator growth (cudaMalloc/cudaFree)")
    if call.gc_ms > bound_ms / 4:
        found.append("garbage collection")
    if piece is not None:
        if piece["first_piece"]:
            found.append("a unit's first piece (batch padded and copied)")
        if call.new_shape:
            found.append("a unit shape not seen before (first kernels on it)")
        if piece["ended_at"] == "end" and piece["unit_done"]:
            found.append("a unit's tail (loss chunks, optimizer step)")
        if piece["boundaries"] <= 1:
            found.append("one boundary already past the bound (piece cannot be cut smaller)")
    if call.device_ms is not None and call.device_ms < 0.5 * call.took_ms:
        found.append("the device reached the piece late (earlier work still queued)")
    return found or ["device work over the sizer's estimate"]


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, math.floor(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1],
            "mean": statistics.fmean(ordered), "n": len(ordered)}  # fmt: skip


def summary(timeline: Timeline, bound_ms: float) -> dict[str, Any]:
    """Per phase: the calls' time, the device's share of it, the calls over the bound and their
    causes (counted, and the 40 longest in full)."""
    out: dict[str, Any] = {}
    for phase in dict.fromkeys(c.phase for c in timeline.calls):
        calls = [c for c in timeline.calls if c.phase == phase]
        over = [c for c in calls if c.took_ms > bound_ms]
        counted: dict[str, int] = {}
        for call in over:
            for cause in causes(call, bound_ms, timeline.layers):
                counted[cause] = counted.get(cause, 0) + 1
        device = [c.device_ms for c in calls if c.device_ms is not None]
        host = sum(c.took_ms for c in calls)
        after_piece = [c.next_step_ms for c in calls if c.next_step_ms is not None]
        out[phase] = {
            "calls": len(calls),
            "call_ms": _quantiles([c.took_ms for c in calls]),
            "waited_before_ms": _quantiles([c.total_ms - c.took_ms for c in calls]),
            "device_span_share": sum(device) / host if device and host else None,
            "gc_ms": sum(c.gc_ms for c in calls),
            "allocator": {k: sum(getattr(c, k) for c in calls)
                          for k in ("alloc_retries", "device_allocs", "device_frees")},
            "new_shapes": sum(c.new_shape for c in calls),
            "over_bound": len(over),
            "over_bound_ms": sum(c.took_ms - bound_ms for c in over),
            "causes": dict(sorted(counted.items(), key=lambda kv: -kv[1])),
            "longest": [asdict(c) | {"causes": causes(c, bound_ms, timeline.layers)}
                        for c in sorted(over, key=lambda c: -c.took_ms)[:40]],
            "serving_step_ms": _quantiles(timeline.steps.get(phase, [])),
            "serving_step_after_call_ms": _quantiles(after_piece),
        }  # fmt: skip
    return out
