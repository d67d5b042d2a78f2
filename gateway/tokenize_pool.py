"""Tokenizing off the event loop. A prompt takes about a second per MiB to tokenize
(bench/results/security/tokenize_cost.md); on the loop that held every stream and /healthz. The
tokenizers release the GIL while they encode, so a small thread pool keeps the loop free; at
most `threads` requests are prepared at once, the others wait their turn on the loop (their
bodies are already bounded by GATEWAY_MAX_BODY_BYTES).

A small request (a body of at most `inline_bytes`) is prepared on the loop instead: it takes
tens of microseconds, less than the hand-off to a thread and back costs.

Fine-tuning files are not checked here: they have processes of their own
(gateway/fine_tuning/checker.py), so that no file, however large, holds a request's turn
(issue 67: two 20 MiB files held both threads, and a 3 KB chat waited 150 s)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
A = TypeVar("A")
# About a millisecond of templating and tokenizing at most (bench/results/security/tokenize_cost.md:
# a second per MiB): what the loop may spend on one request without holding the others up.
INLINE_BYTES = 1024


class TokenizePool:
    def __init__(self, threads: int, inline_bytes: int = INLINE_BYTES) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._turns = asyncio.Semaphore(threads)
        self._inline_bytes = inline_bytes

    async def run(self, prepare: Callable[[A], T], request: A, size: int | None = None) -> T:
        """`prepare(request)` on a pool thread, or here for a request whose body is at most
        `inline_bytes` long (`size`); its exceptions (InvalidRequest, ...) come back."""
        if size is not None and size <= self._inline_bytes:
            return prepare(request)
        async with self._turns:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, prepare, request
            )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
