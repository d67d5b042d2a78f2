"""Idle memory first end to end on the CPU: real site engines started by the local actuator, the
lending over real gRPC (KvRoom, LendKv, ReturnKv through GrpcSiteClient and SiteLender). An
idle-memory scale-out starts its site beside a running one (the same slot, `--kv-cache-mib` the
lent memory) while that one's cache shrinks by what it lent; retiring the borrower gives the
lending back (the cache grows again), as does a borrower that fails to start; a scale-out not
marked idle-memory-first takes a free slot."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import SiteConfig
from gateway.metrics import GatewayMetrics
from gateway.scaling.config import ActuatorConfig, LocalSlot, ModelScaling, ScalingConfig
from gateway.scaling.controller import ScalingController
from gateway.scaling.idle_memory import MIB, IdleMemory
from gateway.scaling.local import LocalProcesses
from gateway.scaling.policy import ScaleOut, ScalingRule, Verdict
from gateway.scaling.site_lender import SiteLender
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import KvLease, SiteCallError
from gateway.sites.registry import SiteRegistry, SiteState

pytestmark = pytest.mark.slow
JOIN_S = 600.0  # a cold start's imports on a busy 2-core CI machine
LENDER_MIB, BORROWED_MIB = 8, 2


class Membership:
    """Joins register the site with a real gRPC client (what SiteLender reaches it by)."""

    def __init__(self, registry: SiteRegistry) -> None:
        self.registry = registry
        self.serial = 0
        self.failures: list[str] = []  # the actuator's failed starts

    async def failed(self, model: str, reason: str) -> None:
        self.failures.append(reason)

    async def join(self, config: SiteConfig, origin: str, note: str = "") -> None:
        self.serial += 1
        client = GrpcSiteClient(config.name, config.endpoint, 30.0)
        self.registry.add(SiteState(config, self.serial, client))

    def leave(self, name: str, actor: str, reason: str = "") -> None:
        self.registry.remove(name)


async def _joined(registry: SiteRegistry, name: str, failures: list[str]) -> GrpcSiteClient:
    deadline = time.monotonic() + JOIN_S
    while (state := registry.get(name)) is None:
        assert not failures, failures
        assert time.monotonic() < deadline, f"{name} did not join"
        await asyncio.sleep(0.05)
    assert isinstance(state.client, GrpcSiteClient)
    return state.client


async def _blocks(client: GrpcSiteClient) -> int:
    return (await client.info()).kv_blocks_total


def pid(actuator: LocalProcesses, name: str) -> int:
    return actuator._children[name].popen.pid


def environ(process: int) -> list[bytes]:
    return Path(f"/proc/{process}/environ").read_bytes().split(b"\0")


def test_a_short_peak_starts_beside_a_site_in_its_lent_memory(
    tiny_llama_dir: Path, tmp_path: Path, sqlite_url: str
) -> None:
    async def run() -> None:
        site = (sys.executable, "-m", "site_engine", "--model", str(tiny_llama_dir),
                "--max-num-seqs", "4", "--torch-threads", "1")  # fmt: skip
        slot = LocalSlot((("FEDLLM_TEST_SLOT", "0"),), ("--kv-cache-mib", str(LENDER_MIB)))
        config = ActuatorConfig(kind="local", name_prefix="el", command=site, slots=(slot,),
                                log_dir=tmp_path, stop_timeout_s=20.0,
                                idle_memory_kv_mib=BORROWED_MIB)  # fmt: skip
        registry = SiteRegistry([])
        idle = IdleMemory(SiteLender(registry))
        membership = Membership(registry)
        failures = membership.failures
        actuator = LocalProcesses("tiny", config, membership, membership.failed, idle)  # type: ignore[arg-type]
        upgrade(sqlite_url)
        rule = ScalingRule("tiny", min_sites=1, max_sites=2)
        controller = ScalingController(
            ScalingConfig((ModelScaling(rule, config),)), registry, membership,  # type: ignore[arg-type]
            {"tiny": actuator}, create_sessionmaker(create_engine(sqlite_url)), GatewayMetrics(),
        )  # fmt: skip
        short_peak = ScaleOut(1, peak_s=5.0, idle_memory=True)
        try:
            assert await actuator.start(1, idle_memory=True) == 1  # nothing to lend yet: slot 0
            lender = await _joined(registry, "el-0", failures)
            full, room = await _blocks(lender), await lender.kv_room()
            assert room >= BORROWED_MIB * MIB
            assert await actuator.start(1) == 0  # no free slot, and not idle-memory-first
            # The controller hands the scale-out's mark to the actuator.
            await controller._act(rule, actuator, Verdict(1, 0, 2, 0.0, 0.0, short_peak, "test"))
            (borrowing,) = idle.borrowings()
            assert (borrowing.instance, borrowing.lender) == ("el-idle-0", "el-0")
            assert borrowing.bytes == BORROWED_MIB * MIB
            # The lender's cache shrank by what it lent; it lends to one neighbour at a time.
            lent_blocks = full - await _blocks(lender)
            assert lent_blocks > 0
            assert await lender.kv_room() == 0
            with pytest.raises(SiteCallError, match="already lends"):
                await lender.lend_kv(MIB, KvLease("another-gateways-lease", 60.0))
            # The lending is held under the placement's lease, which renews at the site.
            await SiteLender(registry).renew("el-0", borrowing.lease)
            borrower = await _joined(registry, "el-idle-0", failures)
            # Beside its lender (its slot's environment), its cache the lent memory.
            assert actuator.pending() == 0
            assert await _blocks(borrower) == lent_blocks
            assert b"FEDLLM_TEST_SLOT=0" in environ(pid(actuator, "el-idle-0"))
            await actuator.retire("el-idle-0")
            assert idle.borrowings() == []
            assert await _blocks(lender) == full
            assert await lender.kv_room() == room
            # A borrower that never serves (killed at once) gives its lending back too.
            assert await actuator.start(1, idle_memory=True) == 1
            assert await _blocks(lender) < full
            os.kill(pid(actuator, "el-idle-1"), signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not failures:  # reported once the lending went back
                assert time.monotonic() < deadline, "the failed borrower was not noticed"
                await asyncio.sleep(0.05)
            assert "site el-idle-1 did not start" in failures[0]
            assert idle.borrowings() == []
            assert await _blocks(lender) == full
        finally:
            await actuator.close()

    asyncio.run(run())
