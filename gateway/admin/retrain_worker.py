"""Runs queued retrain jobs, one at a time, each in a subprocess of the retrain command.

A subprocess, not a thread: training loads torch and scikit-learn, which the serving gateway
never imports, takes CPU for seconds to minutes that the event loop must not lose, and may fail
in ways (out of memory, a crash in native code) that must not take the gateway with it. The
command records the job's result itself (gateway/retrain_runs.py); when it dies first, the
worker records the job as failed with the end of its output, so a failure is never lost. A job
left running by a gateway that died is failed after GATEWAY_RETRAIN_JOB_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Sequence
from datetime import timedelta

from gateway.db.models import utcnow
from gateway.drift_settings import RetrainSettings
from gateway.stores.retrain_jobs import JobRecord, RetrainJobStore

log = logging.getLogger(__name__)
OUTPUT_TAIL_CHARS = 2000
# A running job counts as abandoned this long after its timeout (its own worker fails it first).
STALE_MARGIN_S = 60.0


RETRAIN_COMMAND = (sys.executable, "-m", "gateway.retrain_predictor")
# What a job imports (predictor.retrain): without them every job would fail, so a gateway that
# lacks them leaves the queue to a trainer that has them.
TRAINING_STACK = ("torch", "sklearn")


def missing_training_stack(modules: Sequence[str] = TRAINING_STACK) -> list[str]:
    """The training packages this interpreter cannot import (looked up, not imported)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def job_arguments(job: JobRecord, settings: RetrainSettings) -> list[str]:
    safe_model = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.model)
    out = settings.out_dir / f"job{job.id}-{safe_model}-{utcnow():%Y%m%dT%H%M%S}"
    arguments = ["--job", str(job.id), "--claimed", "--out", str(out),
                 "--min-samples", str(settings.min_samples),
                 "--max-samples", str(settings.max_samples)]  # fmt: skip
    return [*arguments, "--include-censored"] if settings.include_censored else arguments


class RetrainWorker:
    def __init__(
        self,
        jobs: RetrainJobStore,
        settings: RetrainSettings,
        database_url: str,
        command: Sequence[str] | None = None,
    ) -> None:
        self._jobs = jobs
        self._settings = settings
        self._database_url = database_url
        # The program that runs a job, given its arguments (tests swap in one that crashes).
        self._command = list(command or RETRAIN_COMMAND)
        self.current: JobRecord | None = None

    async def run(self) -> None:
        while True:
            try:
                while await self.run_once() is not None:
                    pass
            except Exception:  # the queue stays; the next round tries again
                log.exception("retrain worker: could not run a queued job")
            await asyncio.sleep(self._settings.poll_s)

    async def run_once(self) -> JobRecord | None:
        """Claims the oldest queued job and runs it to its end; None when none was queued."""
        stale = utcnow() - timedelta(seconds=self._settings.job_timeout_s + STALE_MARGIN_S)
        if failed := await self._jobs.fail_stale(stale):
            log.warning("retrain worker: %d abandoned job(s) recorded as failed", failed)
        job = await self._jobs.claim()
        if job is None:
            return None
        self.current = job
        try:
            await self._execute(job)
        finally:
            self.current = None
        return await self._jobs.get(job.id)

    async def _execute(self, job: JobRecord) -> None:
        command = [*self._command, *job_arguments(job, self._settings)]
        env = {**os.environ, "GATEWAY_DATABASE_URL": self._database_url}
        log.info("retrain job %d (model %s, %s) started", job.id, job.model, job.mode)
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), self._settings.job_timeout_s)
        except TimeoutError:
            await _stop(process)
            await self._jobs.fail(job.id, f"timed out after {self._settings.job_timeout_s:.0f} s")
            return
        except asyncio.CancelledError:  # the gateway is stopping: the job does not survive it
            await _stop(process)
            await self._jobs.fail(job.id, "stopped: the gateway shut down while it ran")
            raise
        text = output.decode(errors="replace")
        if process.returncode != 0:
            # A no-op when the command recorded its own failure; else (a crash) this is the record.
            tail = text[-OUTPUT_TAIL_CHARS:]
            await self._jobs.fail(job.id, f"exit status {process.returncode}: {tail}")
        log.info("retrain job %d ended (exit status %s)", job.id, process.returncode)


async def _stop(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()
