"""A site's fine-tuning jobs: accepted from any thread, read in the background, trained one unit
at a time on the engine's.

`start`, `progress`, `cancel` and `live` run on whatever thread the gRPC handler uses and touch
only the job table (under a lock). `start` checks what it can at once (the directory's bound
too: checkpoint.DirectoryRoom), registers the job and answers; the job's files are saved and
read on a thread of the job's own, the tenants' readings in turns (site_engine/finetune/
reading_turns.py; intake.py reads), which a cancel stops (issue 67: a start that parsed inside
the call outlasted its deadline, was sent again every two minutes, and a cancel during the
parse found nothing to cancel). A job's files wait for their turn on disk, not in memory, and an
ended job's files and checkpoints are cleared (issue 75). A job id the site knows, in whatever
state, is never started again: the gateway's second start of a job is answered ALREADY_EXISTS,
never parsed twice.

`run_unit` runs on the engine's thread between model steps (EngineService asks `has_work` and
calls it when the idle gate allows), so the model is only ever used by that one thread. Tenants
(the gateway's keys) take turns a unit at a time (site_engine/finetune/turns.py), each tenant's
jobs oldest first. A job keeps its trainer between its turns; a trainer is built only when the
reserve holds its LoRA state beside the live trainers' and every live job's largest unit still
fits (memory.py), so turns never take memory the KV cache counted on. A site started over finds
its jobs on disk (site_engine/finetune/checkpoint.py), reads the unfinished ones again and
resumes them from their last checkpoint.
"""

from __future__ import annotations

import gc
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from fedllm_contract.fine_tuning import (
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from site_engine.finetune import FineTuneRefused
from site_engine.finetune import checkpoint as disk
from site_engine.finetune.intake import check_spec
from site_engine.finetune.job_intake import JobIntake
from site_engine.finetune.job_state import FineTuneSettings, Job, PieceRecord, Unit
from site_engine.finetune.memory import (
    TrainingShape,
    largest_unit_tokens,
    longest_example_tokens,
    lora_bytes,
)
from site_engine.finetune.pacing import UnitPacer
from site_engine.finetune.pieces import PieceLedger, PiecewiseRun, decoder_layers
from site_engine.finetune.segment_costs import SegmentCosts
from site_engine.finetune.trainer import LoraTrainer, LossChunks
from site_engine.finetune.turns import TenantTurns

__all__ = ["FineTuneJobs", "FineTuneSettings"]

log = logging.getLogger(__name__)


class FineTuneJobs:
    def __init__(
        self,
        settings: FineTuneSettings,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        wait_for_pieces: bool = False,
    ) -> None:
        """`wait_for_pieces`: the device settled before each piece and the piece waited for
        as it ends, as before pieces were left queued (a bench's arm without the change)."""
        self.settings = settings
        self._model, self._tokenizer, self._model_name = model, tokenizer, model_name
        self._shape = TrainingShape.of_model(model)
        # The longest example the reserve holds for the adapters the gateway asks for (the
        # default rank and projections), in tokens: SiteInfo says it, and the gateway refuses a
        # longer one when the job is made rather than the site failing it after (issue 75).
        self.longest_example = longest_example_tokens(
            self._shape,
            FineTuneHyperparameters(n_epochs=1, batch_size=1, learning_rate_multiplier=1.0),
            settings.reserve_bytes,
            settings.max_tokens,
        )
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}  # insertion order: oldest first
        # One job's files read at a time, tenants in turns; the others wait on disk.
        self._intake = JobIntake(settings, tokenizer, self._shape, self._lock, self._failed)
        self._turns = TenantTurns()
        # The site's speed in seconds per trained token, whichever job measured it.
        self._pacer = UnitPacer(settings.max_step_ms / 1000)
        # What each kind of a unit's segments costs on this site (a layer's forward or
        # backward, a loss chunk...), whichever job measured it: a piece ends before the
        # segment that would take it past the bound.
        self._segments = SegmentCosts()
        # On CUDA a piece's kernels are left queued as it ends (pieces.py: the engine prepares
        # its next step meanwhile); the next call waits for the piece's own end, not the device.
        cuda = next(model.parameters()).device.type == "cuda"
        self._ledger = PieceLedger(self._segments, deferred=cuda and not wait_for_pieces)
        self._settle_first = cuda and wait_for_pieces
        # The device seconds of each piece measured in the last call: a call that ends a unit
        # measures two (the previous call's and its own), and each delayed a different serving
        # step (the benches read it).
        self.pieces_measured_s: list[float] = []
        self._last_piece_s: float | None = None
        self.largest_unit_run = 0  # padded tokens of the largest unit yet (the benches read it)
        self.pieces_run = 0  # calls of run_unit that ran a piece of a unit (the tests read it)
        # Told of every piece run, on the engine's thread (a bench's timeline); None: nothing.
        self.on_piece: Callable[[PieceRecord], None] | None = None
        settings.directory.mkdir(parents=True, exist_ok=True)
        self._load_from_disk()

    # ---- any thread ------------------------------------------------------------------------
    def start(self, spec: FineTuneSpec) -> FineTuneProgress:
        """Checks the spec, registers the job (QUEUED, its steps unknown until its files are
        read) and starts the saving and reading of its files; FineTuneRefused says why not.
        Quick: the files are saved and read on the job's own thread."""
        check_spec(spec, self._model_name, self.settings.max_rank)
        files = len(spec.training_jsonl) + len(spec.validation_jsonl or b"")
        with self._lock:
            known = self._jobs.get(spec.job_id)
            if known is not None:
                raise FineTuneRefused(
                    FineTuneRefused.EXISTS,
                    f"job {spec.job_id!r} exists ({known.progress.state.value}): a job is "
                    "started once",
                )
            self._intake.claim(spec.job_id, files)
            progress = FineTuneProgress(spec.job_id, FineTuneState.QUEUED, 0, 0, 0)
            job = Job(spec.job_id, spec.tenant, spec.hyperparameters, spec.seed, progress)
            self._jobs[spec.job_id] = job
        self._intake.take_in(job, spec)
        log.info("fine-tuning job %s accepted; its files are read in the background", job.job_id)
        return progress

    def progress(self, job_id: str) -> FineTuneProgress:
        with self._lock:
            return self._job(job_id).progress

    def settled(self, job_id: str, timeout_s: float | None = None) -> FineTuneProgress:
        """The job's progress once its files are read (or the reading ended otherwise): what
        the tests and benches wait for before they run its units."""
        with self._lock:
            job = self._job(job_id)
        if not job.settled.wait(timeout_s):
            raise TimeoutError(f"job {job_id!r}: its files were not read in {timeout_s} s")
        return self.progress(job_id)

    def cancel(self, job_id: str) -> FineTuneProgress:
        """Ends a job not yet final: the reading of its files stops, its files and checkpoints
        are cleared, and the engine thread drops its trainer at its next unit."""
        with self._lock:
            job = self._job(job_id)
            if job.progress.state.is_final:
                return job.progress
            job.progress = replace(job.progress, state=FineTuneState.CANCELLED)
            job.stop.set()
            if job.on_disk:
                disk.save_result(self.settings.directory / job_id, job.progress)
            progress, on_disk = job.progress, job.on_disk
        self._intake.wake()
        if on_disk:
            disk.clear_ended(self.settings.directory / job_id)
        return progress

    def live(self) -> list[str]:
        """The jobs not final (queued, being read, training), oldest first."""
        with self._lock:
            return [j.job_id for j in self._jobs.values() if not j.progress.state.is_final]

    def unit_cap(self, job_id: str) -> tuple[int, int]:
        """(the most padded tokens a unit of the job may take within the reserve, its longest
        example's tokens)."""
        with self._lock:
            examples = self._job(job_id).examples
        if examples is None:
            raise FineTuneRefused(FineTuneRefused.PRECONDITION, f"job {job_id!r} is not ready")
        return examples.max_unit_tokens, examples.longest

    def has_work(self) -> bool:
        """A job to train, or an ended one whose trainer or examples the engine thread lets go."""
        with self._lock:
            return any(j.examples is not None or j.trainer is not None for j in self._jobs.values())

    def close(self) -> None:
        """Stops the reading under way and any queued (the site stops: a job read again at its
        next start), without waiting for it."""
        self._intake.close()

    @property
    def ledger(self) -> PieceLedger:
        """Where the pieces' device time is measured (a bench sets its observer)."""
        return self._ledger

    # ---- engine thread ---------------------------------------------------------------------
    def next_unit_s(self) -> float:
        """The seconds the next call of run_unit is expected to take: a unit's, or the piece's
        it will be cut to when that is shorter; infinite while nothing says (no trainer built
        yet, or nothing measured), so the gate runs it only with no request in."""
        job = self._next_job()
        if job is None or job.trainer is None:
            return math.inf
        piece = self._last_piece_s if self._last_piece_s is not None else math.inf
        if job.unit is not None:
            return piece
        budget = self._pacer.next_budget(self._unit_cap(job))
        tokens = job.trainer.next_unit_tokens(budget)
        return min(self._pacer.predict_s(tokens), piece) if tokens else 0.0

    def unit_budget(self) -> int | None:
        """The token budget of the unit under way (None: none is), the benches' and tests'
        view of how the unit was sized."""
        with self._lock:
            under_way = [j.unit for j in self._jobs.values() if j.trainable and j.unit]
        return under_way[0].budget if under_way else None

    def run_unit(self, alone: bool = False, rows: int | None = None) -> float:
        """Runs one piece of a unit of the job whose turn it is; returns the seconds it took.
        `alone`: no request waits or runs, so a unit begun now is idle-sized (up to
        idle_unit_tokens) instead of sized to the time bound; its pieces stay bounded, so a
        request arriving meanwhile waits for one piece, not for the unit. `rows`: the training
        rows a serving step leaves room for (site_engine/finetune/step_rows.py): a unit begun
        now takes that many padded tokens (one whole example at least) instead of the pacer's
        budget. Returns the device seconds of the pieces measured in the call: on a CPU its
        own piece; on CUDA the previous call's, whose end it waits for first (not the device's:
        a serving step queued after it goes on), and its own only when it ended a unit. A call
        that built a trainer instead returns the build's time."""
        self.pieces_measured_s = []
        self._take_pieces(wait=True)
        if self._settle_first:
            torch.cuda.synchronize()
        began = time.monotonic()
        with self._lock:
            ended = [
                j
                for j in self._jobs.values()
                if j.progress.state.is_final and (j.trainer is not None or j.examples is not None)
            ]
        for done in ended:  # cancelled since their last unit, or just ended
            done.drop_trainer()
            done.examples = None  # a large file's examples are not kept past the job
            if done.on_disk:  # a checkpoint its last unit wrote after a cancel, say
                disk.clear_ended(self.settings.directory / done.job_id)
        job, built = self._next_job(), False
        if job is not None:
            try:
                built = self._advance(job, alone, rows)
            except Exception as exc:  # the job fails; the site serves on
                log.exception("fine-tuning job %s failed", job.job_id)
                self._finish(job, FineTuneState.FAILED, error=f"{type(exc).__name__}: {exc}")
        self._take_pieces(wait=False)
        return time.monotonic() - began if built else sum(self.pieces_measured_s)

    def _take_pieces(self, wait: bool) -> None:
        """The ledger's measured pieces: each one's seconds counted in its unit's time (while
        the unit is under way: a unit's end takes its last piece first) and the call's."""
        with self._lock:
            units = [j.unit for j in self._jobs.values() if j.unit is not None]
        for owner, seconds in self._ledger.take(wait):
            self.pieces_measured_s.append(seconds)
            self._last_piece_s = seconds
            for unit in units:
                if unit.pieces is owner:
                    unit.seconds += seconds

    def _next_job(self) -> Job | None:
        """The job a unit under way belongs to; else the first in the tenants' turn whose
        trainer is live or fits beside the live ones."""
        with self._lock:
            ready = [j for j in self._jobs.values() if j.trainable]
        under_way = next((j for j in ready if j.unit is not None), None)
        if under_way is not None:
            return under_way
        live = [j for j in ready if j.trainer is not None]
        for job in self._turns.order(ready, lambda j: j.tenant):
            if job.trainer is not None or self._fits([*live, job]):
                return job
        return None

    def _cap(self, job: Job, live: list[Job]) -> int:
        """The most padded tokens a unit of `job` may take beside the LoRA state of `live`."""
        assert job.examples is not None
        others = sum(lora_bytes(self._shape, j.hyperparameters) for j in live if j is not job)
        room = self.settings.reserve_bytes - others
        return largest_unit_tokens(self._shape, job.hyperparameters, job.examples.longest, room)

    def _fits(self, live: list[Job]) -> bool:
        return all(self._cap(job, live) >= 1 for job in live)

    def _unit_cap(self, job: Job) -> int:
        with self._lock:
            live = [j for j in self._jobs.values() if j.trainer is not None or j is job]
        return max(1, self._cap(job, live))

    def _advance(self, job: Job, alone: bool, rows: int | None = None) -> bool:
        """One piece of the job's current unit (a new unit first if none is under way); the
        trainer's build is a call of its own (True: this call built it)."""
        job_dir = self.settings.directory / job.job_id
        if job.trainer is None:
            self._turns.served(job.tenant)
            job.trainer = self._build_trainer(job, job_dir)
            # The build made the trainer's module tree, thousands of objects: the collector's
            # next full pass would walk them all, wherever it falls (inside a bounded piece, or a
            # serving step). Collected here, in the build's own unbounded call.
            gc.collect()
            self._publish(job, FineTuneState.RUNNING)  # from its checkpoint's step, if resumed
            return True
        trainer = job.trainer
        if job.unit is None:
            self._turns.served(job.tenant)
            cap = self._unit_cap(job)
            if rows is not None:
                budget = max(1, min(rows, cap))
            elif alone:
                budget = min(self.settings.idle_unit_tokens, cap)
            else:
                budget = self._pacer.next_budget(cap)
            # `run` is bound before its thread starts, so the work may mark boundaries on it.
            run: PiecewiseRun[int] = PiecewiseRun(
                lambda: trainer.work(budget, run.pause),
                decoder_layers(trainer.model),
                self._segments,
                self.settings.max_step_ms / 1000,
                lambda: math.prod(trainer.unit_shape),
                trainer.model.get_input_embeddings(),
                self._ledger,
            )
            # Validation has no backward: a third of a training unit's cost.
            job.unit = Unit(run, budget, trainer.history.step, trainer.validating, alone)
        unit = job.unit
        first = unit.pieces_run == 0
        began = time.monotonic()
        done = unit.pieces.step()
        took = time.monotonic() - began
        if self.on_piece is not None:
            shape, step = trainer.unit_shape, trainer.history.step
            self.on_piece(PieceRecord(job.job_id, took, unit.pieces.last_piece_boundaries,
                                      unit.pieces.ended_at, first, done, unit.budget, shape,
                                      unit.validating, step))  # fmt: skip
        self.pieces_run += 1
        unit.pieces_run += 1
        if not done:
            return False
        self._take_pieces(wait=True)  # its last piece, before job.unit lets it go
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
        return False

    def _build_trainer(self, job: Job, job_dir: Path) -> LoraTrainer:
        assert job.examples is not None
        examples = job.examples
        trainer = LoraTrainer(
            self._model, job.hyperparameters, job.seed, examples.train, examples.validation
        )
        # A loss chunk lies between two boundaries of a piece: half the bound at most.
        trainer.loss_chunks = LossChunks(self.settings.max_step_ms / 2000)
        steps = disk.checkpoint_steps(job_dir)
        if steps:
            disk.restore_checkpoint(job_dir, steps[-1], trainer)
            log.info("fine-tuning job %s resumed from step %d", job.job_id, steps[-1])
        return trainer

    def _publish(self, job: Job, state: FineTuneState) -> None:
        assert job.trainer is not None
        history = job.trainer.history
        job_dir = self.settings.directory / job.job_id
        losses = dict(history.losses)
        with self._lock:
            if job.progress.state.is_final:
                return  # cancelled meanwhile
            job.progress = replace(
                job.progress,
                state=state,
                step=history.step,
                trained_tokens=history.trained_tokens,
                losses=tuple(job.trainer.reported_losses()),
                validation_losses=tuple(history.validation_losses),
                checkpoints=tuple(
                    disk.checkpoint_record(job_dir, s, losses)
                    for s in disk.checkpoint_steps(job_dir)
                ),
            )

    def _failed(self, job: Job, error: str) -> None:
        self._finish(job, FineTuneState.FAILED, error=error)

    def _finish(self, job: Job, state: FineTuneState, **fields: str) -> None:
        job_dir = self.settings.directory / job.job_id
        with self._lock:
            if not job.progress.state.is_final:
                job.progress = replace(job.progress, state=state, **fields)  # type: ignore[arg-type]
                if job.on_disk:
                    disk.save_result(job_dir, job.progress)
        job.drop_trainer()
        if job.on_disk:
            disk.clear_ended(job_dir)
        log.info("fine-tuning job %s %s", job.job_id, job.progress.state.value)

    # ---- helpers ---------------------------------------------------------------------------
    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise FineTuneRefused(FineTuneRefused.NOT_FOUND, f"no fine-tuning job {job_id!r}")
        return job

    def _load_from_disk(self) -> None:
        """Registers the jobs on disk: an ended one with its result, an unfinished one read
        again on the intake thread (then resumed from its last checkpoint)."""
        for job_dir in sorted(self.settings.directory.iterdir(), key=lambda p: p.stat().st_mtime):
            if job_dir.name.startswith(".tmp-"):
                shutil.rmtree(job_dir, ignore_errors=True)
                continue
            if not (job_dir / disk.SPEC_FILE).is_file():
                continue
            for stale in job_dir.glob(".tmp-*"):  # a write the previous run did not finish
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
            meta = disk.load_meta(job_dir)
            result = disk.load_result(job_dir)
            queued = FineTuneProgress(meta.job_id, FineTuneState.QUEUED, 0, 0, 0)
            job = Job(meta.job_id, meta.tenant, meta.hyperparameters, meta.seed,
                      result or queued, on_disk=True)  # fmt: skip
            self._jobs[meta.job_id] = job
            if result is not None and result.state.is_final:
                disk.clear_ended(job_dir)  # left by a site that kept ended jobs' files
                job.settled.set()
                continue
            log.info("fine-tuning job %s found on disk: it resumes", meta.job_id)
            self._intake.take_in(job, None)
