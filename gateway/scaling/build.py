"""The scaling controller and each scaled model's actuator, built from the scaling file."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admin.membership import SiteMembership
from gateway.metrics import GatewayMetrics
from gateway.scaling.actuator import Actuator, OnFailure, SignalOnly
from gateway.scaling.config import ModelScaling, ScalingConfig
from gateway.scaling.controller import ScalingController
from gateway.scaling.idle_memory import IdleMemory
from gateway.scaling.kubernetes import KubernetesPods
from gateway.scaling.local import LocalProcesses
from gateway.scaling.site_lender import SiteLender
from gateway.sites.registry import SiteRegistry


def build_controller(
    config: ScalingConfig,
    registry: SiteRegistry,
    membership: SiteMembership,
    sessions: async_sessionmaker[AsyncSession],
    metrics: GatewayMetrics,
) -> ScalingController:
    actuators: dict[str, Actuator] = {}
    controller = ScalingController(config, registry, membership, actuators, sessions, metrics)
    for scaling in config.models:
        actuators[scaling.rule.model] = _actuator(
            scaling, registry, membership, controller.start_failed
        )
    metrics.watch_scaling(controller.capacities)
    return controller


def _actuator(
    scaling: ModelScaling,
    registry: SiteRegistry,
    membership: SiteMembership,
    on_failure: OnFailure,
) -> Actuator:
    model, config = scaling.rule.model, scaling.actuator
    if config.kind == "local":
        idle = IdleMemory(SiteLender(registry)) if config.idle_memory_kv_mib else None
        return LocalProcesses(model, config, membership, on_failure, idle)
    if config.kind == "kubernetes":
        max_sites = scaling.rule.max_sites
        return KubernetesPods(model, config, max_sites, registry, membership, on_failure)
    return SignalOnly(model, config, on_failure)
