"""One LoRA fine-tuning job's training, cut into units the engine loop runs between its steps.

The model trained is the served model itself with LoRA layers over it: its module tree is copied
but every weight and buffer tensor is shared (`_alias`), so the trainer costs no second copy of
the base, and the serving model is untouched (peft wraps the copy's projections, never the
original's). The base stays frozen in its serving dtype (bf16 on a GPU); the LoRA weights, their
gradients and AdamW's moments are fp32 (peft casts adapter weights up over a half-precision base).

Determinism: the LoRA A matrices are drawn right after `torch.manual_seed(seed)`, and epoch e
visits the examples in `randperm(n, seed + e)` order, so which examples an optimizer step takes
is a function of (seed, step) alone: a resumed job takes the same batches as one never stopped.

A unit of work is one micro-batch's forward and backward; an optimizer step is the last unit of
its batch. Each batch's loss is the mean over its assistant tokens, whichever micro-batches it
is cut into (each micro-batch adds its token-loss sum / the batch's token count).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from fedllm_contract.fine_tuning import FineTuneHyperparameters
from site_engine.finetune.data import IGNORE, Example

# AdamW's learning rate at learning_rate_multiplier 1: the usual LoRA rate for small and mid
# models (the PEFT and QLoRA examples' 2e-4), decayed linearly to zero over the job.
BASE_LEARNING_RATE = 2e-4


def steps_per_epoch(examples: int, batch_size: int) -> int:
    return math.ceil(examples / batch_size)


def epoch_order(examples: int, seed: int, epoch: int) -> list[int]:
    """The order epoch `epoch` visits the examples in (a pure function of its arguments)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return [int(i) for i in torch.randperm(examples, generator=generator)]


def batch_of(examples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The example indices optimizer step `step` (0-based) trains on."""
    per_epoch = steps_per_epoch(examples, batch_size)
    epoch, index = divmod(step, per_epoch)
    return epoch_order(examples, seed, epoch)[index * batch_size : (index + 1) * batch_size]


def lora_config(hp: FineTuneHyperparameters) -> LoraConfig:
    return LoraConfig(
        r=hp.lora_rank,
        lora_alpha=hp.lora_alpha,
        target_modules=list(hp.target_modules),
        lora_dropout=0.0,  # no randomness between a resumed run and an uninterrupted one
        bias="none",
        task_type="CAUSAL_LM",
    )


def _alias(base: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the base's own tensors."""
    memo: dict[int, object] = {id(t): t for t in itertools.chain(base.parameters(), base.buffers())}
    return copy.deepcopy(base, memo)


def lora_model(base: nn.Module, hp: FineTuneHyperparameters, seed: int) -> PeftModel:
    """The served model with fresh LoRA layers (drawn from `seed`) over a shared frozen base."""
    torch.manual_seed(seed)
    model = get_peft_model(_alias(base), lora_config(hp))
    model.train()
    return model


def pad_batch(
    examples: Sequence[Example], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) right-padded to the longest example."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        mask[row, :n] = 1
        labels[row, :n] = torch.tensor(example.labels)
    return ids.to(device), mask.to(device), labels.to(device)


def token_loss_sum(
    model: nn.Module, examples: Sequence[Example], device: torch.device
) -> torch.Tensor:
    """Summed next-token cross-entropy over the examples' labelled tokens (fp32)."""
    ids, mask, labels = pad_batch(examples, device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )


@dataclass(slots=True)
class History:
    """What a job has done; saved with every checkpoint."""

    step: int = 0
    trained_tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    validation_losses: list[tuple[int, float]] = field(default_factory=list)


class LoraTrainer:
    """Trains one job, a micro-batch per `work()` call; the engine's thread calls it."""

    def __init__(
        self,
        base: nn.Module,
        hp: FineTuneHyperparameters,
        seed: int,
        train: Sequence[Example],
        validation: Sequence[Example] = (),
        micro_batch: int | None = None,
    ) -> None:
        self.hp, self.seed = hp, seed
        self.train, self.validation = list(train), list(validation)
        self.device = next(base.parameters()).device
        self.model = lora_model(base, hp, seed)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=BASE_LEARNING_RATE * hp.learning_rate_multiplier
        )
        total = self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: max(0.0, 1.0 - s / total)
        )
        self.micro_batch = min(micro_batch or hp.batch_size, hp.batch_size)
        self.history = History()
        self._done_in_step = 0  # examples of the current batch already run
        self._step_loss = 0.0
        self._validation: tuple[int, float, int] | None = None  # (position, loss sum, tokens)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.train), self.hp.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.hp.n_epochs

    @property
    def finished(self) -> bool:
        return self.history.step >= self.total_steps and not self._validation_due()

    def _validation_due(self) -> bool:
        step = self.history.step
        return (
            bool(self.validation)
            and step > 0
            and step % self.steps_per_epoch == 0
            and not any(s == step for s, _ in self.history.validation_losses)
        )

    def work(self) -> bool:
        """Runs one unit (a micro-batch of training, or of the epoch's validation); True when
        an optimizer step ended with it."""
        if self._validation_due():
            self._validate_some()
            return False
        if self.history.step >= self.total_steps:
            return False
        batch = batch_of(len(self.train), self.hp.batch_size, self.seed, self.history.step)
        chunk = [
            self.train[i] for i in batch[self._done_in_step : self._done_in_step + self.micro_batch]
        ]
        batch_tokens = sum(self.train[i].loss_tokens for i in batch)
        loss = token_loss_sum(self.model, chunk, self.device) / batch_tokens
        loss.backward()  # type: ignore[no-untyped-call]
        self._step_loss += float(loss.detach())
        self._done_in_step += len(chunk)
        self.history.trained_tokens += sum(e.trained_tokens for e in chunk)
        if self._done_in_step < len(batch):
            return False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.history.step += 1
        self.history.losses.append((self.history.step, self._step_loss))
        self._done_in_step, self._step_loss = 0, 0.0
        return True

    def _validate_some(self) -> None:
        position, total, tokens = self._validation or (0, 0.0, 0)
        chunk = self.validation[position : position + self.micro_batch]
        with torch.no_grad():
            total += float(token_loss_sum(self.model, chunk, self.device))
        tokens += sum(e.loss_tokens for e in chunk)
        position += len(chunk)
        if position < len(self.validation):
            self._validation = (position, total, tokens)
            return
        self._validation = None
        self.history.validation_losses.append((self.history.step, total / max(tokens, 1)))

    def abandon_partial_step(self) -> None:
        """Drops the gradients of an optimizer step not finished (a resumed job redoes it)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._done_in_step, self._step_loss, self._validation = 0, 0.0, None

    def close(self) -> None:
        """Lets the copy's LoRA layers, gradients and optimizer state go (the base is shared)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
