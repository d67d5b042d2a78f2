"""The local actuator's warm pool with real site engines on the CPU: a scale-out that claims a
pooled process joins and answers its first token while a cold start asked for at the same moment
is still starting; the pool replaces what was claimed; the claim's site name, the start-up
phases and the recorded KV plan are the claimed site's."""

from __future__ import annotations

import asyncio
import io
import re
import sys
import time
from pathlib import Path

import pytest

from bench.elastic.start_breakdown import first_token
from gateway.federation import SiteConfig
from gateway.scaling.config import ActuatorConfig, LocalSlot
from gateway.scaling.local import LocalProcesses
from site_engine.pool import ClaimError, read_claim

POOL_READY_S = 600.0  # a pooled process's imports on a busy 2-core CI machine


class Membership:
    """What the actuator asks of the registry's membership: joins (when), and leaves."""

    def __init__(self) -> None:
        self.joined: dict[str, tuple[SiteConfig, float]] = {}

    async def join(self, config: SiteConfig, origin: str, note: str = "") -> None:
        self.joined[config.name] = (config, time.monotonic())

    def leave(self, name: str, actor: str, reason: str = "") -> None:
        self.joined.pop(name, None)


def test_a_pooled_site_serves_its_first_token_while_a_cold_one_starts(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    failures: list[str] = []

    async def on_failure(model: str, reason: str) -> None:
        failures.append(reason)

    async def run() -> None:
        site = (sys.executable, "-m", "site_engine", "--model", str(tiny_llama_dir),
                "--max-num-seqs", "4", "--kv-cache-mib", "16", "--torch-threads", "1")  # fmt: skip
        config = ActuatorConfig(
            kind="local",
            name_prefix="el",
            command=site,
            slots=(LocalSlot(), LocalSlot()),
            log_dir=tmp_path,
            stop_timeout_s=20.0,
            pool_size=1,
        )
        membership = Membership()
        actuator = LocalProcesses("tiny", config, membership, on_failure)  # type: ignore[arg-type]
        try:
            await actuator.tick([])  # the pool fills on the controller's ticks
            (member,) = actuator.pooled()
            deadline = time.monotonic() + POOL_READY_S
            while not member.ready:
                assert time.monotonic() < deadline, member.log_path.read_text()[-2000:]
                await asyncio.sleep(0.05)
            asked = time.monotonic()
            assert await actuator.start(2) == 2  # slot 0 claims the pooled one, slot 1 is cold
            await actuator.tick([])  # the pool starts a replacement
            while "el-0" not in membership.joined:
                assert not failures, failures
                await asyncio.sleep(0.01)
            pooled_config, _ = membership.joined["el-0"]
            port = int(pooled_config.endpoint.rsplit(":", 1)[1])
            await asyncio.to_thread(first_token, port, "pooled-1")
            answered = time.monotonic()
            # The cold one is still starting: not joined, no READY line yet.
            assert "el-1" not in membership.joined
            assert "READY" not in (tmp_path / "el-1.log").read_text()
            assert actuator.pending() == 1
            assert answered - asked < 30  # ~1 s on an idle machine; the cold one takes tens
            pooled_log = member.log_path.read_text()
            assert re.search(r"site el-0 serving tiny", pooled_log)
            assert "start phases: imports" in pooled_log
            assert "pooled_wait" in pooled_log
            assert (tmp_path / "kv-plans.json").is_file()  # recorded for the next claim
            assert len(actuator.pooled()) == 1  # replaced
        finally:
            await actuator.close()
        assert not [p for p in actuator.pooled() if p.popen.poll() is None]

    asyncio.run(run())
    assert failures == []


@pytest.mark.parametrize(
    "line",
    ['["--port"]', '{"args": "--port 0"}', '{"args": [], "env": {"A": 1}}', "not json"],
)
def test_a_malformed_claim_is_refused_with_its_reason(line: str) -> None:
    with pytest.raises(ClaimError):
        read_claim(io.StringIO(line + "\n"))
