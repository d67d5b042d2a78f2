"""POST /v1/fine_tuning/jobs's body (OpenAI's), and its hyperparameters resolved: "auto" (or
absent) becomes this gateway's choice, fixed when the job is made and shown on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

Auto = Literal["auto"]
Epochs = Annotated[int, msgspec.Meta(ge=1, le=50)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=256)]
Multiplier = Annotated[float, msgspec.Meta(gt=0, le=10)]
# OpenAI's: up to 64 characters of letters, digits, '-' and '_' (it names the model).
Suffix = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
# A file id names nothing outside these (and a NUL would be refused by PostgreSQL).
FileId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# "auto": epochs over the data and the multiplier of the site's base learning rate.
AUTO_EPOCHS, AUTO_MULTIPLIER = 3, 1.0
# "auto" batch size: one example per this many, within [1, AUTO_MAX_BATCH].
EXAMPLES_PER_AUTO_BATCH, AUTO_MAX_BATCH = 32, 8


class Hyperparameters(msgspec.Struct, forbid_unknown_fields=True):
    n_epochs: Epochs | Auto | None = None
    batch_size: BatchSize | Auto | None = None
    learning_rate_multiplier: Multiplier | Auto | None = None


class JobCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern="^[^\x00]*$")]
    training_file: FileId
    validation_file: FileId | None = None
    suffix: Suffix | None = None
    seed: Seed | None = None
    hyperparameters: Hyperparameters | None = None


@dataclass(frozen=True, slots=True)
class Resolved:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


def resolve(given: Hyperparameters | None, examples: int) -> Resolved:
    """The hyperparameters the job trains with, "auto" replaced by this gateway's choice."""
    given = given or Hyperparameters()
    epochs = given.n_epochs if isinstance(given.n_epochs, int) else AUTO_EPOCHS
    auto_batch = min(AUTO_MAX_BATCH, max(1, examples // EXAMPLES_PER_AUTO_BATCH))
    batch = given.batch_size if isinstance(given.batch_size, int) else auto_batch
    rate = given.learning_rate_multiplier
    return Resolved(
        epochs, batch, float(rate) if isinstance(rate, int | float) else AUTO_MULTIPLIER
    )
