"""Where a site's start goes, phase by phase: the start-up log's `start phases:` line and the
`fedllm_site_start_phase_seconds{phase}` gauge, so that every change to the start is measured
against the same breakdown (docs/elastic.md, bench/elastic/start_breakdown.py).

Phases, in order (each the seconds since the previous mark):
- `imports`: from the process's start (the kernel's record of it, so the interpreter's own start
  counts) to the site's code loaded; 0 for a pooled start (done while it waited);
- `pooled_wait`: a pooled process only: from its imports to its claim (paid for, not waited on);
- `device_init`, `weights_read`, `memory_sizing` (the KV plan: a trial on CUDA, a recorded plan
  or the budget elsewhere), `kv_and_graphs` (the KV cache allocated, CUDA graphs captured),
  `grammar` (the grammar compiler's vocabulary), `grpc_up` (the service and its server started).

After READY, `graphs_ready` (lazy graphs only, SITE_LAZY_GRAPHS): the seconds from `grpc_up` to
the last CUDA graph captured, while the site served; in the gauge and its own log line, not in the
start's total (the site served meanwhile).

What the site cannot see (joining the gateway, the first token a client gets) the actuator and
the bench measure from outside.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


def process_age_s() -> float:
    """Seconds since this process started, by the kernel's clock (0.0 where it cannot tell)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # The command name (field 2) may hold spaces: the fields after its ')' are fixed.
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class StartPhases:
    """Contract: `mark(phase)` records the seconds since the previous mark (or since `began`,
    monotonic seconds) under `phase`; `phases()` lists them in order; `total_s` is their sum;
    `line()` is the start-up log's line."""

    def __init__(self, began: float) -> None:
        self._last = began
        self._began = began
        self._phases: list[tuple[str, float]] = []
        self._after: list[tuple[str, float]] = []

    @classmethod
    def since_process_start(cls) -> StartPhases:
        return cls(time.monotonic() - process_age_s())

    def mark(self, phase: str) -> float:
        now = time.monotonic()
        seconds = max(0.0, now - self._last)
        self._phases.append((phase, seconds))
        self._last = now
        return seconds

    def after_ready(self, phase: str) -> float:
        """Records `phase` as the seconds since the last mark (the start's last phase), apart
        from the start's own phases (it ends while the site serves); logs it. Any thread."""
        seconds = max(0.0, time.monotonic() - self._last)
        self._after.append((phase, seconds))
        log.info("after READY: %s %.3fs since the start's last phase", phase, seconds)
        return seconds

    def after(self) -> list[tuple[str, float]]:
        return list(self._after)

    def restart(self) -> None:
        """A pooled process is claimed: the phases after this count from now."""
        self._last = time.monotonic()

    def phases(self) -> list[tuple[str, float]]:
        return list(self._phases)

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self._phases)

    def line(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.3f}s" for phase, seconds in self._phases)
        return f"start phases: {parts} (total {self.total_s:.3f}s)"


class StartPhaseCollector:
    """`fedllm_site_start_phase_seconds{site, phase}`: the start's phases (constant once up)."""

    def __init__(self, site_name: str, phases: StartPhases) -> None:
        self._site = site_name
        self._phases = phases

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "fedllm_site_start_phase_seconds",
            "Seconds each phase of the site's start took (docs/elastic.md)",
            labels=("site", "phase"),
        )
        for phase, seconds in self._phases.phases() + self._phases.after():
            gauge.add_metric((self._site, phase), seconds)
        yield gauge
