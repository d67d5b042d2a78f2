"""Process CPU time (psutil): user + system seconds of a process, its threads and its children,
sampled at the edges of a measurement window. Unlike throughput, CPU time per delivered token
does not move with what else the machine runs (the 2-core machine is shared), as long as the
process is not starved outright.

A role is one or more processes (the clients are several). Per process, the main thread's time
is kept apart: the site's and the gateway's event loops run there, so main-thread seconds over
the window's wall seconds is the loop's busy share (time it computed; waits on the GIL do not
count).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float  # the processes and their children, every thread
    main_thread_s: float  # the processes' main threads
    threads: dict[int, float]  # thread id -> seconds, every thread of the processes


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float  # time.monotonic()
    roles: dict[str, Usage]


def _usage(pids: Sequence[int]) -> Usage:
    cpu = main = 0.0
    threads: dict[int, float] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                times = process.cpu_times()
                listed = process.threads()
            children = process.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        cpu += times.user + times.system
        for thread in listed:
            seconds = thread.user_time + thread.system_time
            threads[thread.id] = seconds
            if thread.id == pid:
                main += seconds
        for child in children:
            try:
                child_times = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            cpu += child_times.user + child_times.system
    return Usage(cpu, main, threads)


def sample(roles: Mapping[str, Sequence[int]]) -> Sample:
    return Sample(time.monotonic(), {role: _usage(pids) for role, pids in roles.items()})


@dataclass(frozen=True, slots=True)
class Spent:
    """What a role spent between two samples."""

    cpu_s: float
    main_thread_s: float
    threads: dict[int, float]  # thread id -> seconds, busiest first

    def cores(self, wall_s: float) -> float:
        return self.cpu_s / wall_s if wall_s > 0 else 0.0


def spent(before: Sample, after: Sample, role: str) -> Spent:
    a, b = before.roles[role], after.roles[role]
    threads = {tid: s - a.threads.get(tid, 0.0) for tid, s in b.threads.items()}
    busiest = dict(sorted(threads.items(), key=lambda item: -item[1]))
    return Spent(b.cpu_s - a.cpu_s, b.main_thread_s - a.main_thread_s, busiest)
