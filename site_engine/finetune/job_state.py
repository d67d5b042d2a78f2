"""What a site holds of one fine-tuning job (site_engine/finetune/jobs.py keeps the table of
them), and the settings every job of the site shares."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneProgress
from site_engine.finetune.intake import Examples
from site_engine.finetune.pieces import PiecewiseRun
from site_engine.finetune.trainer import LoraTrainer

# The jobs' directory's bound unless the site says otherwise (SITE_FINETUNE_DIR_MAX_BYTES's).
DEFAULT_MAX_DIR_BYTES = 8 << 30


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
    # What the jobs' directory may hold: a job whose files would take it past is refused at
    # its start (checkpoint.DirectoryRoom).
    max_dir_bytes: int = DEFAULT_MAX_DIR_BYTES

    def __post_init__(self) -> None:
        if self.reserve_bytes <= 0 or self.checkpoint_every < 1 or not self.max_step_ms > 0:
            raise ValueError(
                "fine-tuning needs reserve_bytes > 0, checkpoint_every >= 1 and max_step_ms > 0"
            )
        if self.idle_unit_tokens < 1:
            raise ValueError(f"idle_unit_tokens must be >= 1, not {self.idle_unit_tokens}")
        if self.max_dir_bytes < 1:
            raise ValueError(f"max_dir_bytes must be >= 1, not {self.max_dir_bytes}")


@dataclass(slots=True)
class Unit:
    """A unit of training under way, run a piece at a time (site_engine/finetune/pieces.py)."""

    pieces: PiecewiseRun[int]
    budget: int
    step: int  # the trainer's step when it began
    validating: bool
    alone: bool  # sized for an engine with no request in (idle_unit_tokens, no time bound)
    seconds: float = 0.0  # its pieces' device time so far (as the ledger measures them)
    pieces_run: int = 0


@dataclass(frozen=True, slots=True)
class PieceRecord:
    """One piece of a unit as run (FineTuneJobs.on_piece): what a timeline of the training
    beside serving needs to name the cause of a long piece (bench/engine/finetune_timeline.py)."""

    job_id: str
    seconds: float  # the host's time of the piece's turn (on CUDA its launches, not the device's)
    boundaries: int
    ended_at: str  # PiecewiseRun.ended_at
    first_piece: bool  # the unit's first: its batch padded and copied to the device
    unit_done: bool
    unit_budget: int
    unit_shape: tuple[int, int]  # padded (rows, width)
    validating: bool
    step: int  # the trainer's optimizer steps after the piece


@dataclass(slots=True)
class Job:
    """One job: accepted, its files read in the background (`examples` once they are), trained
    a unit at a time by its own trainer once its turn comes."""

    job_id: str
    tenant: str
    hyperparameters: FineTuneHyperparameters
    seed: int
    progress: FineTuneProgress
    # Set by a cancel: the reading of its files stops at once (so does a stopping site's).
    stop: threading.Event = field(default_factory=threading.Event)
    # Set once the intake is done with it (read, failed, stopped): what a caller may wait on.
    settled: threading.Event = field(default_factory=threading.Event)
    examples: Examples | None = None  # dropped once the job ends
    on_disk: bool = False  # its spec is saved: a result may be written beside it
    trainer: LoraTrainer | None = None
    unit: Unit | None = None

    @property
    def trainable(self) -> bool:
        return self.examples is not None and not self.progress.state.is_final

    def drop_trainer(self) -> None:
        if self.unit is not None:
            self.unit.pieces.abandon()
            self.unit = None
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
