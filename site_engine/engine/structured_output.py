"""Constrained decoding at the site: a request's grammar matcher (llguidance) as the Guide the
scheduler advances and the sampler reads (site_engine/engine/core/types.py), and the masks of a
step's constrained rows, filled together on llguidance's thread pool. Compiling the matchers is
site_engine/engine/grammar_compiler.py's.

Imports no torch: the masks are written into int32 buffers the sampler owns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import numpy as np

from site_engine.engine.core.types import Guide

__all__ = ["LlgGuide", "MaskFiller", "fill_masks"]


class LlgGuide:
    """One request's grammar state (the Guide protocol)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def consume(self, token: int) -> bool:
        return bool(self._matcher.consume_token(token))

    def fill_mask(self, words: object) -> None:
        """`words`: a C-contiguous int32 numpy row of ceil(vocab / 32) words."""
        address = words.ctypes.data  # type: ignore[attr-defined]
        self._matcher.unsafe_compute_mask_ptr(address, words.nbytes)  # type: ignore[attr-defined]

    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


_executor: llguidance.LLExecutor | None = None


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


_Batch = list[tuple[llguidance.LLMatcher, int]]


def _mask_batch(guides: Sequence[Guide], words: np.ndarray) -> _Batch:
    """Readies `words` for guides' masks: every row allows all tokens until filled, guides that
    are not llguidance's fill theirs here, and llguidance's are returned for one batched call."""
    words.fill(-1)
    batch: _Batch = []
    for row, guide in enumerate(guides):
        if guide.is_finished():
            continue
        if isinstance(guide, LlgGuide):
            batch.append((guide.matcher, row))
        else:
            guide.fill_mask(words[row])
    return batch


def _fill_batch(batch: _Batch, words: np.ndarray) -> None:
    if batch:
        _shared_executor().unsafe_compute_mask_ptr(
            batch, words.ctypes.data, words.shape[1] * 4, len(words)
        )


def _finish(words: np.ndarray) -> None:
    # A row with no token allowed would sample garbage; its guide is finished or in error and
    # the scheduler ends or fails that row, so any token will do.
    words[~words.any(axis=1)] = -1


def fill_masks(guides: Sequence[Guide], words: np.ndarray) -> None:
    """Writes row i of `words` ([len(guides), ceil(vocab / 32)] int32) with guides[i]'s mask
    of allowed next tokens. llguidance's guides are computed together on its thread pool (the
    host's share of a constrained step: one call, not a Python loop of them); a guide whose
    answer is complete, or in error, allows every token (its row's token is never used: the
    scheduler ended or fails it)."""
    _fill_batch(_mask_batch(guides, words), words)
    _finish(words)


class MaskFiller:
    """Fills masks on a thread of its own while the caller goes on: llguidance computes them
    without holding the GIL, so the engine's other host work for a step (the previous step's
    update) runs at the same time instead of after them.

    One fill at a time. The thread's only Python is handing over: `start` blocks until the
    thread is inside llguidance (so it never waits for the GIL while the caller runs Python,
    which would stall both), and the thread returns the GIL only when `wait` releases it. A
    worker that also advanced grammars and built its own batches was tried and lost to GIL
    contention (bench/results/gpu_sessions/gpu_runs_2026-11-25.md)."""

    def __init__(self) -> None:
        self._go = threading.Semaphore(0)
        self._started = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._job: tuple[_Batch, np.ndarray] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grammar-masks", daemon=True)
        self._thread.start()

    @property
    def _busy(self) -> bool:
        return self._job is not None

    def start(self, guides: Sequence[Guide], words: np.ndarray) -> None:
        """Begins `fill_masks(guides, words)`; `words` must stay untouched until `wait`."""
        if self._busy:
            raise RuntimeError("a mask fill is already running")
        if not self._thread.is_alive():
            raise RuntimeError("the mask filler was closed")
        self._job = (_mask_batch(guides, words), words)
        self._go.release()
        self._started.acquire()

    def wait(self) -> None:
        """Returns once the fill `start` began has written every row."""
        if not self._busy:
            return
        self._done.acquire()
        assert self._job is not None
        words, self._job = self._job[1], None
        error, self._error = self._error, None
        if error is not None:
            raise error
        _finish(words)

    def close(self) -> None:
        self.wait()
        if self._thread.is_alive():
            self._go.release()  # no job: the thread ends
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job = self._job
            if job is None:
                return
            self._started.release()
            try:
                _fill_batch(*job)
            except BaseException as exc:  # handed to the caller's wait()
                self._error = exc
            self._done.release()
