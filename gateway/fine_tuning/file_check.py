"""A fine-tuning job's file checked, once, when the job is made: what a checking process runs
(gateway/fine_tuning/check_worker.py; gateway/fine_tuning/checker.py runs those processes).

Every line gets the check the site runs too (fedllm_contract/training_data.py), and a line longer
than the model's context, or than the training sites' memory reserve holds of one example, is
refused, named, as the site would have cut or failed it (fedllm_contract/training_tokens.py). A
file with any bad line is refused whole, naming its first bad lines and why, so that a tenant
fixes them all at once.

A check takes CPU from the serving beside it. Its process runs at a lower priority (nice
CHECK_NICENESS), and holds itself to GATEWAY_FINE_TUNING_VALIDATION_CPU_SHARE of a CPU: after
each CPU_SLICE_S of work it pauses for as long as the share says (at 0.5, as long as it worked),
so a check's wall time is at most 1 / share its CPU time on an idle host, and serving finds a
free CPU for the rest. Priority alone was not enough on the 2-core test host (a virtual machine
whose cores are shared): a process at nice 19 that never slept made another tenant's chats 3.7x
slower (median 100 against 27 ms), one that slept half the time 1.5x (40 ms). A pause ends
early, and the check stops, once the check is cancelled (`stopped`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fedllm_contract import training_data
from fedllm_contract.training_data import Summary, TrainingFileError
from gateway.errors import GatewayError, invalid_request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
# How much lower than the gateway's a checking process's CPU priority is: at nice 10 it weighs
# about a tenth of a process at nice 0 where both want the CPU (Linux's CFS and EEVDF weights).
CHECK_NICENESS = 10
# The CPU time a check works between two of its pauses: short enough that a request waits little
# for a CPU, long enough that the pauses cost nothing.
CPU_SLICE_S = 0.01


def _never() -> bool:
    return False


@dataclass(slots=True)
class CpuShare:
    """Holds this process to `share` of a CPU: `pace`, called often, pauses once a slice of
    work is done, for as long as the share says. `pause` waits (a wait that a cancel ends
    early: threading.Event.wait), `stopped` says the check is cancelled."""

    share: float
    pause: Callable[[float], object] = time.sleep
    stopped: Callable[[], bool] = _never
    _worked_from: float = field(default_factory=time.process_time)

    def pace(self) -> bool:
        """training_data's `stop`: holds the check's pace, and stops it once it is cancelled."""
        worked = time.process_time() - self._worked_from
        if worked >= CPU_SLICE_S:
            if self.share < 1 and not self.stopped():
                self.pause(worked * (1 - self.share) / self.share)
            self._worked_from = time.process_time()
        return self.stopped()


@dataclass(frozen=True, slots=True)
class LengthLimit:
    """The model's tokenizer (its directory, as the federation file names it), the context a
    training line may fill and the tokens the training sites' memory reserve holds of one
    example (None: they do not say)."""

    tokenizer: str
    context: int
    reserve: int | None = None


# A checking process's tokenizers, by directory, each loaded once.
_tokenizers: dict[str, PreTrainedTokenizerBase] = {}


def tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `directory`, loaded at its first use in this process."""
    # Imported here: a process that checks no length never loads transformers.
    from fedllm_contract.tokenizer import load_tokenizer

    found = _tokenizers.get(directory)
    if found is None:
        found = _tokenizers[directory] = load_tokenizer(directory)
    return found


def check_file(
    content: bytes, limit: LengthLimit | None, pacing: CpuShare | None = None
) -> Summary:
    """In a checking process: the file's summary; TrainingFileError naming its bad lines;
    training_data.Stopped once `pacing` says the check is cancelled."""
    extra = None
    if limit is not None:
        from fedllm_contract.training_tokens import ContextCheck  # transformers, as above

        extra = ContextCheck(tokenizer(limit.tokenizer), limit.context, limit.reserve)
    return training_data.check(content, extra, (pacing or CpuShare(1.0)).pace)


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
