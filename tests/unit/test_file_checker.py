"""The gateway's file checks between keys (gateway/fine_tuning/checker.py, issue 75), with a real
checking process: a waiting check holds its job's file ids only (its bytes are read when its turn
comes), keys take turns, a cancelled check stops at once (waiting or running), what a key has
there counts, and the process ends with the checker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest

from fedllm_contract.training_data import Summary
from gateway.errors import GatewayError
from gateway.fine_tuning.checker import CheckCancelled, CheckedFile, FileChecker
from gateway.fine_tuning.limits import TrainingLimits

LINE = json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"}]}).encode()  # fmt: skip
# At 1% of a CPU, 200,000 lines take many seconds to check: one still under way when it is
# cancelled.
SLOW = (LINE + b"\n") * 200_000
A, B, C, D = 1, 2, 3, 4  # API key ids


def source(
    name: str, data: bytes, read: list[str], began: asyncio.Event
) -> Callable[[], AsyncIterator[bytes]]:
    async def parts() -> AsyncIterator[bytes]:
        read.append(name)
        began.set()
        for start in range(0, len(data), 1 << 20):
            yield data[start : start + (1 << 20)]

    return parts


def test_checks_wait_as_ids_take_turns_and_stop_at_once() -> None:
    async def scenario() -> None:
        checker = FileChecker(workers=1, cpu_share=0.01)
        read: list[str] = []
        began = asyncio.Event()

        def check(key: int, job: str, data: bytes) -> asyncio.Task[Summary]:
            files = [CheckedFile("training_file", source(job, data, read, began))]
            return asyncio.ensure_future(checker.check(key, job, files, None))

        first = check(A, "a1", SLOW)
        await began.wait()  # its turn came at once: its bytes are being read
        second, third = check(A, "a2", LINE), check(B, "b1", LINE + b"\n" + LINE)
        await asyncio.sleep(0)  # both queued behind the one running
        assert read == ["a1"]  # their bytes wait in their store, unread
        assert (checker.held(A), checker.held(B), checker.held(None)) == (2, 1, 0)
        limits = TrainingLimits(jobs_per_key=5, tokens_per_day=10**9, validations_per_key=2)
        with pytest.raises(GatewayError) as busy:  # what a key has here counts
            limits.check("key a", None, [], 1, checking=checker.held(A))
        assert busy.value.code == "fine_tuning_validations_limit_exceeded"
        await checker.cancel("a1")  # returns once it no longer runs
        with pytest.raises(CheckCancelled):
            await first
        # b's check goes before a's second: a's first just had the process.
        assert (await third).examples == 2
        assert read[:2] == ["a1", "b1"]
        assert (await second).examples == 1
        # A waiting check is taken out of the line: it never reads its file.
        blocker, waiting = check(C, "c1", SLOW), check(D, "d1", LINE)
        await asyncio.sleep(0)
        await checker.cancel("d1")
        with pytest.raises(CheckCancelled):
            await waiting
        assert "d1" not in read
        await checker.cancel("c1")
        with pytest.raises(CheckCancelled):
            await blocker
        assert checker.job_ids() == []
        await checker.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
