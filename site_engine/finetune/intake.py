"""A fine-tuning job's spec checked when a site is asked to start it (`check_spec`), and its
files read into training examples after the site has accepted it (`read_examples`).

StartFineTune only registers a job and answers (site_engine/finetune/jobs.py): reading and
tokenizing a 60 MiB file takes minutes on a busy host, and inside the call it outlasted the
gateway's deadline, which then sent the file again every two minutes, each copy parsed at once
(issue 67). The job's files are read afterwards, one job at a time with tenants taking turns
(site_engine/finetune/job_intake.py, reading_turns.py), and the reading stops as soon as the
job is cancelled or the site stops (`stop`), so a cancel during the read leaves nothing to train
and a stopping site does not wait for a parse to end.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from fedllm_contract.fine_tuning import FineTuneSpec
from site_engine.engine.lora.adapter import PROJECTIONS
from site_engine.finetune import FineTuneRefused
from site_engine.finetune.data import Example, TrainingDataError, encode_file
from site_engine.finetune.memory import (
    TrainingShape,
    largest_unit_tokens,
    longest_example_tokens,
)
from site_engine.finetune.trainer import steps_per_epoch

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


def check_spec(spec: FineTuneSpec, model_name: str, max_rank: int) -> None:
    """What a spec must be before its job is accepted (its files are read afterwards);
    FineTuneRefused (INVALID) says why not."""
    if spec.base_model != model_name:
        raise FineTuneRefused(
            FineTuneRefused.INVALID,
            f"this site serves {model_name!r}, not the job's base {spec.base_model!r}",
        )
    if not _JOB_ID.match(spec.job_id):
        raise FineTuneRefused(FineTuneRefused.INVALID, f"bad job id {spec.job_id!r}")
    if spec.hyperparameters.lora_rank > max_rank:
        raise FineTuneRefused(
            FineTuneRefused.INVALID,
            f"lora_rank {spec.hyperparameters.lora_rank} is above the largest rank this site "
            f"serves ({max_rank}, SITE_MAX_LORA_RANK)",
        )
    unknown = set(spec.hyperparameters.target_modules) - set(PROJECTIONS)
    if unknown:
        raise FineTuneRefused(
            FineTuneRefused.INVALID,
            f"target_modules {sorted(unknown)}: LoRA is served on {', '.join(PROJECTIONS)}",
        )


@dataclass(frozen=True, slots=True)
class Examples:
    """A job's files, read: what its trainer trains and validates on."""

    train: list[Example]
    validation: list[Example]
    longest: int  # the tokens of its longest example, either file's
    max_unit_tokens: int  # the most padded tokens a unit may take within the whole reserve
    total_steps: int


def read_examples(
    spec: FineTuneSpec,
    tokenizer: PreTrainedTokenizerBase,
    shape: TrainingShape,
    max_tokens: int,
    reserve_bytes: int,
    stop: Callable[[], bool],
) -> Examples:
    """Encodes the files and caps a unit's tokens by the reserve; FineTuneRefused if they
    cannot train; fedllm_contract.training_data.Stopped once `stop` says so."""
    try:
        train = encode_file(tokenizer, spec.training_jsonl, max_tokens, stop)
        validation = (
            encode_file(tokenizer, spec.validation_jsonl, max_tokens, stop)
            if spec.validation_jsonl is not None
            else []
        )
    except (TrainingDataError, UnicodeDecodeError) as exc:
        raise FineTuneRefused(FineTuneRefused.INVALID, f"training data: {exc}") from exc
    hp = spec.hyperparameters
    longest = max(len(e.input_ids) for e in train + validation)
    most = largest_unit_tokens(shape, hp, longest, reserve_bytes)
    if most < 1:
        held = longest_example_tokens(shape, hp, reserve_bytes, max_tokens)
        raise FineTuneRefused(
            FineTuneRefused.PRECONDITION,
            f"an example of {longest} tokens is longer than the {held} tokens an example may "
            "have in this site's fine-tuning memory reserve (SITE_FINETUNE_RESERVE_BYTES)",
        )
    total = steps_per_epoch(len(train), hp.batch_size) * hp.n_epochs
    return Examples(train, validation, longest, most, total)
