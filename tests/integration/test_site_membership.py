"""Sites joining and leaving at run time against a real (SQLite) database, and the Kubernetes
actuator following a StatefulSet's pods by their DNS names (the names resolve through a table
here: there is no cluster DNS in CI; everything else is the gateway's own)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import select

from gateway.admin.drain import SiteDrainer
from gateway.admin.membership import SiteMembership
from gateway.db.migrate import upgrade
from gateway.db.models import ScalingEvent, Site
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import Conflict
from gateway.federation import ModelConfig, SiteConfig
from gateway.metrics import GatewayMetrics, ModelCapacity
from gateway.scaling.config import ActuatorConfig, ModelScaling, ScalingConfig
from gateway.scaling.controller import ScalingController, pool_pods
from gateway.scaling.kubernetes import KubernetesPods
from gateway.scaling.policy import ScaleIn, ScaleOut, ScalingRule, Verdict
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.health import HealthMonitor
from gateway.sites.load_reports import LoadReportListener
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.site_store import sync_sites

MODEL = ModelConfig("m", Path("unused"))
PATTERN = "pod-{i}.sites.test.svc"


def config(name: str, endpoint: str = "127.0.0.1:9") -> SiteConfig:
    return SiteConfig(name, "k8s", "cluster", endpoint, "m")


async def world(
    url: str, pool_size: int = 0
) -> tuple[SiteRegistry, SiteMembership, KubernetesPods, list[str]]:
    """A registry with the federation file's pod 0; membership and the actuator over it."""
    upgrade(url)
    sessions = create_sessionmaker(create_engine(url))
    first = config("pod-0", f"{PATTERN.format(i=0)}:50051")
    ids = await sync_sites(sessions, (first,))
    registry = SiteRegistry(
        [SiteState(first, ids["pod-0"], GrpcSiteClient("pod-0", first.endpoint, 0.2))]
    )
    listener = LoadReportListener(registry, 100, 5.0)
    monitor = HealthMonitor(registry, {}, 1.0, listener.stale)
    membership = SiteMembership(
        registry, sessions, (monitor, listener), SiteDrainer(registry, 0.1),
        lambda c: GrpcSiteClient(c.name, c.endpoint, 0.2), 1024, (MODEL,), Path("."),
        GatewayMetrics(), leave_timeout_s=5.0,
    )  # fmt: skip
    failures: list[str] = []

    async def failed(model: str, reason: str) -> None:
        failures.append(f"{model}: {reason}")

    actuator_config = ActuatorConfig(
        "kubernetes", "pod", "k8s", "cluster", host_pattern=PATTERN, start_timeout_s=0.3,
        pool_size=pool_size,
    )  # fmt: skip
    pods = KubernetesPods("m", actuator_config, 4, registry, membership, failed)
    return registry, membership, pods, failures


def test_pods_join_as_they_resolve_and_leave_by_draining_when_they_stop(sqlite_url: str) -> None:
    async def exercise() -> None:
        registry, membership, pods, failures = await world(sqlite_url)
        resolving = {PATTERN.format(i=i) for i in (0, 1, 2)}

        async def resolve(host: str, port: int) -> bool:
            assert port == 50051
            return host in resolving

        pods.resolve = resolve
        assert await pods.start(2) == 2
        assert pods.pending() == 2
        await pods.follow_once()
        names = {s.name: s for s in registry.all()}
        assert set(names) == {"pod-0", "pod-1", "pod-2"}
        assert names["pod-1"].origin == "kubernetes"
        assert names["pod-0"].origin == "federation"
        assert names["pod-2"].config.endpoint == "pod-2.sites.test.svc:50051"
        assert pods.pending() == 0
        # The StatefulSet removes its highest ordinal first: the only one the controller may take.
        assert [s.name for s in registry.all() if pods.removable(s)] == ["pod-2"]

        # The controller drains pod-2 out and retires it; its pod still resolves for a while.
        leaving = membership.leave("pod-2", "controller", "test")
        assert leaving is not None
        await leaving
        await pods.retire("pod-2")
        await pods.follow_once()
        assert {s.name for s in registry.all()} == {"pod-0", "pod-1"}
        # Its pod went, and a new one came back under the same name: it joins again.
        resolving.discard(PATTERN.format(i=2))
        await pods.follow_once()
        resolving.add(PATTERN.format(i=2))
        await pods.follow_once()
        assert {s.name for s in registry.all()} == {"pod-0", "pod-1", "pod-2"}

        # pod-1's pod terminates (out of DNS): it leaves by draining; pod 0 (the federation
        # file's) never leaves for DNS.
        resolving -= {PATTERN.format(i=1), PATTERN.format(i=0)}
        await pods.follow_once()
        leaving_site = registry.get("pod-1")
        assert leaving_site is not None
        assert leaving_site.draining
        for _ in range(100):
            if registry.get("pod-1") is None:
                break
            await asyncio.sleep(0.05)
        assert {s.name for s in registry.all()} == {"pod-0", "pod-2"}

        # A start asked for that never comes is a failure, once.
        await pods.start(1)
        await asyncio.sleep(0.35)
        await pods.tick(registry.all())
        await pods.tick(registry.all())
        assert failures == ["m: 1 pod(s) asked for never served"]
        assert pods.pending() == 0

        engine = create_engine(sqlite_url)
        async with create_sessionmaker(engine)() as session:
            rows = {s.name: s.enabled for s in (await session.scalars(select(Site))).all()}
            events = [
                (e.action, e.site, e.actor)
                for e in (await session.scalars(select(ScalingEvent).order_by(ScalingEvent.id)))
            ]
        await engine.dispose()
        assert rows == {"pod-0": True, "pod-1": False, "pod-2": True}
        assert events == [
            ("join", "pod-1", "kubernetes"),
            ("join", "pod-2", "kubernetes"),
            ("drain", "pod-2", "controller"),
            ("leave", "pod-2", "controller"),
            ("join", "pod-2", "kubernetes"),
            ("drain", "pod-1", "kubernetes"),
            ("leave", "pod-1", "kubernetes"),
        ]
        await membership.close()
        for site in registry.all():
            await site.client.close()

    asyncio.run(exercise())


def test_a_taken_name_is_refused_and_nothing_changes(sqlite_url: str) -> None:
    async def exercise() -> None:
        registry, membership, _, _ = await world(sqlite_url)
        site = await membership.join(config("extra"), "operator")
        assert site.site_id > 0
        assert not site.healthy  # nothing listens there: it stays, unhealthy, until it does
        with pytest.raises(Conflict, match="already registered"):
            await membership.join(config("extra", "127.0.0.1:10"), "operator")
        assert registry.get("extra") is site
        assert membership.leave("nowhere", "operator") is None
        await membership.close()
        for each in registry.all():
            await each.client.close()

    asyncio.run(exercise())


def serving(registry: SiteRegistry) -> set[str]:
    return {s.name for s in registry.all()}


def gauges(metrics: GatewayMetrics) -> dict[str, float]:
    """fedllm_gateway_scaling_desired_{sites,pods} of model m, as a scrape reads them."""
    found = {}
    for line in metrics.exposition().decode().splitlines():
        for name in ("desired_sites", "desired_pods"):
            if line.startswith(f'fedllm_gateway_scaling_{name}{{model="m"}} '):
                found[name] = float(line.split()[-1])
    return found


def test_a_pool_pod_waits_unjoined_and_joins_at_a_scale_out_without_a_start(
    sqlite_url: str,
) -> None:
    """pool_size 1: the StatefulSet runs one pod beyond the desired sites. The gateway resolves
    it and leaves it unjoined; the controller's scale-out joins it at once (no pod started, no
    pass over the pods waited for); the controller's scale-in drains the top serving ordinal and
    leaves its pod in the pool, where the next scale-out takes it back; the gauge the
    autoscaler reads is the desired sites plus the pool."""

    async def exercise() -> None:
        registry, membership, pods, failures = await world(sqlite_url, pool_size=1)
        resolving = {PATTERN.format(i=i) for i in (0, 1)}
        looked_up: list[str] = []

        async def resolve(host: str, port: int) -> bool:
            looked_up.append(host)
            return host in resolving

        pods.resolve = resolve
        engine = create_engine(sqlite_url)
        sessions = create_sessionmaker(engine)
        rule = ScalingRule("m", min_sites=1, max_sites=4)
        scaling = ScalingConfig((ModelScaling(rule, pods_config(pool_size=1)),))
        metrics = GatewayMetrics()
        controller = ScalingController(
            scaling, registry, membership, {"m": pods}, sessions, metrics
        )
        metrics.watch_scaling(controller.capacities)
        # Before any verdict: min_sites desired, and one pod more for the pool.
        assert gauges(metrics) == {"desired_sites": 1.0, "desired_pods": 2.0}

        # Pods 0 and 1 run (min_sites + the pool): pod 1 resolves and is not joined.
        await pods.follow_once()
        await pods.follow_once()
        assert PATTERN.format(i=1) in looked_up
        assert serving(registry) == {"pod-0"}
        assert pods.serving_ordinals == 1

        # A scale-out by one: pod 1 joins within the controller's act, nothing resolved anew
        # beyond its own name and no pod added.
        looked_up.clear()
        await controller._act(rule, pods, verdict(2, ScaleOut(1)))
        assert serving(registry) == {"pod-0", "pod-1"}
        assert looked_up == [PATTERN.format(i=1)]
        assert pods.pending() == 0
        start_s = pods.start_seconds()
        assert start_s is not None
        assert start_s < 5.0  # the join alone (the pod's start is the minutes before)
        # Kubernetes starts the new pool pod behind it (replicas = desired + 1): not joined.
        resolving.add(PATTERN.format(i=2))
        await pods.follow_once()
        assert serving(registry) == {"pod-0", "pod-1"}

        # A scale-out by two with one pool pod: pod 2 joins now, pod 3 once its pod serves.
        await controller._act(rule, pods, verdict(4, ScaleOut(2)))
        assert serving(registry) == {"pod-0", "pod-1", "pod-2"}
        assert pods.pending() == 1
        resolving |= {PATTERN.format(i=3), PATTERN.format(i=4)}  # pod 3, and the pool's pod 4
        await pods.follow_once()
        assert serving(registry) == {"pod-0", "pod-1", "pod-2", "pod-3"}
        assert pods.pending() == 0
        assert pods.serving_ordinals == 4

        # The scale-in drains the top serving ordinal; its pod stays up, in the pool.
        assert [s.name for s in registry.all() if pods.removable(s)] == ["pod-3"]
        await controller._act(rule, pods, verdict(3, ScaleIn("pod-3")))
        assert pods.serving_ordinals == 3  # from the drain's start: no rejoin meanwhile
        for _ in range(100):
            if registry.get("pod-3") is None:
                break
            await asyncio.sleep(0.05)
        await pods.follow_once()
        assert serving(registry) == {"pod-0", "pod-1", "pod-2"}
        # The StatefulSet removes its highest ordinal (pod 4, the old pool pod); pod 3 resolves
        # and waits unjoined.
        resolving.discard(PATTERN.format(i=4))
        await pods.follow_once()
        assert serving(registry) == {"pod-0", "pod-1", "pod-2"}

        # The next scale-out takes pod 3 back at once.
        await controller._act(rule, pods, verdict(4, ScaleOut(1)))
        assert serving(registry) == {"pod-0", "pod-1", "pod-2", "pod-3"}
        assert pods.pending() == 0

        # Whatever the controller decides, the autoscaler's number is the desired sites + 1.
        await controller.tick()
        read = gauges(metrics)
        assert read["desired_pods"] == read["desired_sites"] + 1
        assert failures == []

        async with sessions() as session:
            events = [
                (e.action, e.site, e.actor)
                for e in (await session.scalars(select(ScalingEvent).order_by(ScalingEvent.id)))
                if e.site is not None
            ]
        assert events == [
            ("join", "pod-1", "kubernetes"),
            ("join", "pod-2", "kubernetes"),
            ("join", "pod-3", "kubernetes"),
            ("scale_in", "pod-3", "controller"),
            ("drain", "pod-3", "controller"),
            ("leave", "pod-3", "controller"),
            ("join", "pod-3", "kubernetes"),
        ]
        await controller.close()
        await engine.dispose()
        await membership.close()
        for site in registry.all():
            await site.client.close()

    asyncio.run(exercise())


def pods_config(pool_size: int) -> ActuatorConfig:
    return ActuatorConfig(
        "kubernetes", "pod", "k8s", "cluster", host_pattern=PATTERN, pool_size=pool_size
    )


def verdict(desired: int, action: ScaleOut | ScaleIn) -> Verdict:
    return Verdict(0, 0, desired, 0.0, 0.0, action, "test")


def test_without_a_pool_the_desired_pods_are_the_desired_sites() -> None:
    for config in (pods_config(0), replace(pods_config(3), kind="local")):
        assert pool_pods(config) == 0
    assert pool_pods(pods_config(3)) == 3
    metrics = GatewayMetrics()
    metrics.watch_scaling(lambda: [ModelCapacity("m", 2, 0, 3, 0.0, 0.0, pool_pods=2)])
    assert gauges(metrics) == {"desired_sites": 3.0, "desired_pods": 5.0}
