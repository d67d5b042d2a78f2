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
The number of boundaries a piece crosses adapts to the bound from what the last piece measured
(on CUDA one synchronisation a piece, so the time is the device's, not the launches'). Hooks
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

T = TypeVar("T")


class _Abandoned(BaseException):
    """Raised at a boundary of an abandoned run, to unwind it (not an Exception: nothing the
    trainer catches should catch it)."""


class PiecewiseRun(Generic[T]):
    def __init__(
        self,
        work: Callable[[], T],
        layers: Sequence[nn.Module],
        boundaries_per_piece: int,
        bound_s: float = math.inf,
    ) -> None:
        if boundaries_per_piece < 1 or not bound_s > 0:
            raise ValueError("a piece crosses at least one boundary, within a bound > 0")
        self.boundaries_per_piece = boundaries_per_piece
        # A piece also ends at the first boundary past half the bound by the host's clock:
        # boundaries are not alike (a loss chunk over a large vocabulary costs many layers),
        # and the count the sizer sets from the last piece's mean would put several heavy ones
        # in one piece. Half: the segment after it may be as long again. (On CUDA the host's
        # clock runs ahead of the device, so there this only ever ends a piece earlier.)
        self._yield_after_s = bound_s / 2
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

    def pause(self) -> None:
        """A boundary the work marks itself (between loss chunks, before the optimizer step:
        the unit's tail has no layer to hook); a no-op on any thread but the unit's own."""
        if threading.current_thread() is self._thread:
            self._boundary("pause")

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
        try:
            if self._abandoned:
                raise _Abandoned
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
            _sync(self._layers)
            self._done = True
            self._back.release()

    def _before_forward(self, index: int, module: nn.Module, args: object) -> None:
        self._boundary(f"forward {index}")

    def _after_forward(self, index: int, module: nn.Module, args: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            backward = functools.partial(self._before_backward, index)
            hidden.register_hook(backward)  # type: ignore[no-untyped-call]

    def _before_backward(self, index: int, grad: torch.Tensor) -> None:
        self._boundary(f"backward {index}")

    def _boundary(self, at: str) -> None:
        self._at = at
        self._crossed += 1
        early = time.perf_counter() - self._piece_began < self._yield_after_s
        if self._crossed < self.boundaries_per_piece and early:
            return
        _sync(self._layers)  # the piece's time is the device's
        self._back.release()
        self._turn.acquire()
        if self._abandoned:
            raise _Abandoned


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


class PieceSizer:
    """How many layer boundaries the next piece crosses, so that it takes about `bound_s`: from
    the seconds a boundary took in the last piece, growing at most `growth`-fold a piece."""

    def __init__(self, bound_s: float, growth: float = 2.0) -> None:
        if not bound_s > 0 or not growth > 1:
            raise ValueError("PieceSizer needs bound_s > 0 and growth > 1")
        self.bound_s, self.growth = bound_s, growth
        self.boundaries = 1  # the first piece: one layer, nothing measured
        self.piece_s: float | None = None  # the last piece's seconds

    def observe(self, boundaries: int, seconds: float) -> None:
        self.piece_s = seconds
        if boundaries < 1:
            return  # a piece with no boundary (the unit's tail): says nothing of a layer
        per = seconds / boundaries
        fit = int(self.bound_s / per) if per > 0 else self.boundaries * 2
        self.boundaries = max(1, min(fit, int(self.boundaries * self.growth) or 1))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A transformers causal LM's decoder layers (through peft's wrapper); [] when it has no
    `layers` list, and then a unit is one piece."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
