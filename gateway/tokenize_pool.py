"""Tokenizing off the event loop. A prompt takes about a second per MiB to tokenize
(bench/results/tokenize_cost.md); on the loop that held every stream and /healthz. The
tokenizers release the GIL while they encode, so a small thread pool keeps the loop free; at
most `threads` requests are prepared at once, the others wait their turn on the loop (their
bodies are already bounded by GATEWAY_MAX_BODY_BYTES)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
A = TypeVar("A")


class TokenizePool:
    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._turns = asyncio.Semaphore(threads)

    async def run(self, prepare: Callable[[A], T], request: A) -> T:
        """`prepare(request)` on a pool thread; its exceptions (4xx OpenAIError) come back."""
        async with self._turns:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, prepare, request
            )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
