"""The checking of fine-tuning files: GATEWAY_FINE_TUNING_VALIDATION_WORKERS processes of their own
(gateway/fine_tuning/check_worker.py), never the gateway's event loop nor its tokenize pool
(issue 67: two 20 MiB files on the two threads that also prepare chat requests held another
tenant's 3 KB chat for 150 s), fed fairly between keys (issue 75: one key stacked the one
checking process at no cost, by creating jobs, dropping the requests and cancelling the jobs
while they were checked; the cancelled checks ran on, and another key's 8-line create took
66.8 s, while the gateway held each queued file in memory):

- keys take turns (fedllm_contract/round_robin.py): a waiting key's check goes before the next
  of a key whose check just ran;
- a check waits as its job's file ids: its files stay in the database until its turn, then go to
  a file on disk a part (1 MiB) at a time, which its process reads;
- a cancelled job's check stops at once: taken out of the line if it waits, told to stop if it
  runs (it stops at its next look, every 256 lines, and a pause of its CPU share ends), its
  process killed if it does not say so within STOP_GRACE_S;
- what a key has here counts against its GATEWAY_FINE_TUNING_VALIDATIONS_PER_KEY (`held`), a
  cancelled job's check too until it has stopped.

The processes start in the background once the gateway has a site that trains jobs (`warm`,
loading the tokenizers the length checks need) or at the first check, so that no create waits
for a cold start (issue 75: a fresh gateway's first create took 67 s under load), and end with
the gateway (`close`): a process also ends by itself as soon as its input closes, so it never
outlives the gateway, not even one that was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gateway
from fedllm_contract.round_robin import RoundRobin
from fedllm_contract.training_data import Summary, TrainingFileError
from gateway.errors import Unavailable
from gateway.fine_tuning.file_check import LengthLimit, refusal
from gateway.stores.pages import Owner

log = logging.getLogger(__name__)
# How long a check told to stop may take to say so before its process is killed (it looks every
# 256 lines: a fraction of a second, unless the host starves it).
STOP_GRACE_S = 5.0
# How long a checking process may take to end once its input is closed, before it is killed.
EXIT_GRACE_S = 5.0
# The gateway's own code, first on a checking process's path: the package this one imported.
_ROOT = str(Path(gateway.__file__).resolve().parents[1])


class CheckCancelled(Exception):
    """The job's check was stopped before it ended (its job was cancelled)."""


@dataclass(frozen=True, slots=True)
class CheckedFile:
    """One of a job's files: its field (`param` of a refusal) and its bytes, read when its
    turn comes (a GatewayError if it is gone by then)."""

    param: str
    parts: Callable[[], AsyncIterator[bytes]]


@dataclass(eq=False)
class _Check:
    owner: Owner
    job_id: str
    files: Sequence[CheckedFile]
    limit: LengthLimit | None
    result: asyncio.Future[Summary]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class _Ended(Exception):
    """The checking process ended under a check."""


class _Process:
    """One checking process: started when first needed, again after it ended."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Task[asyncio.subprocess.Process] | None = None

    @property
    def ready(self) -> bool:
        """Started, its tokenizers loaded, and running."""
        task = self._starting
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return False
        return task.result().returncode is None

    def starting(self, tokenizers: Iterable[str]) -> asyncio.Future[asyncio.subprocess.Process]:
        """The process, once started (and `tokenizers` loaded), if it was not running: a start
        of its own, which a check that stops meanwhile does not wait for."""
        task = self._starting
        if task is None or (task.done() and not self.ready):
            task = self._starting = asyncio.ensure_future(self._start(sorted(tokenizers)))
            task.add_done_callback(_start_failed)
        return asyncio.shield(task)

    async def _start(self, tokenizers: list[str]) -> asyncio.subprocess.Process:
        path = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
        process = self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.fine_tuning.check_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        self.tell({"op": "load", "tokenizers": tokenizers})
        await self.answer(process)
        return process

    def tell(self, request: dict[str, Any]) -> None:
        process = self._process
        if process is not None and process.returncode is None and process.stdin is not None:
            with contextlib.suppress(ConnectionError):  # it ended: its reader says so
                process.stdin.write(json.dumps(request).encode() + b"\n")

    async def answer(self, process: asyncio.subprocess.Process) -> dict[str, Any]:
        assert process.stdout is not None
        line = await process.stdout.readline()
        if not line:
            await process.wait()
            raise _Ended(f"exit status {process.returncode}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def kill(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        """Closes its input (it exits at once) and waits for it; killed if it does not end."""
        if self._starting is not None:
            self._starting.cancel()
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), EXIT_GRACE_S)
        except TimeoutError:
            process.kill()
            await process.wait()


class FileChecker:
    def __init__(self, workers: int, cpu_share: float = 1.0) -> None:
        self._processes = [_Process() for _ in range(workers)]
        self._cpu_share = cpu_share
        self._waiting: RoundRobin[Owner, _Check] = RoundRobin()
        self._held: dict[str, _Check] = {}  # by job id: waiting or running
        self._arrived = asyncio.Event()
        self._serving: dict[int, asyncio.Task[None]] = {}  # by process
        self._tokenizers: set[str] = set()
        self._staging: Path | None = None
        self._closed = False

    def warm(self, tokenizers: Iterable[str]) -> None:
        """Starts the checking processes now, loading `tokenizers` (their length checks')."""
        self._tokenizers.update(tokenizers)
        self._serve(warm=True)

    def ready(self) -> int:
        """How many checking processes run, their tokenizers loaded."""
        return sum(process.ready for process in self._processes)

    def held(self, owner: Owner) -> int:
        """How many checks of `owner`'s jobs wait or run here."""
        return sum(1 for check in self._held.values() if check.owner == owner)

    def job_ids(self) -> list[str]:
        return list(self._held)

    async def check(
        self, owner: Owner, job_id: str, files: Sequence[CheckedFile], limit: LengthLimit | None
    ) -> Summary:
        """The first file's summary, once every file is checked in its key's turn; `refusal`
        for a bad line, CheckCancelled once `cancel(job_id)` stopped it."""
        if self._closed:
            raise Unavailable("the gateway is stopping: retry", retry_after_s=1)
        check = _Check(owner, job_id, files, limit, asyncio.get_running_loop().create_future())
        self._held[job_id] = check
        self._waiting.push(owner, check)
        self._arrived.set()
        self._serve(warm=False)
        try:
            return await asyncio.shield(check.result)
        except asyncio.CancelledError:  # its caller is gone (the gateway stops)
            await self.cancel(job_id)
            raise

    async def cancel(self, job_id: str) -> None:
        """Stops the job's check, if it has one here; returns once it no longer runs."""
        check = self._held.get(job_id)
        if check is None:
            return
        if self._waiting.remove(check.owner, check):
            self._end(check, CheckCancelled(job_id))
            return
        check.stop.set()
        await check.ended.wait()

    async def close(self) -> None:
        """Stops every check and ends the processes (waiting for them)."""
        self._closed = True
        for task in self._serving.values():
            task.cancel()
        for task in self._serving.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for check in list(self._held.values()):
            self._end(check, CheckCancelled(check.job_id))
        await asyncio.gather(*(process.close() for process in self._processes))
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    def _serve(self, warm: bool) -> None:
        """A task feeding each process (again, for one that ended by a fault: logged)."""
        if self._closed:
            return
        for slot, process in enumerate(self._processes):
            task = self._serving.get(slot)
            if task is None or task.done():
                task = asyncio.get_running_loop().create_task(self._run(process, warm))
                task.add_done_callback(_fault)
                self._serving[slot] = task

    async def _run(self, process: _Process, warm: bool) -> None:
        if warm:
            with contextlib.suppress(OSError, _Ended):  # logged; the first check starts it again
                await process.starting(self._tokenizers)
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            _, check = self._waiting.pop()
            try:
                self._end(check, await self._checked(process, check))
            except asyncio.CancelledError:
                self._end(check, CheckCancelled(check.job_id))
                raise
            except Exception as exc:
                self._end(check, exc)

    def _end(self, check: _Check, outcome: Summary | BaseException) -> None:
        if not check.result.done():
            if isinstance(outcome, BaseException):
                check.result.set_exception(outcome)
            else:
                check.result.set_result(outcome)
        self._held.pop(check.job_id, None)
        check.ended.set()

    async def _checked(self, process: _Process, check: _Check) -> Summary:
        summary: Summary | None = None
        for index, file in enumerate(check.files):
            path = self._staging_dir() / f"{check.job_id}-{index}.jsonl"
            try:
                await _stage(check, file, path)
                answer = await self._ask(process, check, f"{check.job_id}:{index}", path)
            finally:
                await asyncio.to_thread(path.unlink, missing_ok=True)  # frees its pages: long
            if "refused" in answer:
                raise refusal(TrainingFileError(answer["refused"]), file.param)
            if "error" in answer:
                log.error("fine-tuning: a file could not be checked: %s", answer["error"])
                raise _retry("the training file could not be checked")
            summary = summary or Summary(answer["examples"], answer["chars"])
        assert summary is not None
        return summary

    async def _ask(
        self, process: _Process, check: _Check, check_id: str, path: Path
    ) -> dict[str, Any]:
        """The process's answer for the file at `path`; CheckCancelled once the check stops."""
        limit = asdict(check.limit) if check.limit is not None else None
        request = {"op": "check", "id": check_id, "path": str(path), "limit": limit,
                   "share": self._cpu_share}  # fmt: skip
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        stop = asyncio.ensure_future(check.stop.wait())
        try:
            starting = process.starting(self._tokenizers)
            await _first(starting, stop)
            if not starting.done():  # a process starting (loading its tokenizers) takes long
                starting.cancel()  # the start goes on, for the next check
                raise CheckCancelled(check.job_id)
            running = await starting
            process.tell(request)
            answer = asyncio.ensure_future(process.answer(running))
            await _first(answer, stop)
            if not answer.done():
                process.tell({"op": "cancel", "id": check_id})
                done, _ = await asyncio.wait({answer}, timeout=STOP_GRACE_S)
                if not done:
                    log.warning("fine-tuning: a check did not stop in time; its process is killed")
                    await process.kill()
            found = await answer
        except _Ended as exc:
            if check.stop.is_set():
                raise CheckCancelled(check.job_id) from exc
            log.error("fine-tuning: a file-checking process ended (%s); a new one starts", exc)
            message = "the training file could not be checked (a checking process stopped)"
            raise _retry(message) from exc
        finally:
            stop.cancel()
            answer.cancel()
        if found.get("stopped"):
            raise CheckCancelled(check.job_id)
        return found

    def _staging_dir(self) -> Path:
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="fedllm-file-checks-"))
        return self._staging


async def _stage(check: _Check, file: CheckedFile, path: Path) -> None:
    """Writes the file's parts to `path` as they are read; CheckCancelled once it stops. The
    writes are on a thread: a host short of memory or behind on its disk makes a write wait."""
    out = await asyncio.to_thread(path.open, "wb")
    try:
        async for part in file.parts():
            if check.stop.is_set():
                raise CheckCancelled(check.job_id)
            await asyncio.to_thread(out.write, part)
    finally:
        await asyncio.to_thread(out.close)


async def _first(*futures: asyncio.Future[Any]) -> None:
    """Waits for the first of `futures` to be done."""
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)


def _start_failed(task: asyncio.Task[asyncio.subprocess.Process]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("fine-tuning: a file-checking process did not start", exc_info=task.exception())


def _fault(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("fine-tuning: a file-checking task failed", exc_info=task.exception())


def _retry(what: str) -> Unavailable:
    return Unavailable(f"{what}: retry", code="validation_failed", retry_after_s=1)
