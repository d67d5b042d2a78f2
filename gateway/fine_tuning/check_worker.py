"""A process that checks fine-tuning files for the gateway (`python -m
gateway.fine_tuning.check_worker`; gateway/fine_tuning/checker.py starts and feeds it).

One JSON object a line on stdin, one answer a line on stdout:
  {"op": "check", "id", "path", "limit": {"tokenizer", "context", "reserve"} | null, "share"}
      -> {"id", "examples", "chars"} | {"id", "refused": why} | {"id", "stopped": true}
         | {"id", "error": why}
  {"op": "cancel", "id"}  the check `id` stops (queued or under way): it answers "stopped"
  {"op": "load", "tokenizers": [...]}  loads them now, before the first check needs them
      -> {"loaded": n}
A reader thread takes the lines as they come, so a cancel reaches a check under way: its pauses
(file_check.CpuShare) end and it stops at its next look (every 256 lines). At the end of stdin
(the gateway stopped, or died) the process exits at once, whatever it was doing: it never
outlives the gateway (issue 75: the checking process and multiprocessing's resource tracker were
orphaned to init by a gateway's clean stop). It runs CHECK_NICENESS below the gateway. Anything
else written to its stdout (a library's print) goes to its stderr, the gateway's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
from pathlib import Path
from typing import IO, Any

from fedllm_contract.training_data import Stopped, TrainingFileError
from gateway.fine_tuning.file_check import (
    CHECK_NICENESS,
    CpuShare,
    LengthLimit,
    check_file,
    tokenizer,
)


class Cancels:
    """The ids of the checks cancelled; a check's pause ends when it is cancelled."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._changed = threading.Condition()

    def add(self, check_id: str) -> None:
        with self._changed:
            self._ids.add(check_id)
            self._changed.notify_all()

    def __contains__(self, check_id: object) -> bool:
        with self._changed:
            return check_id in self._ids

    def discard(self, check_id: str) -> None:
        with self._changed:
            self._ids.discard(check_id)

    def pause(self, check_id: str, seconds: float) -> None:
        """Waits `seconds`, less if the check `check_id` is cancelled meanwhile."""
        with self._changed:
            self._changed.wait_for(lambda: check_id in self._ids, timeout=seconds)


def read_requests(lines: IO[str], work: queue.Queue[dict[str, Any]], cancels: Cancels) -> None:
    """The reader thread: checks and loads to `work`, cancels at once; the end of the input
    ends the process."""
    for line in lines:
        request = json.loads(line)
        if request["op"] == "cancel":
            cancels.add(request["id"])
        else:
            work.put(request)
    os._exit(0)  # the gateway is gone: nothing of this process is worth finishing


def answer(request: dict[str, Any], cancels: Cancels) -> dict[str, Any]:
    check_id = request["id"]
    limit = LengthLimit(**request["limit"]) if request["limit"] is not None else None
    pacing = CpuShare(
        request["share"], lambda s: cancels.pause(check_id, s), lambda: check_id in cancels
    )
    try:
        if check_id in cancels:
            raise Stopped("cancelled before it began")
        summary = check_file(Path(request["path"]).read_bytes(), limit, pacing)
    except Stopped:
        return {"id": check_id, "stopped": True}
    except TrainingFileError as exc:
        return {"id": check_id, "refused": str(exc)}
    except Exception as exc:  # the check fails, not the process: the gateway says so
        return {"id": check_id, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        cancels.discard(check_id)
    return {"id": check_id, "examples": summary.examples, "chars": summary.content_chars}


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    with contextlib.suppress(OSError):  # a host that refuses it: the share still holds
        os.nice(CHECK_NICENESS)
    work: queue.Queue[dict[str, Any]] = queue.Queue()
    cancels = Cancels()
    threading.Thread(target=read_requests, args=(sys.stdin, work, cancels), daemon=True).start()
    while True:
        request = work.get()
        if request["op"] == "load":
            for directory in request["tokenizers"]:
                tokenizer(directory)
            answers.write(json.dumps({"loaded": len(request["tokenizers"])}) + "\n")
            continue
        answers.write(json.dumps(answer(request, cancels)) + "\n")


if __name__ == "__main__":
    main()
