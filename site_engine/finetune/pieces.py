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
CUDA from events at the boundaries, so the time is the device's, not the launches'). Hooks
live on the trainer's own copy of the modules (site_engine/finetune/trainer.py), never on the
serving model's, and only while a unit runs.

On CUDA a piece's end is not waited for (PieceLedger): its kernels are queued on the stream the
serving steps use, and the engine's thread goes on to prepare and launch the next step while the
device still runs the piece. Waiting for the device at each piece's end (and its start, for the
step queued before it) left the device idle through the engine's host work for every step, with
a piece beside every step in rows mode. A piece's device time and its segments' costs are read
from its events once they have passed, at the latest when the next piece begins.

An abandoned run (its job cancelled or failed mid-unit) is resumed with an exception raised at
its boundary, which unwinds its forward or backward; its gradients are then partial and the
trainer drops them (LoraTrainer.abandon_partial_step).
"""

from __future__ import annotations

import functools
import gc
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from site_engine.finetune.segment_costs import PieceBudget, SegmentCosts, SegmentKind

T = TypeVar("T")
Mark = float | torch.cuda.Event  # a point on a piece's clock (_Clock)

# Segments that always begin a piece. The unwind's cost is mostly the host's (autograd walks the
# unit's whole graph before it launches anything): inside a piece the device waited for it, and
# the last loss chunk with the unwind took 10-11 ms against 5 ms pieces (the H200, issue 76's
# r89 runs), its device time 7 ms of 14 on the host. First in a piece, the walk runs while the
# device still works through the serving step queued before the piece.
_CUT_BEFORE: frozenset[SegmentKind] = frozenset({"unwind"})


class _Abandoned(BaseException):
    """Raised at a boundary of an abandoned run, to unwind it (not an Exception: nothing the
    trainer catches should catch it)."""


@dataclass(slots=True)
class _ClosedPiece:
    owner: object  # the run it belongs to
    segments: list[tuple[SegmentKind, Mark, Mark]]
    tokens: int  # the unit's, for the kinds whose cost scales with it
    began: Mark
    ended: Mark
    host_s: list[float]  # each segment's time on the host's clock (its launches, on CUDA)


@dataclass(frozen=True, slots=True)
class MeasuredPiece:
    """A piece as measured (PieceLedger.observer): a bench's view of what took its time. A
    segment whose device time is about its host time was waiting for its launches."""

    seconds: float
    tokens: int
    segments: tuple[tuple[SegmentKind, float, float], ...]  # (kind, device s, host s)


class PieceLedger:
    """Pieces ended but not yet measured: each one's device time, and its segments' costs
    learned into `costs`, once its last event has passed. `deferred` (a CUDA clock): a piece is
    not waited for as it ends, only when `take(wait=True)` asks, and then for its own last event,
    not for the work queued after it; else it is measured as it ends (host marks are already the
    device's time there)."""

    def __init__(self, costs: SegmentCosts, deferred: bool = False) -> None:
        self.costs, self.deferred = costs, deferred
        self._closed: list[_ClosedPiece] = []
        self._measured: list[tuple[object, float]] = []
        self.observer: Callable[[MeasuredPiece], None] | None = None  # told of every piece

    def close(self, piece: _ClosedPiece) -> None:
        self._closed.append(piece)
        if not self.deferred:
            self._learn()

    def take(self, wait: bool = True) -> list[tuple[object, float]]:
        """(owner run, seconds) of each piece measured since the last take, oldest first;
        with `wait`, the pieces not yet measured are waited for first."""
        if wait:
            self._learn()
        measured, self._measured = self._measured, []
        return measured

    def _learn(self) -> None:
        closed, self._closed = self._closed, []
        if closed and isinstance(closed[-1].ended, torch.cuda.Event):
            closed[-1].ended.synchronize()  # the others passed before it, on one stream
        for piece in closed:
            segments = []
            for (kind, began, ended), host_s in zip(piece.segments, piece.host_s, strict=True):
                seconds = elapsed_s(began, ended)
                self.costs.observe(kind, piece.tokens, seconds)
                segments.append((kind, seconds, host_s))
            seconds = elapsed_s(piece.began, piece.ended)
            self._measured.append((piece.owner, seconds))
            if self.observer is not None:
                self.observer(MeasuredPiece(seconds, piece.tokens, tuple(segments)))


class PiecewiseRun(Generic[T]):
    def __init__(
        self,
        work: Callable[[], T],
        layers: Sequence[nn.Module],
        costs: SegmentCosts,
        bound_s: float = math.inf,
        tokens: Callable[[], int] = lambda: 0,
        embedding: nn.Module | None = None,
        ledger: PieceLedger | None = None,
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
        # Where the pieces' device time goes (the caller's, shared across units, or one that
        # measures each piece as it ends).
        self._ledger = ledger if ledger is not None else PieceLedger(costs)
        if self._ledger.costs is not costs:
            raise ValueError("a ledger learns into the run's own costs")
        # The segment under way; with an embedding to hook, the unit's start is two segments.
        self._kind: SegmentKind = "head" if embedding is None else "stage"
        self._embedding = embedding
        self._mark: Mark = 0.0  # where it began, on the clock (set as a piece begins)
        self._piece_mark: Mark = 0.0  # where the piece under way began
        self._segments: list[tuple[SegmentKind, Mark, Mark]] = []
        self._host_s: list[float] = []  # each of those segments' host time
        self._host_mark = 0.0
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
        self._collector_was_on = True
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
        thread but the unit's own. An unwind always begins a piece (_CUT_BEFORE)."""
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
            end = self._clock.mark()
            if not self._abandoned:
                self._segments.append((self._kind, self._mark, end))
                self._host_s.append(time.perf_counter() - self._host_mark)
            self._close_piece(end)
            self._done = True
            self._release_collector()
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
        host_now = time.perf_counter()
        self._host_s.append(host_now - self._host_mark)
        self._mark, self._host_mark = now, host_now
        in_time = time.perf_counter() - self._piece_began < self._bound_s
        fits = upcoming not in _CUT_BEFORE and self._budget.fits(finished, upcoming, self._tokens())
        if in_time and fits:
            return
        self._close_piece(now)
        self._release_collector()
        self._back.release()
        self._turn.acquire()
        self._resumed()
        if self._abandoned:
            raise _Abandoned

    def _hold_collector(self) -> None:
        """No automatic collection while the piece holds the turn: a full one walks the heap
        for 10-35 ms (the H200 runs), inside a 5 ms piece, whichever thread's allocation set it
        off. It runs at the first allocation after the hand-back instead, on the engine's
        thread, while the device still works through the piece just queued."""
        self._collector_was_on = gc.isenabled()
        gc.disable()

    def _release_collector(self) -> None:
        if self._collector_was_on:
            gc.enable()

    def _resumed(self) -> None:
        """A piece begins: its clock and its budget start again, with the costs the pieces
        before it measured (a deferred ledger's owner takes its pieces before each step())."""
        self._hold_collector()
        self._mark = self._piece_mark = self._clock.mark()
        self._host_mark = time.perf_counter()
        self._budget = PieceBudget(self._costs, self._bound_s)

    def _close_piece(self, end: Mark) -> None:
        """The piece's segments go to the ledger, measured when their marks have passed."""
        segments, self._segments = self._segments, []
        host_s, self._host_s = self._host_s, []
        self._ledger.close(
            _ClosedPiece(self, segments, self._tokens(), self._piece_mark, end, host_s)
        )


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


def elapsed_s(began: Mark, ended: Mark) -> float:
    """Seconds between two marks of one clock (CUDA events that have both passed, or host
    times)."""
    if isinstance(began, torch.cuda.Event) and isinstance(ended, torch.cuda.Event):
        milliseconds: float = began.elapsed_time(ended)
        return max(0.0, milliseconds / 1000)
    if isinstance(began, float) and isinstance(ended, float):
        return max(0.0, ended - began)
    raise TypeError("marks of one clock only")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A transformers causal LM's decoder layers (through peft's wrapper); [] when it has no
    `layers` list, and then a unit is one piece."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
