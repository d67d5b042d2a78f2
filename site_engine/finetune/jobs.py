"""A site's fine-tuning jobs: accepted from any thread, trained one unit at a time on the engine's.

Jobs train one at a time, oldest first. `start`, `progress` and `cancel` run on whatever thread
the gRPC handler uses and touch only the job table (under a lock); `run_unit` runs on the
engine's thread between model steps (EngineService asks `has_work` and calls it when the idle
gate allows), so the model is only ever used by that one thread. A site started over finds its
jobs on disk (site_engine/finetune/checkpoint.py) and resumes the unfinished ones from their last
checkpoint.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn
from transformers import PreTrainedTokenizerBase

from fedllm_contract.fine_tuning import FineTuneProgress, FineTuneSpec, FineTuneState
from site_engine.engine.lora.adapter import PROJECTIONS
from site_engine.finetune import FineTuneRefused
from site_engine.finetune import checkpoint as disk
from site_engine.finetune.data import Example, TrainingDataError, encode_file
from site_engine.finetune.memory import TrainingShape, largest_unit_tokens
from site_engine.finetune.pacing import UnitPacer
from site_engine.finetune.pieces import PieceSizer, PiecewiseRun, decoder_layers
from site_engine.finetune.trainer import LoraTrainer, LossChunks, steps_per_epoch

log = logging.getLogger(__name__)
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


@dataclass(frozen=True, slots=True)
class FineTuneSettings:
    """Where jobs live, the memory reserved for training, how often to checkpoint, how long one
    piece of training may hold the engine's loop, and how large a unit is with nothing else in."""

    directory: Path
    reserve_bytes: int
    checkpoint_every: int = 10
    max_step_ms: float = 200.0
    max_tokens: int = 1024  # an example's tokens at most (longer ones lose their end)
    # The largest rank this site serves (SITE_MAX_LORA_RANK): a job's adapter must be servable.
    max_rank: int = 64
    # A unit's padded tokens at most while no request waits or runs (the reserve's cap too):
    # no time bound then, since a unit's pieces still hand the loop back within the bound.
    idle_unit_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.reserve_bytes <= 0 or self.checkpoint_every < 1 or not self.max_step_ms > 0:
            raise ValueError(
                "fine-tuning needs reserve_bytes > 0, checkpoint_every >= 1 and max_step_ms > 0"
            )
        if self.idle_unit_tokens < 1:
            raise ValueError(f"idle_unit_tokens must be >= 1, not {self.idle_unit_tokens}")


@dataclass(slots=True)
class _Unit:
    """A unit of training under way, run a piece at a time (site_engine/finetune/pieces.py)."""

    pieces: PiecewiseRun[int]
    budget: int
    step: int  # the trainer's step when it began
    validating: bool
    alone: bool  # sized for an engine with no request in (idle_unit_tokens, no time bound)
    seconds: float = 0.0  # its pieces' time so far


@dataclass(slots=True)
class _Job:
    spec: FineTuneSpec
    train: list[Example]
    validation: list[Example]
    max_unit_tokens: int  # the most padded tokens a unit may take within the reserve
    progress: FineTuneProgress
    trainer: LoraTrainer | None = None
    unit: _Unit | None = None

    def drop_trainer(self) -> None:
        if self.unit is not None:
            self.unit.pieces.abandon()
            self.unit = None
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


class FineTuneJobs:
    def __init__(
        self,
        settings: FineTuneSettings,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
    ) -> None:
        self.settings = settings
        self._model, self._tokenizer, self._model_name = model, tokenizer, model_name
        self._shape = TrainingShape.of_model(model)
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # insertion order: oldest first
        # The site's speed in seconds per trained token, whichever job measured it.
        self._pacer = UnitPacer(settings.max_step_ms / 1000)
        # How many layer boundaries a piece of a unit crosses to stay within the bound.
        self._pieces = PieceSizer(settings.max_step_ms / 1000)
        self.largest_unit_run = 0  # padded tokens of the largest unit yet (the benches read it)
        self.pieces_run = 0  # calls of run_unit that ran a piece of a unit (the tests read it)
        settings.directory.mkdir(parents=True, exist_ok=True)
        self._load_from_disk()

    # ---- any thread ------------------------------------------------------------------------
    def start(self, spec: FineTuneSpec) -> FineTuneProgress:
        """Checks, persists and queues a job; FineTuneRefused says why not."""
        if spec.base_model != self._model_name:
            raise FineTuneRefused(
                FineTuneRefused.INVALID,
                f"this site serves {self._model_name!r}, not the job's base {spec.base_model!r}",
            )
        if not _JOB_ID.match(spec.job_id):
            raise FineTuneRefused(FineTuneRefused.INVALID, f"bad job id {spec.job_id!r}")
        if spec.hyperparameters.lora_rank > self.settings.max_rank:
            raise FineTuneRefused(
                FineTuneRefused.INVALID,
                f"lora_rank {spec.hyperparameters.lora_rank} is above the largest rank this site "
                f"serves ({self.settings.max_rank}, SITE_MAX_LORA_RANK)",
            )
        unknown = set(spec.hyperparameters.target_modules) - set(PROJECTIONS)
        if unknown:
            raise FineTuneRefused(
                FineTuneRefused.INVALID,
                f"target_modules {sorted(unknown)}: LoRA is served on {', '.join(PROJECTIONS)}",
            )
        with self._lock:
            if spec.job_id in self._jobs:
                raise FineTuneRefused(FineTuneRefused.EXISTS, f"job {spec.job_id!r} exists")
        job = self._prepare(spec)
        disk.save_spec(self.settings.directory / spec.job_id, spec)
        with self._lock:
            self._jobs[spec.job_id] = job
        log.info("fine-tuning job %s queued: %d steps", spec.job_id, job.progress.total_steps)
        return job.progress

    def progress(self, job_id: str) -> FineTuneProgress:
        with self._lock:
            return self._job(job_id).progress

    def cancel(self, job_id: str) -> FineTuneProgress:
        """Ends a job not yet final (the engine thread drops its trainer at its next unit)."""
        with self._lock:
            job = self._job(job_id)
            if not job.progress.state.is_final:
                job.progress = replace(job.progress, state=FineTuneState.CANCELLED)
                disk.save_result(self.settings.directory / job_id, job.progress)
            return job.progress

    def unit_cap(self, job_id: str) -> tuple[int, int]:
        """(the most padded tokens a unit of the job may take within the reserve, its longest
        example's tokens)."""
        with self._lock:
            job = self._job(job_id)
            return job.max_unit_tokens, max(len(e.input_ids) for e in job.train + job.validation)

    def has_work(self) -> bool:
        with self._lock:
            return any(not j.progress.state.is_final or j.trainer for j in self._jobs.values())

    # ---- engine thread ---------------------------------------------------------------------
    def next_unit_s(self) -> float:
        """The seconds the next call of run_unit is expected to take: a unit's, or the piece's
        it will be cut to when that is shorter; infinite while nothing says (no trainer built
        yet, or nothing measured), so the gate runs it only with no request in."""
        with self._lock:
            job = next((j for j in self._jobs.values() if not j.progress.state.is_final), None)
        if job is None or job.trainer is None:
            return math.inf
        piece = self._pieces.piece_s if self._pieces.piece_s is not None else math.inf
        if job.unit is not None:
            return piece
        tokens = job.trainer.next_unit_tokens(self._pacer.next_budget(job.max_unit_tokens))
        return min(self._pacer.predict_s(tokens), piece) if tokens else 0.0

    def unit_budget(self) -> int | None:
        """The token budget of the unit under way (None: none is), the benches' and tests'
        view of how the unit was sized."""
        with self._lock:
            job = next((j for j in self._jobs.values() if not j.progress.state.is_final), None)
        return job.unit.budget if job is not None and job.unit is not None else None

    def run_unit(self, alone: bool = False) -> float:
        """Runs one piece of the oldest unfinished job's unit; returns the seconds it took.
        `alone`: no request waits or runs, so a unit begun now is idle-sized (up to
        idle_unit_tokens) instead of sized to the time bound; its pieces stay bounded, so a
        request arriving meanwhile waits for one piece, not for the unit."""
        began = time.monotonic()
        with self._lock:
            job = next((j for j in self._jobs.values() if not j.progress.state.is_final), None)
            ended = [j for j in self._jobs.values() if j.progress.state.is_final and j.trainer]
        for done in ended:  # cancelled since their last unit
            done.drop_trainer()
        if job is not None:
            try:
                self._advance(job, alone)
            except Exception as exc:  # the job fails; the site serves on
                log.exception("fine-tuning job %s failed", job.spec.job_id)
                self._finish(job, FineTuneState.FAILED, error=f"{type(exc).__name__}: {exc}")
        return time.monotonic() - began

    def _advance(self, job: _Job, alone: bool) -> None:
        """One piece of the job's current unit (a new unit first if none is under way); the
        trainer's build is a call of its own."""
        job_dir = self.settings.directory / job.spec.job_id
        if job.trainer is None:
            job.trainer = self._build_trainer(job, job_dir)
            self._publish(job, FineTuneState.RUNNING)  # from its checkpoint's step, if resumed
            return
        trainer = job.trainer
        if job.unit is None:
            if alone:
                budget = min(self.settings.idle_unit_tokens, job.max_unit_tokens)
            else:
                budget = self._pacer.next_budget(job.max_unit_tokens)
            # `run` is bound before its thread starts, so the work may mark boundaries on it.
            run: PiecewiseRun[int] = PiecewiseRun(
                lambda: trainer.work(budget, run.pause),
                decoder_layers(trainer.model),
                self._pieces.boundaries,
                self.settings.max_step_ms / 1000,
            )
            # Validation has no backward: a third of a training unit's cost.
            job.unit = _Unit(run, budget, trainer.history.step, trainer.validating, alone)
        unit = job.unit
        began = time.monotonic()
        done = unit.pieces.step()
        took = time.monotonic() - began
        self.pieces_run += 1
        unit.seconds += took
        self._pieces.observe(unit.pieces.last_piece_boundaries, took)
        if not done:
            return
        job.unit = None
        tokens = unit.pieces.result()
        self.largest_unit_run = max(self.largest_unit_run, tokens)
        # The optimizer step is in its unit's time. An idle-sized unit spreads the fixed cost
        # of a unit over many more tokens than a bounded one: its seconds per token would size
        # the bounded units too large, so the pacer learns from bounded units only.
        if tokens and not unit.validating and not unit.alone:
            self._pacer.observe(unit.budget, tokens, unit.seconds)
        stepped = trainer.history.step > unit.step
        if stepped and trainer.history.step % self.settings.checkpoint_every == 0:
            disk.save_checkpoint(job_dir, trainer)
        if trainer.finished:
            adapter = disk.save_adapter(job_dir, trainer)
            self._publish(job, FineTuneState.RUNNING)
            self._finish(job, FineTuneState.SUCCEEDED, adapter_path=str(adapter))
        else:
            self._publish(job, FineTuneState.RUNNING)

    def _build_trainer(self, job: _Job, job_dir: Path) -> LoraTrainer:
        spec = job.spec
        trainer = LoraTrainer(
            self._model, spec.hyperparameters, spec.seed, job.train, job.validation
        )
        # A loss chunk lies between two boundaries of a piece: half the bound at most.
        trainer.loss_chunks = LossChunks(self.settings.max_step_ms / 2000)
        steps = disk.checkpoint_steps(job_dir)
        if steps:
            disk.restore_checkpoint(job_dir, steps[-1], trainer)
            log.info("fine-tuning job %s resumed from step %d", spec.job_id, steps[-1])
        return trainer

    def _publish(self, job: _Job, state: FineTuneState) -> None:
        assert job.trainer is not None
        history = job.trainer.history
        job_dir = self.settings.directory / job.spec.job_id
        losses = dict(history.losses)
        with self._lock:
            if job.progress.state.is_final:
                return  # cancelled meanwhile
            job.progress = replace(
                job.progress,
                state=state,
                step=history.step,
                trained_tokens=history.trained_tokens,
                losses=tuple(history.losses),
                validation_losses=tuple(history.validation_losses),
                checkpoints=tuple(
                    disk.checkpoint_record(job_dir, s, losses)
                    for s in disk.checkpoint_steps(job_dir)
                ),
            )

    def _finish(self, job: _Job, state: FineTuneState, **fields: str) -> None:
        with self._lock:
            if not job.progress.state.is_final:
                job.progress = replace(job.progress, state=state, **fields)  # type: ignore[arg-type]
                disk.save_result(self.settings.directory / job.spec.job_id, job.progress)
        job.drop_trainer()
        log.info("fine-tuning job %s %s", job.spec.job_id, job.progress.state.value)

    # ---- helpers ---------------------------------------------------------------------------
    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise FineTuneRefused(FineTuneRefused.NOT_FOUND, f"no fine-tuning job {job_id!r}")
        return job

    def _prepare(self, spec: FineTuneSpec) -> _Job:
        """Encodes the files and caps a unit's tokens by the reserve; FineTuneRefused if they
        cannot train."""
        limit = self.settings.max_tokens
        try:
            train = encode_file(self._tokenizer, spec.training_jsonl, limit)
            validation = (
                encode_file(self._tokenizer, spec.validation_jsonl, limit)
                if spec.validation_jsonl is not None
                else []
            )
        except (TrainingDataError, UnicodeDecodeError) as exc:
            raise FineTuneRefused(FineTuneRefused.INVALID, f"training data: {exc}") from exc
        hp = spec.hyperparameters
        longest = max(len(e.input_ids) for e in train + validation)
        most = largest_unit_tokens(self._shape, hp, longest, self.settings.reserve_bytes)
        if most < 1:
            raise FineTuneRefused(
                FineTuneRefused.PRECONDITION,
                f"one example of {longest} tokens needs more than this site's fine-tuning "
                f"reserve of {self.settings.reserve_bytes:,} bytes (SITE_FINETUNE_RESERVE_BYTES)",
            )
        total = steps_per_epoch(len(train), hp.batch_size) * hp.n_epochs
        progress = FineTuneProgress(spec.job_id, FineTuneState.QUEUED, 0, total, 0)
        return _Job(spec, train, validation, most, progress)

    def _load_from_disk(self) -> None:
        for job_dir in sorted(self.settings.directory.iterdir(), key=lambda p: p.stat().st_mtime):
            if job_dir.name.startswith(".tmp-"):
                shutil.rmtree(job_dir, ignore_errors=True)
                continue
            if not (job_dir / "spec.json").is_file():
                continue
            for stale in job_dir.glob(".tmp-*"):  # a write the previous run did not finish
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
            spec = disk.load_spec(job_dir)
            try:
                job = self._prepare(spec)
            except FineTuneRefused as exc:
                log.error("fine-tuning job %s on disk cannot run here: %s", spec.job_id, exc)
                continue
            result = disk.load_result(job_dir)
            if result is not None:
                job.progress = result
            self._jobs[spec.job_id] = job
            if result is None:
                log.info("fine-tuning job %s found on disk: it resumes", spec.job_id)
