"""Sites joining and leaving at run time against a real (SQLite) database, and the Kubernetes
actuator following a StatefulSet's pods by their DNS names (the names resolve through a table
here: there is no cluster DNS in CI; everything else is the gateway's own)."""

from __future__ import annotations

import asyncio
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
from gateway.metrics import GatewayMetrics
from gateway.scaling.config import ActuatorConfig
from gateway.scaling.kubernetes import KubernetesPods
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.health import HealthMonitor
from gateway.sites.load_reports import LoadReportListener
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.site_store import sync_sites

MODEL = ModelConfig("m", Path("unused"))
PATTERN = "pod-{i}.sites.test.svc"


def config(name: str, endpoint: str = "127.0.0.1:9") -> SiteConfig:
    return SiteConfig(name, "k8s", "cluster", endpoint, "m")


async def world(url: str) -> tuple[SiteRegistry, SiteMembership, KubernetesPods, list[str]]:
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
        "kubernetes", "pod", "k8s", "cluster", host_pattern=PATTERN, start_timeout_s=0.3
    )
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
