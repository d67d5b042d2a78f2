"""A fine-tuning job's files checked in processes of their own, once, when the job is made.

Every line gets the check the site runs too (fedllm_contract/training_data.py), and a line longer
than the model's context is refused, named, as the site would have cut it
(fedllm_contract/training_tokens.py). A file with any bad line is refused whole, naming its first
bad lines and why, so that a tenant fixes them all at once.

The checks run in a pool of GATEWAY_FINE_TUNING_VALIDATION_WORKERS processes, never on the
gateway's event loop nor on its tokenize pool (issue 67: two 20 MiB files on the two threads that
also prepare chat requests held another tenant's 3 KB chat for 150 s). In a process of its own a
check holds no lock the gateway's threads need, so it needs no per-line yield either, which had
multiplied its wall time under load without bound.

A check still takes CPU from the serving beside it. Each process runs at a lower priority (nice
CHECK_NICENESS), and holds itself to GATEWAY_FINE_TUNING_VALIDATION_CPU_SHARE of a CPU: after
each CPU_SLICE_S of work it sleeps for as long as the share says (at 0.5, as long as it worked),
so a check's wall time is at most 1 / share its CPU time on an idle host, and serving finds a
free CPU for the rest. Priority alone was not enough on the 2-core test host (a virtual machine
whose cores are shared): a process at nice 19 that never slept made another tenant's chats 3.7x
slower (median 100 against 27 ms), one that slept half the time 1.5x (40 ms). The processes are
spawned (never forked from a gateway that runs threads) when the first check comes, and each
keeps the tokenizers it loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fedllm_contract import training_data
from fedllm_contract.training_data import Summary, TrainingFileError
from gateway.errors import GatewayError, Unavailable, invalid_request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
# How much lower than the gateway's a checking process's CPU priority is: at nice 10 it weighs
# about a tenth of a process at nice 0 where both want the CPU (Linux's CFS and EEVDF weights).
CHECK_NICENESS = 10
# The CPU time a check works between two of its pauses: short enough that a request waits little
# for a CPU, long enough that the pauses cost nothing.
CPU_SLICE_S = 0.01


@dataclass(slots=True)
class CpuShare:
    """Holds this process to `share` of a CPU: `pace`, called often, sleeps once a slice of
    work is done, for as long as the share says."""

    share: float
    _worked_from: float = field(default_factory=time.process_time)

    def pace(self) -> bool:
        """training_data's `stop`: never stops the check, only holds its pace."""
        worked = time.process_time() - self._worked_from
        if worked >= CPU_SLICE_S:
            if self.share < 1:
                time.sleep(worked * (1 - self.share) / self.share)
            self._worked_from = time.process_time()
        return False


@dataclass(frozen=True, slots=True)
class LengthLimit:
    """The model's tokenizer (its directory, as the federation file names it), the context a
    training line may fill and the tokens the training sites' memory reserve holds of one
    example (None: they do not say)."""

    tokenizer: str
    context: int
    reserve: int | None = None


# A worker process's tokenizers, by directory, loaded at its first length check.
_tokenizers: dict[str, PreTrainedTokenizerBase] = {}


def check_file(content: bytes, limit: LengthLimit | None, cpu_share: float = 1.0) -> Summary:
    """In a worker process: the file's summary; TrainingFileError naming its bad lines. It
    holds to `cpu_share` of a CPU."""
    extra = None
    if limit is not None:
        # Imported here: a worker that checks no length never loads transformers.
        from fedllm_contract.tokenizer import load_tokenizer
        from fedllm_contract.training_tokens import ContextCheck

        tokenizer = _tokenizers.get(limit.tokenizer)
        if tokenizer is None:
            tokenizer = _tokenizers[limit.tokenizer] = load_tokenizer(limit.tokenizer)
        extra = ContextCheck(tokenizer, limit.context, limit.reserve)
    return training_data.check(content, extra, CpuShare(cpu_share).pace)


def refusal(exc: TrainingFileError, param: str) -> GatewayError:
    """400 (`param` at fault, code invalid_training_file) listing the first bad lines by
    number, or for an empty file."""
    return invalid_request(str(exc), param=param, code="invalid_training_file")


def check_training_file(content: bytes, param: str, limit: LengthLimit | None = None) -> Summary:
    """check_file in this process, refused as the API refuses (the tests' way in)."""
    try:
        return check_file(content, limit)
    except TrainingFileError as exc:
        raise refusal(exc, param) from exc


def _lower_priority() -> None:
    """A checking process's start: CHECK_NICENESS below its parent (a no-op where the host
    refuses it)."""
    with contextlib.suppress(OSError):
        os.nice(CHECK_NICENESS)


class FileChecker:
    """The pool of checking processes (started at the first check)."""

    def __init__(self, workers: int, cpu_share: float = 1.0) -> None:
        self._workers = workers
        self._cpu_share = cpu_share
        self._pool: ProcessPoolExecutor | None = None

    async def check(self, content: bytes, param: str, limit: LengthLimit | None) -> Summary:
        """The file's summary, checked in a worker process; `refusal` for a bad line."""
        pool = self._started()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, check_file, content, limit, self._cpu_share
            )
        except TrainingFileError as exc:
            raise refusal(exc, param) from exc
        except BrokenProcessPool as exc:  # a worker died (killed, out of memory): a new pool
            log.error("fine-tuning: a file-checking process died; starting new ones")
            if self._pool is pool:
                self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise Unavailable(
                "the training file could not be checked (a checking process stopped): retry",
                code="validation_failed",
                retry_after_s=1,
            ) from exc

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self._workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_lower_priority,
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
