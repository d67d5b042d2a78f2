"""The scaling controller: every `interval_s`, each scaled model's sites observed
(gateway/scaling/observe.py), the policy's verdict (gateway/scaling/policy.py), and its action
carried out by the model's actuator: a scale-out starts sites, a scale-in drains the chosen site
out of the registry (gateway/admin/membership.py) and then retires it. Every decision is a
scaling event in the database and a count in the metrics; the last verdict of each model is what
/metrics exports (fedllm_gateway_scaling_*) and the dashboard shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admin.membership import SiteMembership
from gateway.metrics import GatewayMetrics, ModelCapacity
from gateway.scaling.actuator import Actuator
from gateway.scaling.config import ActuatorConfig, ScalingConfig
from gateway.scaling.observe import observe
from gateway.scaling.policy import ModelState, ScaleIn, ScaleOut, ScalingRule, Verdict, decide
from gateway.sites.registry import SiteRegistry
from gateway.stores.scaling_events import NewScalingEvent, record_scaling_event

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelView(ModelCapacity):
    """A scaled model now: what /metrics exports of its last verdict, and the verdict's reason,
    its rule's bounds and its actuator."""

    actuator: str
    min_sites: int
    max_sites: int
    target_backlog_s: float
    reason: str


def pool_pods(actuator: ActuatorConfig) -> int:
    """Pods the autoscaler runs beyond the desired sites: the kubernetes actuator's pool (the
    local pool is processes this gateway runs itself, not pods)."""
    return actuator.pool_size if actuator.kind == "kubernetes" else 0


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class ScalingController:
    def __init__(
        self,
        config: ScalingConfig,
        registry: SiteRegistry,
        membership: SiteMembership,
        actuators: dict[str, Actuator],
        sessions: async_sessionmaker[AsyncSession],
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._registry = registry
        self._membership = membership
        self._actuators = actuators
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        self._states: dict[str, ModelState] = {m.rule.model: ModelState() for m in config.models}
        self._verdicts: dict[str, Verdict] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def rules(self) -> list[ScalingRule]:
        return [m.rule for m in self._config.models]

    async def run(self) -> None:
        workers = [asyncio.create_task(a.run(), name=f"actuator-{m}")
                   for m, a in self._actuators.items()]  # fmt: skip
        try:
            while True:
                try:
                    await self.tick()
                except Exception:  # one bad tick must not end scaling; the log says why
                    log.exception("scaling tick failed")
                await asyncio.sleep(self._config.interval_s)
        finally:
            for worker in workers:
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker

    async def tick(self) -> None:
        sites = self._registry.all()
        for rule in self.rules:
            actuator = self._actuators[rule.model]
            await actuator.tick(sites)
            seen = observe(
                rule, sites, actuator.removable, actuator.pending(),
                self._registry.arrivals(rule.model), actuator.start_seconds(),
            )  # fmt: skip
            state, verdict = decide(rule, self._states[rule.model], seen, self._clock())
            self._states[rule.model] = state
            self._verdicts[rule.model] = verdict
            if verdict.action is not None:
                await self._act(rule, actuator, verdict)

    async def _act(self, rule: ScalingRule, actuator: Actuator, verdict: Verdict) -> None:
        action = verdict.action
        if isinstance(action, ScaleOut):
            log.info("%s: scale out by %d: %s", rule.model, action.count, verdict.reason)
            await self._record(rule.model, "scale_out", verdict, None, verdict.reason)
            started = await actuator.start(action.count, idle_memory=action.idle_memory)
            if started < action.count:
                missing = action.count - started
                await self.start_failed(rule.model, f"no free slot for {missing} site(s)")
        elif isinstance(action, ScaleIn):
            log.info("%s: scale in, draining %s: %s", rule.model, action.site, verdict.reason)
            await self._record(rule.model, "scale_in", verdict, action.site, verdict.reason)
            leaving = self._membership.leave(action.site, "controller", verdict.reason)
            if leaving is not None:
                actuator.draining(action.site)
                task = asyncio.create_task(self._retire(actuator, action.site, leaving))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _retire(self, actuator: Actuator, name: str, leaving: asyncio.Task[None]) -> None:
        await leaving
        await actuator.retire(name)

    async def start_failed(self, model: str, reason: str) -> None:
        """An actuator's start failed (the controller starts another on a later tick)."""
        log.warning("%s: %s", model, reason)
        verdict = self._verdicts.get(model)
        await self._record(model, "start_failed", verdict, None, reason)

    async def _record(
        self, model: str, action: str, verdict: Verdict | None, site: str | None, reason: str
    ) -> None:
        self._metrics.scaling_decisions.labels(model, action).inc()
        event = NewScalingEvent(
            model=model,
            action=action,
            actor="controller" if action != "start_failed" else self._actuators[model].kind,
            serving_sites=verdict.serving if verdict else 0,
            desired_sites=verdict.desired if verdict else 0,
            reason=reason,
            site=site,
            backlog_s=_finite(verdict.backlog_s) if verdict else None,
            forecast_backlog_s=_finite(verdict.forecast_backlog_s) if verdict else None,
            arrival_rate=_finite(verdict.arrival_rate) if verdict else None,
            lead_s=verdict.lead_s if verdict else None,
            smoothed_backlog_s=_finite(verdict.level_s) if verdict else None,
        )
        try:
            await record_scaling_event(self._sessions, event)
        except Exception:  # the decision stands; the log keeps it
            log.exception("could not record a %s event of %s", action, model)

    def capacities(self) -> list[ModelCapacity]:
        """The last verdict of every scaled model (what /metrics exports)."""
        return [*self.views()]

    def views(self) -> list[ModelView]:
        views = []
        for scaling in self._config.models:
            rule = scaling.rule
            verdict = self._verdicts.get(rule.model)
            serving = verdict.serving if verdict else 0
            views.append(
                ModelView(
                    model=rule.model,
                    actuator=scaling.actuator.kind,
                    min_sites=rule.min_sites,
                    max_sites=rule.max_sites,
                    target_backlog_s=rule.target_backlog_s,
                    serving_sites=serving,
                    pending_sites=verdict.pending if verdict else 0,
                    desired_sites=verdict.desired if verdict else max(serving, rule.min_sites),
                    backlog_s=verdict.backlog_s if verdict else 0.0,
                    forecast_backlog_s=verdict.forecast_backlog_s if verdict else 0.0,
                    reason=verdict.reason if verdict else "not observed yet",
                    arrival_rate=verdict.arrival_rate if verdict else 0.0,
                    lead_s=verdict.lead_s if verdict else rule.lead_time_s,
                    level_s=verdict.level_s if verdict else 0.0,
                    pool_pods=pool_pods(scaling.actuator),
                )
            )
        return views

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(actuator.close() for actuator in self._actuators.values()))
