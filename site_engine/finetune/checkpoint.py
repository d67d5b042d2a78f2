"""A job's checkpoints and final adapter on the site's disk, each written whole or not at all.

SITE_FINETUNE_DIR/<job_id>/ holds the job's spec (spec.json and its files), `checkpoint-<step>/`
directories (the PEFT adapter, plus trainer_state.pt: optimizer, scheduler, RNG state and the
history), the final `adapter/` (PEFT's format, what site_engine/engine/lora/adapter.py reads),
and `result.json` once the job ended. Every directory is written under a temporary name and
renamed into place, so a site killed mid-write leaves either the whole directory or none of it
(the temporary one is cleared at the next start).

An ended job keeps only what says it ended: spec.json (without its files), result.json and, if
it succeeded, its adapter (the site serves it from there); its files and checkpoints go on
cancel, failure and success alike (`clear_ended`; issue 75: the directory kept every cancelled
job's files, 4 KB -> 182 MB over one round). `DirectoryRoom` bounds what jobs may bring in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from fedllm_contract.fine_tuning import (
    FineTuneCheckpoint,
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from site_engine.finetune import FineTuneRefused
from site_engine.finetune.trainer import History, LoraTrainer

STATE_FILE = "trainer_state.pt"
RESULT_FILE = "result.json"
ADAPTER_DIR = "adapter"
SPEC_FILE = "spec.json"
# What an ended job's directory keeps.
_ENDED_KEEPS = frozenset({SPEC_FILE, RESULT_FILE, ADAPTER_DIR})
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


_TMP_PREFIX = ".tmp-"


def _write_dir(target: Path, fill: Any) -> None:
    """Calls fill(tmp) then renames tmp onto `target` (replacing an old one)."""
    tmp = target.with_name(f"{_TMP_PREFIX}{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def save_spec(job_dir: Path, spec: FineTuneSpec) -> None:
    def fill(tmp: Path) -> None:
        (tmp / "training.jsonl").write_bytes(spec.training_jsonl)
        if spec.validation_jsonl is not None:
            (tmp / "validation.jsonl").write_bytes(spec.validation_jsonl)
        hp = asdict(spec.hyperparameters)
        hp["target_modules"] = list(hp["target_modules"])
        meta = {"job_id": spec.job_id, "base_model": spec.base_model, "seed": spec.seed,
                "hyperparameters": hp, "tenant": spec.tenant}  # fmt: skip
        (tmp / SPEC_FILE).write_text(json.dumps(meta))

    _write_dir(job_dir, fill)


@dataclass(frozen=True, slots=True)
class SpecMeta:
    """A saved spec without its files (what a job that ended needs of it)."""

    job_id: str
    base_model: str
    hyperparameters: FineTuneHyperparameters
    seed: int
    tenant: str


def load_meta(job_dir: Path) -> SpecMeta:
    meta = json.loads((job_dir / SPEC_FILE).read_text())
    hp = dict(meta["hyperparameters"])
    hp["target_modules"] = tuple(hp["target_modules"])
    return SpecMeta(
        meta["job_id"],
        meta["base_model"],
        FineTuneHyperparameters(**hp),
        int(meta["seed"]),
        str(meta.get("tenant", "")),  # a spec saved before tenants were sent: one of its own
    )


def load_spec(job_dir: Path) -> FineTuneSpec:
    meta = load_meta(job_dir)
    validation = job_dir / "validation.jsonl"
    return FineTuneSpec(
        job_id=meta.job_id,
        base_model=meta.base_model,
        training_jsonl=(job_dir / "training.jsonl").read_bytes(),
        validation_jsonl=validation.read_bytes() if validation.is_file() else None,
        hyperparameters=meta.hyperparameters,
        seed=meta.seed,
        tenant=meta.tenant,
    )


def checkpoint_steps(job_dir: Path) -> list[int]:
    steps = [int(m[1]) for p in job_dir.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return sorted(steps)


def save_checkpoint(job_dir: Path, trainer: LoraTrainer) -> Path:
    """checkpoint-<step>/: the adapter and everything a resumed trainer needs."""
    target = job_dir / f"checkpoint-{trainer.history.step}"

    def fill(tmp: Path) -> None:
        trainer.model.save_pretrained(str(tmp))
        state = {
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "history": asdict(trainer.history),
        }
        torch.save(state, tmp / STATE_FILE)

    _write_dir(target, fill)
    return target


def restore_checkpoint(job_dir: Path, step: int, trainer: LoraTrainer) -> None:
    """Loads checkpoint-<step> into a trainer freshly built for the same spec."""
    path = job_dir / f"checkpoint-{step}"
    weights = load_file(str(path / "adapter_model.safetensors"), device=str(trainer.device))
    result = set_peft_model_state_dict(trainer.model, weights)
    if result.unexpected_keys:
        raise ValueError(f"{path} does not fit the job's model: {result.unexpected_keys[:3]}")
    state = torch.load(path / STATE_FILE, map_location=trainer.device, weights_only=False)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"].cpu())
    history = state["history"]
    trainer.history = History(
        step=history["step"],
        trained_tokens=history["trained_tokens"],
        losses=[(int(s), float(v)) for s, v in history["losses"]],
        validation_losses=[(int(s), float(v)) for s, v in history["validation_losses"]],
    )


def save_adapter(job_dir: Path, trainer: LoraTrainer) -> Path:
    target = job_dir / ADAPTER_DIR
    _write_dir(target, lambda tmp: trainer.model.save_pretrained(str(tmp)))
    return target


def checkpoint_record(job_dir: Path, step: int, losses: dict[int, float]) -> FineTuneCheckpoint:
    return FineTuneCheckpoint(step, str(job_dir / f"checkpoint-{step}"), losses.get(step, 0.0))


def save_result(job_dir: Path, progress: FineTuneProgress) -> None:
    record = asdict(progress)
    record["state"] = progress.state.value
    tmp = job_dir / f".tmp-{RESULT_FILE}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, job_dir / RESULT_FILE)


def load_result(job_dir: Path) -> FineTuneProgress | None:
    path = job_dir / RESULT_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return FineTuneProgress(
        job_id=record["job_id"],
        state=FineTuneState(record["state"]),
        step=record["step"],
        total_steps=record["total_steps"],
        trained_tokens=record["trained_tokens"],
        losses=tuple((int(s), float(v)) for s, v in record["losses"]),
        validation_losses=tuple((int(s), float(v)) for s, v in record["validation_losses"]),
        checkpoints=tuple(FineTuneCheckpoint(**c) for c in record["checkpoints"]),
        adapter_path=record["adapter_path"],
        error=record["error"],
    )


def clear_ended(job_dir: Path) -> None:
    """Removes what an ended job needs no more: its files, checkpoints and unfinished writes."""
    if not job_dir.is_dir():
        return
    for path in job_dir.iterdir():
        if path.name in _ENDED_KEEPS:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def directory_bytes(directory: Path) -> int:
    """The bytes of the files under `directory` (those removed while it is read count 0)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return total


def _bytes_by_job(directory: Path) -> dict[str, int]:
    """directory_bytes of each job's entries in `directory`: its directory and the one its
    files are written to before it is renamed into place (`_write_dir`)."""
    totals: dict[str, int] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return totals
    for entry in entries:
        job_id = entry.name.removeprefix(_TMP_PREFIX)
        try:
            if entry.is_dir(follow_symlinks=False):
                size = directory_bytes(Path(entry.path))  # 0 once renamed away
            else:
                size = entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        totals[job_id] = totals.get(job_id, 0) + size
    return totals


class DirectoryRoom:
    """The jobs' directory bounded to `max_bytes`: a job's files are let in only while what the
    directory holds and the files of the jobs let in but not yet written fit beside them. What
    a running job's checkpoints add is not known in advance and is not refused: an ended job's
    are cleared (`clear_ended`), so the directory comes back within its bound."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self._directory, self._max = directory, max_bytes
        self._unwritten: dict[str, int] = {}

    def claim(self, job_id: str, files_bytes: int) -> None:
        """Lets the job's files in (their bytes counted until `written`); FineTuneRefused
        (PRECONDITION) when they do not fit. The caller serializes claims."""
        held = self._held()
        if held + files_bytes > self._max:
            raise FineTuneRefused(
                FineTuneRefused.PRECONDITION,
                f"the site's fine-tuning directory holds {held:,} bytes and the job's files "
                f"{files_bytes:,}: more than its bound of {self._max:,} "
                "(SITE_FINETUNE_DIR_MAX_BYTES) until other jobs end",
            )
        self._unwritten[job_id] = files_bytes

    def written(self, job_id: str) -> None:
        """The job's files are on disk (or never will be): the directory counts them now."""
        self._unwritten.pop(job_id, None)

    def _held(self) -> int:
        """The directory's bytes, a job still being written counted at the larger of its claim
        and what it has on disk yet. Its writer's thread may finish and call `written` while
        the directory is walked: with the claims taken first (a copy, atomic under the GIL), a
        half-written file is never counted at its size so far alone, and a written one is never
        counted twice."""
        unwritten = dict(self._unwritten)
        by_job = _bytes_by_job(self._directory)
        return sum(max(on_disk, unwritten.get(name, 0)) for name, on_disk in by_job.items()) + sum(
            claimed for job_id, claimed in unwritten.items() if job_id not in by_job
        )
