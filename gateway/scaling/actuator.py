"""What carries out the scaling controller's decisions, behind one interface.

An actuator starts sites (they join the registry through gateway/admin/membership.py once they
serve), says how many it was asked for that do not serve yet, which of a model's sites it may
take away, and stops a site once the controller has drained it out of the registry. Three:
`local` (gateway/scaling/local.py: site-engine processes on this machine), `kubernetes`
(gateway/scaling/kubernetes.py: a StatefulSet's pods, scaled by KEDA or the HPA on the metric
this gateway exports) and `signal` (below: the metric alone).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.scaling.config import ActuatorConfig
from gateway.sites.registry import SiteState

# An actuator tells the controller of a start that failed (model, reason): a scaling event.
OnFailure = Callable[[str, str], Awaitable[None]]


class Actuator(Protocol):
    kind: str

    def pending(self) -> int:
        """Sites asked for that do not serve yet."""
        ...

    def removable(self, site: SiteState) -> bool:
        """Whether the controller may take this site away."""
        ...

    def start_seconds(self) -> float | None:
        """How long its last start took from the ask to serving (None: none measured yet): how
        far ahead the controller's forecast looks."""
        ...

    async def start(self, count: int, idle_memory: bool = False) -> int:
        """Begins starting `count` sites; returns how many it could begin (a full machine:
        fewer). `idle_memory`: the scale-out is short-lived (ScaleOut.idle_memory): an actuator
        that can, starts it in the free KV memory of a GPU it holds before taking a new one."""
        ...

    def draining(self, name: str) -> None:
        """The controller begins draining this site out (a scale-in); `retire` follows once it
        left the registry."""
        ...

    async def retire(self, name: str) -> None:
        """The site was drained and left the registry: stop what runs it."""
        ...

    async def tick(self, sites: list[SiteState]) -> None:
        """Called on each of the controller's ticks with the registry's sites."""
        ...

    async def run(self) -> None:
        """What it does in the background (following pods), until cancelled."""
        ...

    async def close(self) -> None:
        """The gateway stops: stop what it started."""
        ...


class AskedStarts:
    """Starts asked of an autoscaler this gateway does not run itself: pending until as many new
    sites joined, or until `timeout_s` (then each is a failure, reported once)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._deadlines: list[float] = []
        # How long the last start that arrived took (from its ask).
        self.last_start_s: float | None = None

    def ask(self, count: int) -> None:
        self._deadlines.extend([self._clock() + self._timeout_s] * count)

    def arrived(self) -> None:
        if self._deadlines:
            asked_at = self._deadlines.pop(0) - self._timeout_s
            self.last_start_s = max(0.0, self._clock() - asked_at)

    def expired(self) -> int:
        """Drops the starts past their deadline; how many."""
        now = self._clock()
        kept = [d for d in self._deadlines if d > now]
        expired = len(self._deadlines) - len(kept)
        self._deadlines = kept
        return expired

    def __len__(self) -> int:
        return len(self._deadlines)


class SignalOnly:
    """Exports the desired number of sites and does nothing else: an autoscaler reads
    fedllm_gateway_scaling_desired_sites and brings sites that join by other means (the admin
    API). It may take away only sites that joined at run time, by draining them."""

    kind = "signal"

    def __init__(self, model: str, config: ActuatorConfig, on_failure: OnFailure) -> None:
        self._model = model
        self._asked = AskedStarts(config.start_timeout_s)
        self._on_failure = on_failure
        self._seen: set[str] | None = None

    def pending(self) -> int:
        return len(self._asked)

    def start_seconds(self) -> float | None:
        return self._asked.last_start_s

    def removable(self, site: SiteState) -> bool:
        return site.origin != "federation"

    async def tick(self, sites: list[SiteState]) -> None:
        """A new site of the model answers one start asked for; one asked for too long ago is
        a failure."""
        names = {site.name for site in sites if site.model == self._model}
        if self._seen is not None:
            for _ in names - self._seen:
                self._asked.arrived()
        self._seen = names
        if expired := self._asked.expired():
            await self._on_failure(self._model, f"{expired} site(s) asked for never joined")

    async def start(self, count: int, idle_memory: bool = False) -> int:
        self._asked.ask(count)  # the autoscaler chooses where: `idle_memory` is not its to say
        return count

    def draining(self, name: str) -> None:
        return  # the autoscaler removes what it runs

    async def retire(self, name: str) -> None:
        return

    async def run(self) -> None:
        return  # nothing to follow

    async def close(self) -> None:
        return
