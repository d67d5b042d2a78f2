"""What happens over an arm's run, sampled twice a second: which of its site processes are alive
(from /proc: a site's GPU is paid for from its process's start to its end, however long it
boots or drains) and what the gateway says (sites healthy, and for the autoscaled arm its
controller's desired sites and backlog, from /metrics as an operator reads them)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.elastic.arms import ADMIN_TOKEN

SAMPLE_S = 0.5
_SAMPLE = re.compile(r"^(fedllm_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.MULTILINE)


def prometheus_sums(text: str) -> dict[str, float]:
    """Each metric's samples summed over their labels."""
    sums: dict[str, float] = {}
    for name, _labels, value in _SAMPLE.findall(text):
        if value != "NaN":
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


def alive(site_names: Sequence[str]) -> set[str]:
    """The site names among `site_names` whose `python -m site_engine` process runs now, and
    the warm pool's processes of their prefixes (`<prefix>-pool-<n>`, gateway/scaling/
    local_pool.py), waiting or claimed: what a pool holds is paid for like a site (a claimed
    one keeps its pool name on its command line, so it is counted once)."""
    wanted = {f"--site-name\0{name}\0".encode(): name for name in site_names}
    pools = {f"--site-name\0{name.rsplit('-', 1)[0]}-pool-".encode() for name in site_names}
    found: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"site_engine" in cmdline:
            found.update(name for needle, name in wanted.items() if needle in cmdline)
            if any(pool in cmdline for pool in pools):
                found.add(f"pool:{entry.name}")
    return found


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds from the run's start
    alive: int
    healthy: int
    desired: int | None
    backlog_s: float | None


@dataclass
class Timeline:
    base_url: str
    site_names: tuple[str, ...]
    start: float = field(default_factory=time.perf_counter)
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self, start: float) -> None:
        self.start = start
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=5) as client:
            while not self._stop.is_set():
                t = time.perf_counter() - self.start
                try:
                    sums = prometheus_sums(client.get("/metrics").text)
                except httpx.HTTPError:
                    sums = {}
                desired = sums.get("fedllm_gateway_scaling_desired_sites")
                backlog = sums.get("fedllm_gateway_scaling_backlog_seconds")
                self.samples.append(
                    Sample(
                        round(t, 2),
                        len(alive(self.site_names)),
                        int(sums.get("fedllm_gateway_site_healthy", 0)),
                        None if desired is None else int(desired),
                        None if backlog is None else round(backlog, 3),
                    )
                )
                self._stop.wait(SAMPLE_S)

    def site_seconds(self, until_s: float) -> float:
        """Site processes alive, integrated over [0, until_s] (each sample holds until the next)."""
        total = 0.0
        for this, after in zip(self.samples, [*self.samples[1:], None], strict=True):
            end = min(after.t if after is not None else until_s, until_s)
            if this.t < end:
                total += this.alive * (end - this.t)
        return total
