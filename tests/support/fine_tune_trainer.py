"""A TEST DOUBLE of a site's fine-tuning trainer only (issue 54), for the gateway's side of the
fine-tuning API where a test must hold a job at a step (cancel, a gateway restart mid-job); the
site's real trainer runs end to end in tests/e2e/test_fine_tuning_http.py.

`PeftTrainerDouble` follows the FineTuningSite protocol's state machine (queued -> running ->
succeeded, or failed/cancelled) as a site would, and really trains: each progress call runs one
LoRA optimizer step with peft on the tiny random Llama the tests serve, and the final adapter and
checkpoints are PEFT directories written by save_pretrained, which the real site then loads and
serves. It has no clock: a job moves one step per progress call, so tests are deterministic.
What it does not do is what the site's trainer adds: idle-cycle scheduling, memory reservation,
resuming after a site restart.

`TrainingSiteClient` is a real site's client (gRPC, talking to a real site process) with the
double's three calls added: the serving, health and adapter loading are the real site's.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedllm_contract.fine_tuning import (
    FineTuneCheckpoint,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from gateway.sites.interface import SiteInfoView, SiteRejected

BASE_LEARNING_RATE = 1e-3


@dataclass
class _Job:
    spec: FineTuneSpec
    batches: list[list[str]]
    state: FineTuneState = FineTuneState.QUEUED
    step: int = 0
    trained_tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[FineTuneCheckpoint] = field(default_factory=list)
    adapter_path: str | None = None
    model: Any = None
    optimizer: Any = None


def _texts(jsonl: bytes) -> list[str]:
    lines = [json.loads(line) for line in jsonl.decode().splitlines() if line.strip()]
    return ["".join(f"{m['role']}: {m['content']}\n" for m in ex["messages"]) for ex in lines]


class PeftTrainerDouble:
    """Trains jobs of `base_model` (the model directory `model_dir`) into `out_dir`."""

    def __init__(
        self, base_model: str, model_dir: Path, out_dir: Path, checkpoint_every: int = 2
    ) -> None:
        self.base_model = base_model
        self._model_dir = model_dir
        self._out = out_dir
        self._every = checkpoint_every
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.jobs: dict[str, _Job] = {}
        # Set: no job steps past this step (a test holds one running to cancel it, or to stop
        # its gateway mid-job).
        self.stop_at: int | None = None

    async def start_fine_tune(self, spec: FineTuneSpec) -> FineTuneProgress:
        if spec.base_model != self.base_model:
            raise SiteRejected(
                "double", f"this site trains {self.base_model}, not {spec.base_model}"
            )
        if spec.job_id not in self.jobs:
            texts = _texts(spec.training_jsonl)
            size = spec.hyperparameters.batch_size
            batches = [texts[i : i + size] for i in range(0, len(texts), size)]
            self.jobs[spec.job_id] = _Job(spec, batches * spec.hyperparameters.n_epochs)
        return self._progress(self.jobs[spec.job_id])

    async def fine_tune_progress(self, job_id: str) -> FineTuneProgress:
        job = self._job(job_id)
        held = self.stop_at is not None and job.step >= self.stop_at
        if not job.state.is_final and not held:
            await asyncio.to_thread(self._step, job)
        return self._progress(job)

    async def cancel_fine_tune(self, job_id: str) -> FineTuneProgress:
        job = self._job(job_id)
        if not job.state.is_final:
            job.state = FineTuneState.CANCELLED
        return self._progress(job)

    async def live_fine_tunes(self) -> list[str]:
        return [job_id for job_id, job in self.jobs.items() if not job.state.is_final]

    def _job(self, job_id: str) -> _Job:
        if job_id not in self.jobs:
            raise SiteRejected("double", f"no fine-tuning job {job_id}")
        return self.jobs[job_id]

    def _step(self, job: _Job) -> None:
        if job.model is None:
            self._begin(job)
            return  # the first call after queued: running, no step yet
        batch = self._tokenizer(job.batches[job.step], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = job.model(**batch, labels=labels).loss
        value = float(loss.detach())
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad()
        job.step += 1
        job.trained_tokens += int(batch["attention_mask"].sum())
        job.losses.append((job.step, value))
        path = self._out / job.spec.job_id
        if job.step % self._every == 0:
            where = path / f"checkpoint-{job.step}"
            job.model.save_pretrained(str(where))
            job.checkpoints.append(FineTuneCheckpoint(job.step, str(where), value))
        if job.step == len(job.batches):
            job.model.save_pretrained(str(path / "final"))
            job.adapter_path, job.state = str(path / "final"), FineTuneState.SUCCEEDED

    def _begin(self, job: _Job) -> None:
        torch.manual_seed(job.spec.seed)
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        base = AutoModelForCausalLM.from_pretrained(str(self._model_dir), dtype=torch.float32)
        hyper = job.spec.hyperparameters
        config = LoraConfig(
            r=hyper.lora_rank,
            lora_alpha=hyper.lora_alpha,
            target_modules=list(hyper.target_modules),
            lora_dropout=0.0,
        )
        job.model = get_peft_model(base, config)
        rate = BASE_LEARNING_RATE * hyper.learning_rate_multiplier
        job.optimizer = torch.optim.AdamW(job.model.parameters(), lr=rate)
        job.state = FineTuneState.RUNNING

    def _progress(self, job: _Job) -> FineTuneProgress:
        return FineTuneProgress(
            job_id=job.spec.job_id,
            state=job.state,
            step=job.step,
            total_steps=len(job.batches),
            trained_tokens=job.trained_tokens,
            losses=tuple(job.losses),
            checkpoints=tuple(job.checkpoints),
            adapter_path=job.adapter_path,
        )


class TrainingSiteClient:
    """A real site's client with the double's fine-tuning calls, and a SiteInfo saying the site
    accepts jobs; everything else is the real client's."""

    def __init__(self, real: Any, trainer: PeftTrainerDouble) -> None:
        self._real = real
        self._trainer = trainer
        self.start_fine_tune = trainer.start_fine_tune
        self.fine_tune_progress = trainer.fine_tune_progress
        self.cancel_fine_tune = trainer.cancel_fine_tune
        self.live_fine_tunes = trainer.live_fine_tunes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def info(self) -> SiteInfoView:
        return replace(await self._real.info(), accepts_fine_tuning=True)
