"""A training micro-batch of the site's trainer in a form a CUDA graph can hold, for parts 2 and 3
of bench.engine.finetune_share_profile.

`LoraTrainer.work` itself cannot be captured: it reads each loss chunk's value on the host
(`float(loss)`), selects the labelled positions with a boolean mask (a shape known only on the
device) and sizes its micro-batches on the host. So the graph holds what a unit of it computes,
on the trainer's own model (its LoRA layers over the served base, `LoraTrainer.model`): the
decoder's forward over `rows` examples of exactly `width` tokens (no padding, so no mask), the
loss over the labelled positions (their indices taken once, on the host, before capture) scaled
by 1 / their count as the trainer scales it, then, as asked, the backward (LoRA gradients only:
the base is frozen) and an AdamW step. The step's AdamW is the trainer's (fused, fp32 moments)
made `capturable` (its step count on the device); it has no learning-rate schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional

from site_engine.finetune.data import IGNORE, Example
from site_engine.finetune.trainer import BASE_LEARNING_RATE, LoraTrainer


class TrainingStep:
    """One micro-batch (`batch`: examples all of one width, no padding) through the trainer's
    model; a call runs it eagerly."""

    def __init__(
        self, trainer: LoraTrainer, batch: Sequence[Example], *, backward: bool, optimizer: bool
    ) -> None:
        width = len(batch[0].input_ids) if batch else 0
        if not batch or any(len(e.input_ids) != width for e in batch):
            raise ValueError("a training step takes one or more examples of one width")
        rows, device = len(batch), trainer.device
        causal = trainer.model.get_base_model()
        self._decoder = causal.get_decoder()
        self._head = causal.get_output_embeddings()
        self._ids = torch.tensor([e.input_ids for e in batch], device=device)
        targets = torch.tensor([e.labels for e in batch])[:, 1:].reshape(-1)
        keep = targets != IGNORE
        self._index = keep.nonzero().squeeze(1).to(device)
        self._targets = targets[keep].to(device)
        self._scale = 1.0 / max(int(keep.sum()), 1)
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.backward = backward
        self.optimizer = (
            torch.optim.AdamW(
                self.params,
                lr=BASE_LEARNING_RATE,
                fused=device.type == "cuda",
                capturable=device.type == "cuda",
            )
            if optimizer
            else None
        )
        self.device = device
        self.rows, self.width = rows, width
        self.tokens = rows * width

    def __call__(self) -> torch.Tensor:
        hidden = self._decoder(input_ids=self._ids, use_cache=False).last_hidden_state
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, self._index)
        logits = self._head(flat).float()
        loss = functional.cross_entropy(logits, self._targets, reduction="sum") * self._scale
        if self.backward:
            loss.backward()  # type: ignore[no-untyped-call]
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach()

    def drop_grads(self) -> None:
        for param in self.params:
            param.grad = None


@dataclass(slots=True)
class Runnable:
    """A run to repeat: a CUDA graph's replay, or the eager call (`mode` says which, and why
    where a capture failed). `keep`: what the graph's replays read and write, kept alive."""

    run: Callable[[], object]
    mode: str
    tokens: int = 0
    keep: tuple[Any, ...] = field(default=())

    def pool(self) -> Any:
        """The graph's memory pool, for the next capture to share (None: eager)."""
        graph = self.keep[0] if self.keep else None
        return graph.pool() if isinstance(graph, torch.cuda.CUDAGraph) else None


def graph_of(
    run: Callable[[], Any], pool: Any = None, before_capture: Callable[[], None] | None = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`run` captured in a CUDA graph, after two eager warm-ups on a side stream (Triton
    compiles, cuBLAS picks its kernels, as capture requires); its output. Raises if the capture
    fails."""
    side = cuda_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        out = run()
    torch.cuda.synchronize()
    return graph, out


def replayable(
    run: Callable[[], Any],
    device: torch.device,
    pool: Any = None,
    before_capture: Callable[[], None] | None = None,
    tokens: int = 0,
) -> Runnable:
    """`run` as a CUDA graph, or eagerly where there is no CUDA or the capture fails (the
    reason kept in `mode`: one failed capture costs its figure's graph, not the run)."""
    if device.type != "cuda":
        return Runnable(run, "eager (CPU)", tokens)
    try:
        graph, out = graph_of(run, pool, before_capture)
    except Exception as exc:  # the eager path stays usable
        torch.cuda.synchronize()
        reason = f"{type(exc).__name__}: {exc}"[:300]
        return Runnable(run, f"eager (capture failed: {reason})", tokens)
    # `run` too: the graph reads its inputs (the tensors `run` holds: token ids, a batch's
    # slot mapping) at their capture-time addresses; freed, the allocator hands that memory to
    # the next batch built, and a replay then reads another batch's numbers (issue 70's part 3
    # crashed so: an index_copy out of bounds on a slot mapping overwritten with token ids).
    return Runnable(graph.replay, "cuda graph", tokens, (graph, out, run))


def capture(step: TrainingStep, pool: Any = None) -> Runnable:
    """`step` as a CUDA graph whose gradients are allocated inside the capture (each replay
    writes them afresh), or eagerly (replayable)."""
    runnable = replayable(step, step.device, pool, step.drop_grads, step.tokens)
    if runnable.keep:
        runnable.keep += (tuple(p.grad for p in step.params),)
    else:
        step.drop_grads()
    return runnable


def timed_ms(run: Callable[[], object], device: torch.device) -> float:
    """One run's time: between two CUDA events around it on the current stream (the device's
    time for a graph's replay), or the wall clock on the CPU."""
    if device.type != "cuda":
        began = time.perf_counter()
        run()
        return 1000 * (time.perf_counter() - began)
    start, end = timing_event(), timing_event()
    start.record()
    run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


# torch.cuda's streams and events, untyped: the CPU wheel's stubs leave some untyped and type
# Stream.priority_range, a static method on CUDA builds, as a method.
def timing_event() -> Any:
    return getattr(torch.cuda, "Event")(enable_timing=True)  # noqa: B009


def cuda_stream(priority: int = 0) -> Any:
    return getattr(torch.cuda, "Stream")(priority=priority)  # noqa: B009


def priority_range() -> tuple[int, int]:
    """(least, greatest) stream priority; the greatest priority is the lowest number."""
    least, greatest = getattr(torch.cuda, "Stream").priority_range()  # noqa: B009
    return int(least), int(greatest)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
