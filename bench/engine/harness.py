"""Run-wide plumbing of the GPU engine benchmark (bench/engine/gpu.py).

This module owns what every phase of a run shares and none of them measures: the size units,
the timestamped progress log that a remotely watched run prints, the deadline that shrinks the
budgets of later phases so the whole run ends in time, and the two device helpers (synchronise,
free cached memory) that fence each measurement.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import torch

GIB = 1 << 30
MIB = 1 << 20


class Progress:
    """Timestamped progress lines, flushed at once (the run is watched remotely)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)


class Deadline:
    """Shrinks each phase's budget so the phases after it keep their minimum."""

    def __init__(self, progress: Progress, total_s: float) -> None:
        self.progress = progress
        self.total_s = total_s

    def budget(self, nominal: float, reserve_after: float) -> float:
        left = self.total_s - self.progress.elapsed() - reserve_after
        return max(0.0, min(nominal, left))


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exit_if_threads_linger() -> None:
    """Ends the process at once if a non-daemon thread (transformers' continuous batching, when
    it ignored its stop) would keep it alive after main() returned."""
    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
