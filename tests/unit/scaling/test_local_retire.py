"""The local actuator's retire against its own tick: a site it stops is no crashed site.

CI once saw the race: retire() sent SIGTERM and awaited the process, a tick() in between found a
joined site whose process had exited, reported it as a failure ("start_failed") and freed its
slot, and retire() then failed on the slot already gone (KeyError). Real processes here: a
Python child that prints the site's READY line and sleeps."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from gateway.federation import SiteConfig
from gateway.scaling.config import ActuatorConfig, LocalSlot
from gateway.scaling.local import LocalProcesses

SLEEPER = "import time; print('READY port=4242 ', flush=True); time.sleep(60)"


class Membership:
    """What the actuator asks of the registry's membership: joins and leaves, recorded."""

    def __init__(self) -> None:
        self.joined: list[str] = []
        self.left: list[str] = []

    async def join(self, config: SiteConfig, origin: str, note: str = "") -> None:
        self.joined.append(config.name)

    def leave(self, name: str, actor: str, reason: str = "") -> None:
        self.left.append(name)


def test_a_site_being_retired_is_not_reported_as_crashed(tmp_path: Path) -> None:
    failures: list[str] = []

    async def on_failure(model: str, reason: str) -> None:
        failures.append(reason)

    async def run() -> LocalProcesses:
        config = ActuatorConfig(
            kind="local",
            name_prefix="el",
            command=(sys.executable, "-c", SLEEPER),
            slots=(LocalSlot(),),
            log_dir=tmp_path,
            stop_timeout_s=10.0,
        )
        membership = Membership()
        actuator = LocalProcesses("m", config, membership, on_failure)  # type: ignore[arg-type]
        assert await actuator.start(1) == 1
        for _ in range(100):
            await asyncio.sleep(0.05)
            if membership.joined:
                break
        assert membership.joined == ["el-0"]
        retiring = asyncio.create_task(actuator.retire("el-0"))
        while not retiring.done():
            await actuator.tick([])  # as the controller's loop does, while the process ends
            await asyncio.sleep(0.001)
        await retiring
        await asyncio.sleep(0.05)  # a wrongly started _exited task would have run by now
        assert membership.left == []
        assert actuator.pending() == 0
        await actuator.close()
        return actuator

    asyncio.run(run())
    assert failures == []
