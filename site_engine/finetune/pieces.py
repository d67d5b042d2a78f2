"""One unit of training run in pieces at decoder-layer boundaries, so that no hold of the engine's
loop is much longer than the time bound, whatever the unit: its first one (nothing measured
yet), one example longer than the bound allows (a sequence is never cut), or the optimizer
step's unit.

The unit runs on a thread of its own, handed the engine's thread's turn and handing it back:
only one of the two ever runs (a strict hand-off through two semaphores), so the model and the
device are used by one thread at a time, as before. A piece ends at a layer boundary: before a
decoder layer's forward (a forward pre-hook) or before its backward (a hook on the gradient of
its output, set when its forward ran), or where the work calls `pause` (the trainer does
between the loss's token chunks and before the optimizer step, which no layer's hook reaches).
A piece goes on past a boundary only while the next segment is predicted to fit its bound, from
each kind of segment's cost measured on the device (site_engine/finetune/segment_costs.py; on
CUDA one synchronisation a piece, so the time is the device's, not the launches'). Hooks
live on the trainer's own copy of the modules (site_engine/finetune/trainer.py), never on the
serving model's, and only while a unit runs.

An abandoned run (its job cancelled or failed mid-unit) is resumed with an exception raised at
its boundary, which unwinds its forward or backward; its gradients are then partial and the
trainer drops them (LoraTrainer.abandon_partial_step).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from site_engine.finetune.segment_costs import PieceBudget, SegmentCosts, SegmentKind

T = TypeVar("T")
Mark = float | torch.cuda.Event  # a point on a piece's clock (_Clock)


class _Abandoned(BaseException):
    """Raised at a boundary of an abandoned run, to unwind it (not an Exception: nothing the
    trainer catches should catch it)."""


class PiecewiseRun(Generic[T]):
    def __init__(
        self,
        work: Callable[[], T],
        layers: Sequence[nn.Module],
        costs: SegmentCosts,
        bound_s: float = math.inf,
        tokens: Callable[[], int] = lambda: 0,
        embedding: nn.Module | None = None,
    ) -> None:
        if not bound_s > 0:
            raise ValueError("a piece's bound must be > 0")
        # A piece goes on into the next segment only while the costs learned so far say it
        # fits (segment_costs.py); an unknown kind ends it. The host's clock also ends it once
        # past the bound: on a CPU that is the device's time, and on CUDA, where the host runs
        # ahead, it only ever ends a piece earlier.
        self._costs, self._bound_s, self._tokens = costs, bound_s, tokens
        self._budget = PieceBudget(costs, bound_s)
        self._clock = _Clock(layers)
        # The segment under way; with an embedding to hook, the unit's start is two segments.
        self._kind: SegmentKind = "head" if embedding is None else "stage"
        self._embedding = embedding
        self._mark: Mark = 0.0  # where it began, on the clock (set as a piece begins)
        self._segments: list[tuple[SegmentKind, Mark, Mark]] = []
        self._piece_began = 0.0
        self._work = work
        self._layers = list(layers)
        self._turn = threading.Semaphore(0)  # the unit's thread may run
        self._back = threading.Semaphore(0)  # the engine's thread may run
        self._crossed = 0  # boundaries crossed in this piece
        self._abandoned = False
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._handles: list[RemovableHandle] = []
        self._thread = threading.Thread(target=self._main, name="finetune-unit", daemon=True)
        self._started = False
        self.last_piece_boundaries = 0
        # Where the last piece ended ("forward 12", "backward 3", "pause", "end"): a timeline
        # names what a long piece was doing (bench/engine/finetune_timeline.py).
        self.ended_at = ""
        self._at = ""

    @property
    def done(self) -> bool:
        return self._done

    def step(self) -> bool:
        """Runs the unit's next piece (engine thread); True once the unit has ended."""
        if self._done:
            return True
        self._crossed = 0
        self._piece_began = time.perf_counter()
        if not self._started:
            self._started = True
            self._thread.start()
        self._turn.release()
        self._back.acquire()
        self.last_piece_boundaries = self._crossed
        self.ended_at = "end" if self._done else self._at
        return self._done

    def result(self) -> T:
        """The unit's result once done; its exception raised again if it failed."""
        assert self._done, "the unit has not ended"
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def pause(self, upcoming: SegmentKind = "loss") -> None:
        """A boundary the work marks itself, before a segment of kind `upcoming` (a loss
        chunk, the optimizer step: the unit's tail has no layer to hook); a no-op on any
        thread but the unit's own."""
        if threading.current_thread() is self._thread:
            self._boundary("pause", upcoming)

    def abandon(self) -> None:
        """Ends a run not done (its thread unwinds at its boundary, its hooks go)."""
        if self._done:
            return
        self._abandoned = True
        if not self._started:
            self._done = True
            return
        self._turn.release()
        self._back.acquire()

    # ---- the unit's thread -----------------------------------------------------------------
    def _main(self) -> None:
        self._turn.acquire()
        self._resumed()
        try:
            if self._abandoned:
                raise _Abandoned
            if self._embedding is not None:
                self._handles.append(self._embedding.register_forward_pre_hook(self._before_head))
            for index, layer in enumerate(self._layers):
                before = functools.partial(self._before_forward, index)
                after = functools.partial(self._after_forward, index)
                self._handles.append(layer.register_forward_pre_hook(before))
                self._handles.append(layer.register_forward_hook(after))
            self._result = self._work()
        except _Abandoned:
            pass
        except BaseException as exc:  # the engine's thread raises it again (result())
            self._error = exc
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if not self._abandoned:
                self._segments.append((self._kind, self._mark, self._clock.mark()))
            self._settle_and_learn()
            self._done = True
            self._back.release()

    def _before_head(self, module: nn.Module, args: object) -> None:
        self._boundary("embedding", "head")

    def _before_forward(self, index: int, module: nn.Module, args: object) -> None:
        self._boundary(f"forward {index}", "forward")

    def _after_forward(self, index: int, module: nn.Module, args: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            backward = functools.partial(self._before_backward, index)
            hidden.register_hook(backward)  # type: ignore[no-untyped-call]

    def _before_backward(self, index: int, grad: torch.Tensor) -> None:
        self._boundary(f"backward {index}", "backward")

    def _boundary(self, at: str, upcoming: SegmentKind) -> None:
        self._at = at
        self._crossed += 1
        now = self._clock.mark()
        finished, self._kind = self._kind, upcoming
        self._segments.append((finished, self._mark, now))
        self._mark = now
        in_time = time.perf_counter() - self._piece_began < self._bound_s
        if in_time and self._budget.fits(finished, upcoming, self._tokens()):
            return
        self._settle_and_learn()
        self._back.release()
        self._turn.acquire()
        self._resumed()
        if self._abandoned:
            raise _Abandoned

    def _resumed(self) -> None:
        """A piece begins: its clock and its budget start again."""
        self._mark = self._clock.mark()
        self._budget = PieceBudget(self._costs, self._bound_s)

    def _settle_and_learn(self) -> None:
        """Waits for the piece's device work (its time is the device's), then learns each
        segment's cost from the marks at its boundaries."""
        _sync(self._layers)
        tokens = self._tokens()
        for kind, began, ended in self._segments:
            self._costs.observe(kind, tokens, self._clock.seconds(began, ended))
        self._segments.clear()


class _Clock:
    """Marks on the device's timeline (CUDA events, recorded on the unit's stream and read
    after the piece synchronised) or, off CUDA, the host's, which is the device's there."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        parameter = next((p for layer in layers for p in layer.parameters()), None)
        self._cuda = parameter is not None and parameter.device.type == "cuda"

    def mark(self) -> Mark:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def seconds(self, began: Mark, ended: Mark) -> float:
        if isinstance(began, torch.cuda.Event) and isinstance(ended, torch.cuda.Event):
            milliseconds: float = began.elapsed_time(ended)
            return max(0.0, milliseconds / 1000)
        if isinstance(began, float) and isinstance(ended, float):
            return max(0.0, ended - began)
        raise TypeError("marks of one clock only")


def settle_device(model: nn.Module) -> None:
    """Waits for the device work already queued (an asynchronous engine's step still running)
    before a piece is timed: a piece's closing synchronisation would wait for it too, and that
    wait is the serving step's time, not training's (the H200 timeline counted 100-175 ms
    prefill steps as pieces of a few layers). The piece's own end waits the same way. A no-op off
    CUDA."""
    for parameter in model.parameters():
        if parameter.device.type == "cuda":
            torch.cuda.synchronize(parameter.device)
        return


def _sync(layers: Sequence[nn.Module]) -> None:
    if layers:
        settle_device(layers[0])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A transformers causal LM's decoder layers (through peft's wrapper); [] when it has no
    `layers` list, and then a unit is one piece."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
