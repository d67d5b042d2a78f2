"""What the retrain command does (gateway/retrain_predictor.py parses its flags): adapt one
predictor from the collected samples, run a queued retrain job and record its result, or retrain
every model whose rolling error has drifted.

It sits with the entry points because it trains (torch, scikit-learn): the serving gateway never
imports it, and runs a job only through a subprocess of the command (gateway/admin/
retrain_worker.py), so the event loop keeps serving while a candidate trains.
"""

from __future__ import annotations

import asyncio
import os
import re
import traceback
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fedllm_contract.env_settings import build, read_env
from gateway.admin.predictor_health import error_json, rule_of
from gateway.drift_settings import DriftSettings
from gateway.prediction.drift import rolling_error
from gateway.prediction.lifecycle import register_artifact
from gateway.stores.length_samples import count_samples, load_samples
from gateway.stores.predictor_error import served_windows
from gateway.stores.predictor_registry import DEFAULT_MODEL, PredictorRegistry
from gateway.stores.retrain_jobs import JobAlreadyOpen, JobRecord, RetrainJobStore

if TYPE_CHECKING:
    from predictor.retrain import RetrainReport

Sessions = async_sessionmaker[AsyncSession]


class RunRefused(Exception):
    """Nothing was trained: no version to start from, or too few samples."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class AdaptOptions:
    mode: str = "calibrate"
    activate: str = "if-better"
    out: Path | None = None
    base: Path | None = None
    mix_base_data: bool = False
    include_censored: bool = False
    min_samples: int = 50
    gate_fraction: float = 0.2
    # Learn from the newest this many samples only (0: all): after a mix shift, the old mix
    # outvotes the new one in every sample the gateway ever collected.
    max_samples: int = 0


@dataclass(frozen=True, slots=True)
class Adapted:
    version: str
    activated: bool
    decision: dict[str, object]


def default_out(label: str, parent: Path | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    return (parent or Path("var/predictor")) / f"{safe}-{datetime.now(UTC):%Y%m%dT%H%M%S%f}"


def under(parent: Path | None, options: AdaptOptions, job: JobRecord) -> AdaptOptions:
    """Options for one of several jobs: each writes its own directory under `parent`."""
    return replace(options, out=default_out(f"job{job.id}-{job.model}", parent))


async def adapt(sessions: Sessions, model: str | None, options: AdaptOptions) -> Adapted:
    """Builds, gates and registers a candidate for `model` (None: the default predictor, on
    every model's samples); RunRefused when there is nothing to train."""
    registry = PredictorRegistry(sessions)
    key = model or DEFAULT_MODEL
    active = await registry.active(key) or await registry.active(DEFAULT_MODEL)
    base = options.base or (Path(active.path) if active else None)
    if base is None:
        raise RunRefused("no active predictor version to start from; pass --base", 2)
    counts = await count_samples(sessions, model)
    samples = await load_samples(
        sessions,
        model=model,
        include_censored=options.include_censored,
        limit=options.max_samples or None,
    )
    print(f"{counts.total} samples collected ({counts.censored} censored); using {len(samples)}",
          flush=True)  # fmt: skip
    if len(samples) < options.min_samples:
        raise RunRefused(f"{len(samples)} samples < --min-samples {options.min_samples}", 1)
    out = options.out or default_out(f"retrain-{model}" if model else "retrain")
    report = await asyncio.to_thread(_retrain, samples, base, out, options)
    for name, scores in [("candidate", report.new), *report.decision.rivals.items()]:
        print(
            f"  {name:<12} MAE {scores.mae_tokens:7.1f}  Spearman {scores.spearman:6.3f}  "
            f"p90 coverage {scores.p90_coverage:.2f}  ({scores.samples} gate samples)"
        )
    print(f"{report.new_version}: {report.reason}", flush=True)
    activate = options.activate == "always" or (options.activate == "if-better" and report.better)
    decision = report.decision.to_json() | {"mode": report.mode, "activated_by": options.activate}
    await register_artifact(registry, out, model=key, activate=activate, decision=decision)
    print(f"registered {report.new_version} ({'active' if activate else 'not activated'})")
    return Adapted(report.new_version, activate, decision)


def _retrain(
    samples: list[tuple[str, int]], base: Path, out: Path, options: AdaptOptions
) -> RetrainReport:
    # Imported here: training pulls in torch, which the gateway itself never loads.
    from predictor.retrain import retrain

    return retrain(
        samples,
        base,
        out,
        mode=options.mode,  # type: ignore[arg-type]
        mix_base_data=options.mix_base_data,
        gate_fraction=options.gate_fraction,
    )


async def run_claimed(
    jobs: RetrainJobStore, sessions: Sessions, job: JobRecord, options: AdaptOptions
) -> bool:
    """Runs a job already marked running, in the job's mode and for its model, and records
    what came of it: done with the version and the gate's decision, or failed with why."""
    print(f"retrain job {job.id}: model {job.model!r}, {job.mode} ({job.reason})", flush=True)
    out = options.out or default_out(f"job{job.id}-{job.model}")
    chosen = replace(options, mode=job.mode, out=out)
    try:
        adapted = await adapt(sessions, job.model, chosen)
    except Exception as exc:  # recorded, not lost: the job's row says why
        detail = str(exc) if isinstance(exc, RunRefused) else traceback.format_exc()
        await jobs.fail(job.id, detail)
        print(f"retrain job {job.id} failed: {exc}", flush=True)
        return False
    await jobs.finish(
        job.id, version=adapted.version, activated=adapted.activated, decision=adapted.decision
    )
    return True


async def retrain_drifted(sessions: Sessions, options: AdaptOptions, model: str | None) -> int:
    """Judges every model with samples (or `model`) by the GATEWAY_DRIFT_* settings and runs a
    drift job for each drifted one; 0 when every job it ran finished (or none was needed)."""
    settings = build(DriftSettings, read_env(DriftSettings, os.environ))
    since = None
    if settings.window_s > 0:
        since = datetime.now(UTC) - timedelta(seconds=settings.window_s)
    windows = await served_windows(
        sessions,
        window_samples=settings.window_samples,
        since=since,
        include_censored=settings.include_censored,
    )
    rule, jobs, failures = rule_of(settings), RetrainJobStore(sessions), 0
    for name in sorted(windows) if model is None else [model]:
        window = windows.get(name)
        error = rolling_error(window.pairs) if window is not None else None
        drifted, reason = rule.verdict(error)
        print(f"{name}: {'drifted' if drifted else 'not drifted'} ({reason})", flush=True)
        if not drifted or window is None:
            continue
        drift = {"version": window.version, "reason": reason, **(error_json(error) or {})}
        try:
            queued = await jobs.enqueue(name, reason="drift", mode=options.mode, drift=drift)
        except JobAlreadyOpen as exc:
            print(f"  skipped: {exc}", flush=True)
            continue
        claimed = await jobs.claim(queued.id)
        each = under(options.out, options, queued)
        if claimed is not None and not await run_claimed(jobs, sessions, claimed, each):
            failures += 1
    return 1 if failures else 0
