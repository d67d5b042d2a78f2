"""The engine loop of bench.engine.finetune_colocated: interactive requests stepped at their
arrival times on the wall clock, with a fine-tuning job's units run between steps as the site's
EngineService runs them (site_engine/engine_service.py `_run`: a unit when the job has work and
the IdleGate allows it, given the next unit's predicted time and how long since the last one
ended, then a model step if any request is unfinished). Latencies and the
run's bookkeeping are priority_driver's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bench.engine.priority_driver import RunResult, _finish, _Timing
from fedllm_contract.fine_tuning import FineTuneState
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.paged_engine import PagedEngine
from site_engine.finetune.jobs import FineTuneJobs
from site_engine.idle_work import IdleGate, IdleWork


@dataclass(slots=True)
class JobClock:
    """The job's trained tokens and units as the phases read them."""

    jobs: FineTuneJobs
    job_id: str
    # What runs the units: the jobs themselves (between steps, idle mode) or training rows
    # beside each step (site_engine/finetune/step_work.py).
    work: IdleWork | None = None
    units: int = 0
    unit_s: list[float] = field(default_factory=list)
    # The pieces measured while a request was in the engine: the delay each added to a step
    # (one a call, or two when the call ended a unit on CUDA: FineTuneJobs.pieces_measured_s).
    beside_s: list[float] = field(default_factory=list)
    # Each call's (began, ended) on perf_counter, and whether it was beside requests: which
    # call queued a piece that went over the bound, and what ran in it (GcPauses.within).
    windows: list[tuple[float, float, bool]] = field(default_factory=list)
    # (call index, seconds) of each piece measured: the call that measured it.
    pieces: list[tuple[int, float]] = field(default_factory=list)

    def tokens(self) -> int:
        return self.jobs.progress(self.job_id).trained_tokens

    def next_unit_s(self) -> float:
        return (self.work or self.jobs).next_unit_s()

    def run_unit(self, alone: bool) -> float:
        began = time.perf_counter()
        took = self.work.run_unit(alone) if self.work is not None else self.jobs.run_unit(alone)
        self.windows.append((began, time.perf_counter(), not alone))
        measured = self.jobs.pieces_measured_s
        self.pieces.extend((len(self.windows) - 1, seconds) for seconds in measured)
        if not alone:
            self.beside_s.extend(measured)
        progress = self.jobs.progress(self.job_id)
        if progress.state is FineTuneState.FAILED:  # out of memory, say: no figure to report
            raise RuntimeError(f"the fine-tuning job failed: {progress.error}")
        self.units += 1
        self.unit_s.append(took)
        return took

    def summary(self, tokens: int, seconds: float, units_before: int) -> dict[str, Any]:
        units = self.unit_s[units_before:]
        return {
            "trained_tokens": tokens,
            "seconds": seconds,
            "trained_tokens_per_s": tokens / seconds if seconds > 0 else None,
            "units": len(units),
            "unit_ms_mean": 1000 * sum(units) / len(units) if units else None,
            "unit_ms_max": 1000 * max(units) if units else None,
            "step": self.jobs.progress(self.job_id).step,
        }


def run_job_alone(job: JobClock, seconds: float) -> dict[str, Any]:
    """The job's units back to back, no requests, for `seconds`: its speed alone (idle-sized
    units, as a site runs them with no request in)."""
    before, units_before = job.tokens(), job.units
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        job.run_unit(alone=True)
    elapsed = time.monotonic() - start
    return job.summary(job.tokens() - before, elapsed, units_before)


def drive_with_job(
    engine: PagedEngine,
    interactive: list[tuple[float, EngineRequest]],
    job: tuple[JobClock, IdleGate] | None,
    window_s: float,
    drain_s: float,
) -> tuple[RunResult, dict[str, Any] | None]:
    """Steps the engine until every interactive request is done (or `window_s + drain_s`
    passes), running the job's units in between when `job` is given. Returns the run and the
    job's tokens within the window (None without a job)."""
    pending = sorted(interactive, key=lambda pair: pair[0])
    timings = {request.request_id: _Timing(t) for t, request in pending}
    result = RunResult(0.0, 0, 0, len(pending))
    before = {load.priority: load.num_preemptions for load in engine.stats().by_class}
    clock, gate = (job[0], job[1]) if job is not None else (None, None)
    tokens_at_start = clock.tokens() if clock is not None else 0
    units_at_start = clock.units if clock is not None else 0
    tokens_in_window: int | None = None
    next_arrival, unit_end = 0, time.monotonic()
    start = time.monotonic()
    while True:
        now = time.monotonic() - start
        if clock is not None and tokens_in_window is None and now >= window_s:
            tokens_in_window = clock.tokens() - tokens_at_start
        left = next_arrival < len(pending) or result.interactive_done < len(pending)
        if now > window_s + drain_s or not left:
            break
        while next_arrival < len(pending) and pending[next_arrival][0] <= now:
            engine.add_request(pending[next_arrival][1])
            next_arrival += 1
        if (
            clock is not None
            and gate is not None
            and gate.allows(engine.stats(), clock.next_unit_s(), time.monotonic() - unit_end)
        ):
            clock.run_unit(alone=not engine.has_unfinished())
            unit_end = time.monotonic()
        if not engine.has_unfinished():
            if clock is None and next_arrival < len(pending):
                time.sleep(max(0.0, pending[next_arrival][0] - (time.monotonic() - start)))
            continue
        outputs = engine.step()
        result.steps += 1
        t = time.monotonic() - start
        for output in outputs:
            timing = timings.get(output.request_id)
            if timing is None:
                continue
            result.interactive_tokens_in_window += len(output.new_token_ids) * (t <= window_s)
            if output.new_token_ids:
                timing.first_s = timing.first_s if timing.first_s is not None else t
                timing.last_s = t
                timing.tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                result.interactive_done += 1
    result.clock_s = time.monotonic() - start
    _finish(engine, timings, result, before)
    while engine.has_unfinished():
        engine.step()
    if clock is None:
        return result, None
    if tokens_in_window is None:  # everything finished before the window ended
        # The job ran alone for the rest of the window: the window's figure includes that.
        while time.monotonic() - start < window_s:
            clock.run_unit(alone=True)
        tokens_in_window = clock.tokens() - tokens_at_start
    return result, clock.summary(tokens_in_window, window_s, units_at_start)
