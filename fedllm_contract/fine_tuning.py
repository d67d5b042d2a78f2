"""What the gateway and a site say to each other about a LoRA fine-tuning job (issue 54).

The gateway owns the job as the OpenAI fine-tuning API shows it (its file, its key, its events);
a site trains it in the cycles inference leaves idle, as the lowest class of work, and keeps its
checkpoints on its own disk so that a restarted site resumes it. These types are the one
description of a job both sides share; protobuf stays in the gRPC adapters
(site_engine/grpc_server.py, gateway/sites/grpc_client.py) that map them once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The most a job's files (training and validation together) may hold: a job reaches its site in
# one StartFineTune message, which the site's gRPC server takes up to this plus
# FINE_TUNE_MESSAGE_OVERHEAD_BYTES (site_engine/grpc_server.py), and the gateway refuses larger
# files when the job is made (GATEWAY_FINE_TUNING_MAX_FILE_BYTES, at most this).
MAX_JOB_FILES_BYTES = 64 << 20
# Room for the rest of a StartFineTune message (ids, hyperparameters, protobuf framing).
FINE_TUNE_MESSAGE_OVERHEAD_BYTES = 1 << 20


class FineTuneState(enum.Enum):
    """A job's state at its site (the gateway maps it to OpenAI's job status)."""

    QUEUED = "queued"  # accepted, waiting for the site's trainer
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # the adapter is written at `adapter_path`
    FAILED = "failed"  # see `error`
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (FineTuneState.SUCCEEDED, FineTuneState.FAILED, FineTuneState.CANCELLED)


@dataclass(frozen=True)
class FineTuneHyperparameters:
    """The job's hyperparameters, resolved (OpenAI's "auto" already replaced by a value)."""

    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    # The LoRA adapter trained: rank, alpha and the projections it adapts.
    lora_rank: int = 8
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if self.n_epochs < 1 or self.batch_size < 1:
            raise ValueError("n_epochs and batch_size must be at least 1")
        if not self.learning_rate_multiplier > 0:
            raise ValueError("learning_rate_multiplier must be positive")
        if not 1 <= self.lora_rank <= 64:
            raise ValueError("lora_rank must be in 1..64")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one projection")


@dataclass(frozen=True)
class FineTuneSpec:
    """A job as the gateway hands it to a site. The files are already validated line by line
    (OpenAI's chat fine-tuning format: one {"messages": [...]} object a line)."""

    job_id: str
    base_model: str  # the site's base model name; a site refuses a job for another model
    training_jsonl: bytes
    validation_jsonl: bytes | None
    hyperparameters: FineTuneHyperparameters
    seed: int
    # Whose job it is (the gateway's key id as text; "" for a caller without a key): a site
    # shares its training time between tenants round robin, so one key's long job does not hold
    # another key's short one back.
    tenant: str = ""


@dataclass(frozen=True)
class FineTuneCheckpoint:
    """A checkpoint the site wrote (a PEFT adapter directory on the site's disk)."""

    step: int
    path: str
    train_loss: float


@dataclass(frozen=True)
class FineTuneProgress:
    """A job's progress as its site reports it; `losses` and `checkpoints` are whole histories,
    so a report replaces the previous one rather than adding to it."""

    job_id: str
    state: FineTuneState
    step: int
    total_steps: int
    trained_tokens: int  # tokens of training examples the site has run forward and backward
    losses: tuple[tuple[int, float], ...] = ()  # (step, mean training loss of that step)
    validation_losses: tuple[tuple[int, float], ...] = ()
    checkpoints: tuple[FineTuneCheckpoint, ...] = ()
    adapter_path: str | None = None  # set once SUCCEEDED: the final PEFT adapter directory
    error: str | None = None  # set once FAILED
