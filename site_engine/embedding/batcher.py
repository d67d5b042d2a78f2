"""Dynamic batching of embedding requests: the inputs of every request waiting at the site go
through the encoder together, as many per forward pass as the batch limits allow, on a thread of
its own (a forward pass never blocks the gRPC or HTTP event loop).

There is no decoding: a request is done once each of its inputs has been through one forward
pass. Inputs queue in arrival order, each request's sorted by length, so the rows of a pass
are of similar length and padding wastes little; a pass takes inputs while (inputs x the
longest) stays within `max_batch_tokens` and the count within `max_batch_inputs`. Inputs of
requests that arrive while a pass runs join the next pass, whichever request they belong to.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from site_engine.engine_service import DuplicateRequest, EngineFailure, QueueFull
from site_engine.step_rates import StepRates, StepWork

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05
# OpenAI's bound on the inputs of one embeddings request.
MAX_INPUTS = 2048


class InvalidEmbedRequest(ValueError):
    """The request cannot be embedded as sent (the message says why); nothing was queued."""


class Embedder(Protocol):
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[bytes]: ...


@dataclass(frozen=True, slots=True)
class EmbeddingLimits:
    """Inputs per forward pass, padded tokens per forward pass (inputs x the longest), and the
    requests that may wait before the site answers RESOURCE_EXHAUSTED."""

    max_batch_inputs: int
    max_batch_tokens: int
    max_queued_requests: int = 1024


def embedding_batch_defaults(device_type: str) -> tuple[int, int]:
    """(inputs, padded tokens) per forward pass where the operator set none: a CPU pass of 32
    MiniLM rows of 256 tokens takes about a second on one core; a GPU takes far more at once."""
    return (32, 8192) if device_type == "cpu" else (512, 131072)


@dataclass(frozen=True, slots=True)
class EmbedOutput:
    # One vector per input, in order, as float32 little-endian bytes.
    vectors: tuple[bytes, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingStats:
    queued_requests: int = 0
    running_requests: int = 0
    queued_tokens: int = 0
    running_tokens: int = 0
    forward_passes: int = 0
    tokens_total: int = 0


@dataclass(slots=True, eq=False)
class _Job:
    request_id: str
    inputs: tuple[tuple[int, ...], ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[EmbedOutput]
    vectors: list[bytes] = field(default_factory=list)
    left: int = 0
    started: bool = False
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.vectors = [b""] * len(self.inputs)
        self.left = len(self.inputs)

    def resolve(self) -> None:
        output = EmbedOutput(tuple(self.vectors), sum(map(len, self.inputs)))
        self.loop.call_soon_threadsafe(_set_result, self.future, output)

    def fail(self, message: str) -> None:
        self.cancelled = True
        self.loop.call_soon_threadsafe(_set_exception, self.future, EngineFailure(message))


def _set_result(future: asyncio.Future[EmbedOutput], output: EmbedOutput) -> None:
    if not future.done():
        future.set_result(output)


def _set_exception(future: asyncio.Future[EmbedOutput], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


class EmbeddingBatcher:
    def __init__(
        self, runner: Embedder, limits: EmbeddingLimits, max_seq_length: int, vocab_size: int
    ) -> None:
        if limits.max_batch_tokens < max_seq_length:
            raise ValueError(
                f"max_batch_tokens ({limits.max_batch_tokens}) must hold one input of the "
                f"model's longest ({max_seq_length} tokens)"
            )
        self._runner = runner
        self.limits = limits
        self.max_seq_length = max_seq_length
        self.vocab_size = vocab_size
        self._cond = threading.Condition()
        self._queue: deque[tuple[_Job, int]] = deque()
        self._jobs: dict[str, _Job] = {}
        self._queued_tokens = 0
        self._running_tokens = 0
        self._passes = 0
        self._tokens_total = 0
        self._rates = StepRates()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="embedding-loop", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- asyncio side ----------------------------------------------------------------------
    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """InvalidEmbedRequest for inputs this site cannot embed as sent."""
        if not inputs or len(inputs) > MAX_INPUTS:
            raise InvalidEmbedRequest(f"a request embeds 1 to {MAX_INPUTS} inputs")
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidEmbedRequest(f"input {i} is empty")
            if len(ids) > self.max_seq_length:
                raise InvalidEmbedRequest(
                    f"input {i} has {len(ids)} tokens; this model reads at most "
                    f"{self.max_seq_length}"
                )
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                # Checked here, not left to the pass: one bad row would fail every request in it.
                raise InvalidEmbedRequest(
                    f"input {i} has a token id outside [0, {self.vocab_size}), the vocabulary"
                )

    async def embed(self, request_id: str, inputs: Sequence[Sequence[int]]) -> EmbedOutput:
        """The inputs' vectors, once every one has been through a forward pass; abandoning
        the call (the client went away) drops its inputs not embedded yet."""
        self.check(inputs)
        loop = asyncio.get_running_loop()
        job = _Job(request_id, tuple(tuple(ids) for ids in inputs), loop, loop.create_future())
        with self._cond:
            if request_id in self._jobs:
                raise DuplicateRequest(f"request {request_id!r} is already at this site")
            waiting = sum(not j.started for j in self._jobs.values())
            if waiting >= self.limits.max_queued_requests:
                raise QueueFull(
                    f"the site's queue is full ({self.limits.max_queued_requests} waiting requests)"
                )
            self._jobs[request_id] = job
            order = sorted(range(len(job.inputs)), key=lambda i: len(job.inputs[i]))
            self._queue.extend((job, i) for i in order)
            self._queued_tokens += sum(map(len, job.inputs))
            self._cond.notify()
        try:
            return await job.future
        finally:
            with self._cond:
                job.cancelled = True  # a finished job's flag is never read again
                self._jobs.pop(request_id, None)

    def stats(self) -> EmbeddingStats:
        with self._cond:
            jobs = list(self._jobs.values())
            return EmbeddingStats(
                queued_requests=sum(not j.started for j in jobs),
                running_requests=sum(j.started for j in jobs),
                queued_tokens=self._queued_tokens,
                running_tokens=self._running_tokens,
                forward_passes=self._passes,
                tokens_total=self._tokens_total,
            )

    def tokens_per_s(self) -> float:
        """Input tokens embedded per second of the recent passes (idle time left out)."""
        return self._rates.prefill_tokens_per_s(time.monotonic())

    # ---- embedding thread ------------------------------------------------------------------
    def _take(self) -> list[tuple[_Job, int]]:
        """The next pass's inputs, in queue order, within the batch limits (under the lock)."""
        batch: list[tuple[_Job, int]] = []
        longest = 0
        while self._queue:
            job, index = self._queue[0]
            length = len(job.inputs[index])
            if job.cancelled:
                self._queue.popleft()
                self._queued_tokens -= length
                continue
            wider = max(longest, length)
            if batch and (
                len(batch) + 1 > self.limits.max_batch_inputs
                or (len(batch) + 1) * wider > self.limits.max_batch_tokens
            ):
                break
            self._queue.popleft()
            self._queued_tokens -= length
            job.started = True
            batch.append((job, index))
            longest = wider
        self._running_tokens = sum(len(job.inputs[i]) for job, i in batch)
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait(_IDLE_WAIT_S)
                if self._stopping:
                    return
                batch = self._take()
            if batch:
                self._pass(batch)

    def _pass(self, batch: list[tuple[_Job, int]]) -> None:
        began = time.monotonic()
        tokens = self._running_tokens
        try:
            vectors = self._runner.embed([job.inputs[i] for job, i in batch])
        except Exception as exc:
            log.exception("embedding pass failed; failing the requests it held")
            with self._cond:
                for job in {job for job, _ in batch}:
                    job.fail(f"embedding pass failed: {type(exc).__name__}: {exc}")
                self._running_tokens = 0
            return
        ended = time.monotonic()
        with self._cond:
            for (job, index), vector in zip(batch, vectors, strict=True):
                job.vectors[index] = vector
                job.left -= 1
                if job.left == 0 and not job.cancelled:
                    job.resolve()
            self._passes += 1
            self._tokens_total += tokens
            self._running_tokens = 0
        self._rates.add(StepWork(ended, ended - began, 0, False, tokens))
