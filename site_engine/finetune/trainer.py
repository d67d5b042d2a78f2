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
its batch. Micro-batches are bounded in tokens, not examples: a unit takes the batch's next
examples in order while their padded size (rows x the longest) stays within the token budget
the caller gives (site_engine/finetune/pacing.py sizes it from the time bound), and always at
least one example, so a sequence longer than the budget is a unit on its own (never cut: its
tokens attend to each other). Each batch's loss is the mean over its assistant tokens,
whichever units it is cut into (each unit adds its token-loss sum / the batch's token count),
so the accumulated gradient is the whole batch's.

The loss is computed from the decoder's hidden states at the labelled positions only, in chunks
of LOSS_CHUNK_TOKENS at most (fewer where one would outlast half a site's time bound,
LossChunks): the logits (vocabulary-wide, fp32 for the loss) of one chunk at a time are alive,
each chunk's backward run at once into the hidden states' gradient, and then one backward
through the decoder (site_engine/finetune/memory.py counts one chunk, not all tokens).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from fedllm_contract.fine_tuning import FineTuneHyperparameters
from site_engine.finetune.data import IGNORE, Example
from site_engine.finetune.segment_costs import SegmentKind

# AdamW's learning rate at learning_rate_multiplier 1: the usual LoRA rate for small and mid
# models (the PEFT and QLoRA examples' 2e-4), decayed linearly to zero over the job.
BASE_LEARNING_RATE = 2e-4
# Labelled tokens whose logits are alive at once: 256 x a 128k vocabulary in fp32 with its
# gradient is about 0.25 GiB, against 4 GiB for 2,048 tokens at once.
LOSS_CHUNK_TOKENS = 256

# A boundary of a unit's pieces that no layer's hook reaches, named by the segment it begins
# (site_engine/finetune/pieces.py).
Pause = Callable[[SegmentKind], None]


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


def _module_tensors(base: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the module tree holds: parameters, buffers, and plain attributes (alone or
    in a tuple or list), such as the fused q/k/v and gate/up weights the serving engine keeps
    beside the views its projections' parameters are (site_engine/engine/models/fused.py)."""
    yield from itertools.chain(base.parameters(), base.buffers())
    for module in base.modules():
        for value in vars(module).values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, torch.Tensor):
                    yield item


def _alias(base: nn.Module) -> nn.Module:
    """A copy of the module tree whose tensors are all the base's own: deepcopy copies what its
    memo lacks, and a fused weight missed here is a second copy of most of the base (9 GB on
    the 8B shape: the trainer's CUDA peak was 12.1 GB against an estimate of 3.3)."""
    memo: dict[int, object] = {id(t): t for t in _module_tensors(base)}
    return copy.deepcopy(base, memo)


# The trainer's attention kernels: flash or memory-efficient SDPA (math where neither applies),
# never cuDNN's. cuDNN builds a graph on the host for each new sequence shape, the first in
# ~1 s and each later one in 40-110 ms (the H200 timeline, bench/results/finetune_colocated/
# finetune_timeline_h200.md), and a job's units bring new lengths all the time: the first
# attention forward (layer 0) and backward (the last layer) of a unit held the engine's loop
# for up to 1.4 s against an 8 ms bound. Flash and memory-efficient take any length unbuilt.
_TRAINING_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _PinnedAttention:
    """Hooks on each attention module of the trainer's copy: its SDPA call runs within
    `sdpa_kernel(_TRAINING_SDPA)`. Per call, not around the unit: torch's backend flags are
    global, and a unit's pieces have serving steps between them (a backward keeps the kernel
    its forward chose)."""

    def __init__(self) -> None:
        self._open: list[contextlib.AbstractContextManager[None]] = []

    def attach(self, model: nn.Module) -> None:
        for module in model.modules():
            if type(module).__name__.endswith("Attention"):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: object) -> None:
        pinned = sdpa_kernel(_TRAINING_SDPA)
        pinned.__enter__()
        self._open.append(pinned)

    def _exit(self, module: nn.Module, args: object, output: object) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)


def lora_model(base: nn.Module, hp: FineTuneHyperparameters, seed: int) -> PeftModel:
    """The served model with fresh LoRA layers (drawn from `seed`) over a shared frozen base,
    its attention pinned to kernels that need no per-shape build (_TRAINING_SDPA)."""
    torch.manual_seed(seed)
    model = get_peft_model(_alias(base), lora_config(hp))
    _PinnedAttention().attach(model)
    model.train()
    return model


def pad_batch(
    examples: Sequence[Example], device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) right-padded to `width` (the longest example's
    length by default)."""
    ids, mask, labels = _padded_on_host(examples, width)
    return _to_device(ids, device), _to_device(mask, device), _to_device(labels, device)


def _padded_on_host(
    examples: Sequence[Example], width: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = width or max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        mask[row, :n] = 1
        labels[row, :n] = torch.tensor(example.labels)
    return ids, mask, labels


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy queued on the device's stream: from pageable memory, a CUDA copy waits for all
    the work queued before it (the serving step beside the unit), from pinned memory it does
    not, and a unit's pieces are then never waited for mid-unit (site_engine/finetune/pieces.py)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class UnitWidths:
    """The width a unit's rows are padded to: its longest example's length rounded up to
    `multiple`, but never past the job's longest example, which the reserve was sized for
    (site_engine/finetune/memory.py), so rounding adds no memory the plan did not count. On CUDA
    each new (rows, width) shape cost a piece 10-25 ms the first time (kernel variants loaded on
    first use; issue 76's timelines): chat-length examples bring a new length nearly every
    unit, rounded ones a handful. Padded positions are masked and unlabelled: the loss and the
    gradients are the same."""

    longest: int  # the job's longest example, in tokens
    multiple: int = 1

    def __post_init__(self) -> None:
        if self.longest < 1 or self.multiple < 1:
            raise ValueError("UnitWidths needs longest >= 1 and multiple >= 1")

    def of(self, longest: int) -> int:
        return min(-(-longest // self.multiple) * self.multiple, max(self.longest, longest))

    def unit(self, examples: Sequence[Example]) -> int:
        return self.of(max(len(e.input_ids) for e in examples))


# Units' widths rounded up to this on CUDA (UnitWidths says why); on a CPU a new shape costs
# nothing more than its FLOPs, so units stay exactly as wide as their longest example.
WIDTH_MULTIPLE_CUDA = 64
_EXACT = UnitWidths(longest=1)  # no rounding: each unit as wide as its longest example


def unit_tokens(examples: Sequence[Example], widths: UnitWidths = _EXACT) -> int:
    """The tokens a unit of these examples computes: rows x its width (padding included)."""
    return len(examples) * widths.unit(examples)


def _shape(examples: Sequence[Example], widths: UnitWidths) -> tuple[int, int]:
    return len(examples), widths.unit(examples)


def take(examples: Sequence[Example], max_tokens: int, widths: UnitWidths = _EXACT) -> int:
    """How many of `examples`, from the first, one unit takes within `max_tokens` (>= 1)."""
    count, longest = 1, len(examples[0].input_ids)
    while count < len(examples):
        longest = max(longest, len(examples[count].input_ids))
        if (count + 1) * widths.of(longest) > max_tokens:
            break
        count += 1
    return count


def _chunk_loss(
    head: nn.Module, rows: torch.Tensor, targets: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    logits = head(rows).float()
    if softcap:  # Gemma-style final logit soft-capping, as the model's own forward does
        logits = torch.tanh(logits / softcap) * softcap
    return nn.functional.cross_entropy(logits, targets, reduction="sum")


def _rounded_chunk(
    rows: torch.Tensor, targets: torch.Tensor, widths: UnitWidths
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of the loss padded to the units' width multiple with unlabelled zero rows. The
    unit's last chunk holds the remainder of its labelled tokens (any of 1-255): on CUDA each new
    row count met the head's GEMM and the cross-entropy as a new shape, loaded on the host
    inside a piece (issue 76, r89: the one piece over the bound, 10.1 ms, was such a chunk).
    Rounded, a job meets four. Padded rows are ignored by the loss, so its value and its
    gradients are the same; the padding is within LOSS_CHUNK_TOKENS, which memory.py counts."""
    short = -rows.shape[0] % widths.multiple
    if short == 0:
        return rows, targets
    padded_targets = nn.functional.pad(targets, (0, short), value=IGNORE)
    return nn.functional.pad(rows, (0, 0, 0, short)), padded_targets


@dataclass(slots=True)
class LossChunks:
    """Labelled tokens one chunk of the loss takes: LOSS_CHUNK_TOKENS at most (the memory
    bound), fewer where a chunk would take longer than `target_s` (the site's jobs set it to
    half the time bound: a chunk sits between two boundaries of a unit's pieces, and no piece
    can be shorter). A small model with a large vocabulary is the case: on the CPU preset a
    256-token chunk took 150-250 ms against a 50 ms bound. Timed on the host's clock, which is
    the device's here: each chunk's loss is read back (`float`). None: always the most."""

    target_s: float | None = None
    tokens: int = LOSS_CHUNK_TOKENS

    def observe(self, tokens: int, seconds: float) -> None:
        if self.target_s is None or tokens < 1 or not seconds > 0:
            return
        fit = int(self.target_s * tokens / seconds)
        self.tokens = max(_MIN_LOSS_CHUNK, min(LOSS_CHUNK_TOKENS, fit, 2 * self.tokens))


_MIN_LOSS_CHUNK = 16  # below this a chunk is all launches


def token_loss_sum(
    model: PeftModel,
    examples: Sequence[Example],
    device: torch.device,
    backward_scale: float | None = None,
    pause: Pause | None = None,
    chunks: LossChunks | None = None,
    widths: UnitWidths = _EXACT,
) -> float:
    """Summed next-token cross-entropy over the examples' labelled tokens (fp32). With
    `backward_scale`, the gradient of (sum x backward_scale) is accumulated too. `pause` is
    called between two chunks of the loss (a boundary of the unit's pieces); `chunks` sizes
    them (LOSS_CHUNK_TOKENS each without it), and before the first one too, so that the
    decoder's last layer and the first chunk are never one piece (9-12 ms together against a
    4 ms piece on an H200, issue 76's first timeline)."""
    host_ids, host_mask, host_labels = _padded_on_host(examples, widths.unit(examples))
    ids, mask = _to_device(host_ids, device), _to_device(host_mask, device)
    # The labelled positions are found on the host: a boolean mask applied on the device reads
    # its count back, which would wait for the whole forward mid-unit.
    targets = host_labels[:, 1:]
    row, position = (targets != IGNORE).nonzero(as_tuple=True)
    wanted = _to_device(targets[row, position], device)
    at = _to_device(row * host_labels.shape[1] + position, device)  # in [rows x width]
    causal = model.get_base_model()
    hidden = causal.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)
    head = causal.get_output_embeddings()
    softcap = getattr(causal.config, "final_logit_softcapping", None)
    scale = backward_scale if rows.requires_grad and rows.shape[0] > 0 else None
    learn = scale is not None
    leaf = rows.detach().requires_grad_(learn)
    # Summed on the device and read once, at the end: a chunk's loss read back would wait for
    # the device in the middle of a piece. On a CPU the host's clock is the device's, so the
    # chunks are sized from it; on CUDA a chunk of LOSS_CHUNK_TOKENS is ~1 ms on an H200.
    timed = chunks is not None and device.type != "cuda"
    total = torch.zeros((), dtype=torch.float32, device=device)
    start = 0
    while start < leaf.shape[0]:
        if pause is not None:
            pause("loss")
        end = start + (chunks.tokens if chunks is not None else LOSS_CHUNK_TOKENS)
        began = time.perf_counter()
        chunk_rows, chunk_targets = _rounded_chunk(leaf[start:end], wanted[start:end], widths)
        loss = _chunk_loss(head, chunk_rows, chunk_targets, softcap)
        if scale is not None:
            (loss * scale).backward()  # type: ignore[no-untyped-call]
        total += loss.detach()
        if timed and chunks is not None:
            chunks.observe(min(end, leaf.shape[0]) - start, time.perf_counter() - began)
        start = end
    if learn:
        if pause is not None:
            pause("unwind")
        rows.backward(leaf.grad)
    return float(total)


@dataclass(slots=True)
class History:
    """What a job has done; saved with every checkpoint."""

    step: int = 0
    trained_tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    validation_losses: list[tuple[int, float]] = field(default_factory=list)


class LoraTrainer:
    """Trains one job, a unit of at most a token budget per `work()` call; the engine's thread
    calls it."""

    def __init__(
        self,
        base: nn.Module,
        hp: FineTuneHyperparameters,
        seed: int,
        train: Sequence[Example],
        validation: Sequence[Example] = (),
        width_multiple: int | None = None,
    ) -> None:
        self.hp, self.seed = hp, seed
        self.train, self.validation = list(train), list(validation)
        self.device = next(base.parameters()).device
        longest = max((len(e.input_ids) for e in [*self.train, *self.validation]), default=1)
        if width_multiple is None:
            width_multiple = WIDTH_MULTIPLE_CUDA if self.device.type == "cuda" else 1
        self.widths = UnitWidths(longest, width_multiple)
        self.model = lora_model(base, hp, seed)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # Fused on CUDA: one kernel for every LoRA tensor's update instead of a chain of them.
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=BASE_LEARNING_RATE * hp.learning_rate_multiplier,
            fused=self.device.type == "cuda",
        )
        total = self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: max(0.0, 1.0 - s / total)
        )
        self.history = History()
        self._done_in_step = 0  # examples of the current batch already run
        self._step_loss = 0.0
        self._validation: tuple[int, float, int] | None = None  # (position, loss sum, tokens)
        self.loss_chunks = LossChunks()
        # The padded (rows, width) of the unit under way or last run: a timeline's shape.
        self.unit_shape = (0, 0)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.train), self.hp.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.hp.n_epochs

    @property
    def finished(self) -> bool:
        return self.history.step >= self.total_steps and not self._validation_due()

    @property
    def validating(self) -> bool:
        """Whether the next unit is one of the epoch's validation."""
        return self._validation_due()

    def reported_losses(self) -> list[tuple[int, float]]:
        """The steps' training losses a report may carry: an epoch's last step waits for the
        epoch's validation loss, which is computed in the units after it, since its event is
        written once, with both (issue 75: the event of that step never had `valid_loss`)."""
        losses = self.history.losses
        if self._validation_due() and losses and losses[-1][0] == self.history.step:
            return losses[:-1]
        return list(losses)

    def _validation_due(self) -> bool:
        step = self.history.step
        return (
            bool(self.validation)
            and step > 0
            and step % self.steps_per_epoch == 0
            and not any(s == step for s, _ in self.history.validation_losses)
        )

    def _next_examples(self) -> list[Example] | None:
        """The examples the next unit draws from (the rest of the batch or of the validation
        set), None when the job has nothing left."""
        if self._validation_due():
            position = self._validation[0] if self._validation else 0
            return self.validation[position:]
        if self.history.step >= self.total_steps:
            return None
        batch = batch_of(len(self.train), self.hp.batch_size, self.seed, self.history.step)
        return [self.train[i] for i in batch[self._done_in_step :]]

    def next_unit_tokens(self, max_tokens: int) -> int:
        """The tokens (padded) `work(max_tokens)` would compute now; 0 if nothing is left."""
        rest = self._next_examples()
        return unit_tokens(rest[: take(rest, max_tokens, self.widths)], self.widths) if rest else 0

    def work(self, max_tokens: int, pause: Pause | None = None) -> int:
        """Runs one unit of at most `max_tokens` padded tokens (or one example longer than
        that): training, or the epoch's validation. Returns the tokens it computed (0: none).
        `pause` marks the boundaries no layer's hook reaches: between the loss's chunks and
        before the optimizer step (site_engine/finetune/pieces.py)."""
        if self._validation_due():
            return self._validate_some(max_tokens, pause)
        rest = self._next_examples()
        if not rest:
            return 0
        batch = batch_of(len(self.train), self.hp.batch_size, self.seed, self.history.step)
        chunk = rest[: take(rest, max_tokens, self.widths)]
        self.unit_shape = _shape(chunk, self.widths)
        batch_tokens = sum(self.train[i].loss_tokens for i in batch)
        loss = token_loss_sum(
            self.model, chunk, self.device, 1 / batch_tokens, pause, self.loss_chunks, self.widths
        )
        self._step_loss += loss / batch_tokens
        self._done_in_step += len(chunk)
        self.history.trained_tokens += sum(e.trained_tokens for e in chunk)
        if self._done_in_step == len(batch):
            if pause is not None:
                pause("optimizer")
            self._optimizer_step()
        return unit_tokens(chunk, self.widths)

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.history.step += 1
        self.history.losses.append((self.history.step, self._step_loss))
        self._done_in_step, self._step_loss = 0, 0.0

    def _validate_some(self, max_tokens: int, pause: Pause | None) -> int:
        position, total, tokens = self._validation or (0, 0.0, 0)
        rest = self.validation[position:]
        chunk = rest[: take(rest, max_tokens, self.widths)]
        self.unit_shape = _shape(chunk, self.widths)
        with torch.no_grad():
            total += token_loss_sum(
                self.model,
                chunk,
                self.device,
                pause=pause,
                chunks=self.loss_chunks,
                widths=self.widths,
            )
        tokens += sum(e.loss_tokens for e in chunk)
        position += len(chunk)
        if position < len(self.validation):
            self._validation = (position, total, tokens)
        else:
            self._validation = None
            self.history.validation_losses.append((self.history.step, total / max(tokens, 1)))
        return unit_tokens(chunk, self.widths)

    def abandon_partial_step(self) -> None:
        """Drops the gradients of an optimizer step not finished (a resumed job redoes it)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._done_in_step, self._step_loss, self._validation = 0, 0.0, None

    def close(self) -> None:
        """Lets the copy's LoRA layers, gradients and optimizer state go (the base is shared)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
