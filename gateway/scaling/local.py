"""The local actuator: site-engine processes on this machine, one per slot (a GPU, or CPU
threads), started and stopped by the gateway itself. The embedded default, the tests and a
one-host multi-GPU run.

A start runs the scaling file's command (`python -m site_engine --model ...`) with the slot's
environment (CUDA_VISIBLE_DEVICES) and arguments, plus `--port 0 --site-name NAME`; the site
prints `READY port=N` once it serves (model loaded, CUDA graphs captured), and joins the
registry then (gateway/admin/membership.py) at host:N. Its output goes to
`<log_dir>/<name>.log`. A site that exits or does not serve within `start_timeout_s` is a failed
start: its slot is free again. Retiring a site (after the controller drained it out of the
registry) sends SIGTERM, then SIGKILL after `stop_timeout_s`; the gateway stopping retires all.

With `idle_memory_kv_mib` set and an IdleMemory given, a scale-out marked idle-memory-first
(ScaleOut.idle_memory) first places each site in the free top of a running site's KV cache
(gateway/scaling/idle_memory.py): the site lends that memory (it releases it), and the new
site, a borrower named `<prefix>-idle-<n>`, starts cold beside its lender (the lender's slot,
so its CUDA_VISIBLE_DEVICES, with `--kv-cache-mib`); a placement that finds no room takes a free
slot as any start. A borrower that retires, exits or fails to start gives the lending back.

With `pool_size` > 0 a start first claims a process of the warm pool (gateway/scaling/
local_pool.py: started ahead, imports and weights done) and serves in about a second; a start
finding none ready starts cold as above.

The sites run as the gateway's children: a gateway killed outright (SIGKILL) leaves them
running, as any supervisor's children.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedllm_contract.site_environment import site_environment
from gateway.admin.membership import SiteMembership
from gateway.errors import GatewayError
from gateway.federation import SiteConfig
from gateway.scaling.actuator import OnFailure
from gateway.scaling.config import ActuatorConfig, LocalSlot
from gateway.scaling.idle_memory import MIB, IdleMemory, beside
from gateway.scaling.local_pool import LocalPool, Pooled, start_site_process
from gateway.sites.registry import SiteState

log = logging.getLogger(__name__)
_READY = re.compile(r"^READY port=(\d+)(?=\D)", re.MULTILINE)
_POLL_S = 0.1


@dataclass
class _Child:
    name: str
    slot: int
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    joined: bool = False
    exited: bool = False  # it joined, then its process exited: leaving
    # retire() is stopping it: its exit is the stop's doing, no failure for tick() to report.
    retiring: bool = False
    # It runs in memory its slot's site lent (idle memory first), beside that site.
    borrowing: bool = False
    waiter: asyncio.Task[None] | None = field(default=None, repr=False)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class LocalProcesses:
    kind = "local"

    def __init__(
        self,
        model: str,
        config: ActuatorConfig,
        membership: SiteMembership,
        on_failure: OnFailure,
        idle_memory: IdleMemory | None = None,
    ) -> None:
        self._model = model
        self._config = config
        self._membership = membership
        self._on_failure = on_failure
        # Name -> the site: one per slot that holds it, and borrowers beside them.
        self._children: dict[str, _Child] = {}
        self._idle = idle_memory if config.idle_memory_kv_mib else None
        self._borrowers = 0  # borrowers started (their names' serial)
        # Its joined sites that failed their last health check (the registry's, at the last
        # tick) while their process runs: a blip (a check timed out on a busy machine) or a
        # restart on the way; counted as coming back, so that no other start is asked for.
        self._unhealthy: set[str] = set()
        # How long the last start took from its spawn (or claim) to joining.
        self._last_start_s: float | None = None
        self._pool = LocalPool(config, model)

    def start_seconds(self) -> float | None:
        return self._last_start_s

    def pooled(self) -> list[Pooled]:
        """The warm pool's processes now (claimed ones are sites, not in it)."""
        return self._pool.members()

    def pending(self) -> int:
        children = [c for c in self._children.values() if not c.retiring]
        starting = sum(not (c.joined or c.exited) for c in children)
        blipping = sum(c.joined and c.name in self._unhealthy for c in children)
        return starting + blipping

    def removable(self, site: SiteState) -> bool:
        return any(
            c.name == site.name and c.joined and not c.retiring for c in self._children.values()
        )

    def site_name(self, slot: int) -> str:
        return f"{self._config.name_prefix}-{slot}"

    async def start(self, count: int, idle_memory: bool = False) -> int:
        started = 0
        while idle_memory and started < count and await self._start_beside():
            started += 1
        held = {c.slot for c in self._children.values() if not c.borrowing}
        free = [i for i in range(len(self._config.slots)) if i not in held]
        for slot in free[: count - started]:
            place, name = self._config.slots[slot], self.site_name(slot)
            pooled = self._pool.take(place, name)
            if pooled is not None:
                log.info("site %s: claimed pooled process %d (slot %d): %s", name,
                         pooled.popen.pid, slot, pooled.log_path)  # fmt: skip
                child = _Child(name, slot, pooled.popen, pooled.log_path, time.monotonic())
            else:
                child = self._spawn(slot, place, name)
            self._begin(child)
        return started + min(count - started, len(free))

    def _begin(self, child: _Child) -> None:
        self._children[child.name] = child
        child.waiter = asyncio.create_task(self._join_when_ready(child), name=child.name)

    async def _start_beside(self) -> bool:
        """One site in idle memory beside a serving site of ours; False: no room anywhere."""
        if self._idle is None:
            return False
        lenders = [c for c in self._children.values()
                   if c.joined and not (c.borrowing or c.retiring)]  # fmt: skip
        rooms = await self._idle.rooms([(c.name, self._config.slots[c.slot]) for c in lenders])
        name = f"{self._config.name_prefix}-idle-{self._borrowers}"
        overhead = self._config.idle_memory_overhead_mib * MIB
        budget = self._config.idle_memory_kv_mib * MIB + overhead
        borrowing = await self._idle.place(name, rooms, budget)
        if borrowing is None:
            return False
        self._borrowers += 1
        slot = next(c.slot for c in lenders if c.name == borrowing.lender)
        log.info("site %s: in %d MiB of site %s's KV cache (slot %d)", name,
                 borrowing.bytes // MIB, borrowing.lender, slot)  # fmt: skip
        child = self._spawn(slot, beside(borrowing, overhead), name)
        child.borrowing = True
        self._begin(child)
        return True

    async def _forget(self, child: _Child) -> None:
        """Its process is gone: its slot (or its lender's memory) is free again."""
        self._children.pop(child.name, None)
        if child.borrowing and self._idle is not None:
            await self._idle.retire(child.name)

    def _spawn(self, slot: int, place: LocalSlot, name: str) -> _Child:
        args = ["--port", "0", "--site-name", name, *place.args]
        # Only what a site needs, and the slot's own: not the gateway's secrets.
        env = site_environment(os.environ, dict(place.env))
        popen, log_path = start_site_process(
            self._config, self._model, name, args, subprocess.DEVNULL, env
        )
        log.info("starting site %s (slot %d, pid %d): %s", name, slot, popen.pid, log_path)
        return _Child(name, slot, popen, log_path, time.monotonic())

    async def _join_when_ready(self, child: _Child) -> None:
        try:
            port = await self._wait_ready(child)
            config = SiteConfig(
                name=child.name,
                cloud=self._config.cloud,
                region=self._config.region,
                endpoint=f"{self._config.host}:{port}",
                model=self._model,
                capacity_weight=self._config.capacity_weight,
                prefill_tokens_per_s=self._config.prefill_tokens_per_s,
            )
            took = time.monotonic() - child.started_at
            await self._membership.join(config, self.kind, f"served {took:.1f}s after its start")
            child.joined = True
            self._last_start_s = took
        except (_StartFailed, GatewayError) as exc:
            await self._stop(child)
            await self._forget(child)
            await self._on_failure(self._model, f"site {child.name} did not start: {exc}")

    async def _wait_ready(self, child: _Child) -> int:
        deadline = child.started_at + self._config.start_timeout_s
        while time.monotonic() < deadline:
            match = _READY.search(child.log_tail(200))
            if match:
                return int(match.group(1))
            if child.popen.poll() is not None:
                raise _StartFailed(f"exited with {child.popen.returncode}: {child.log_tail(5)}")
            await asyncio.sleep(_POLL_S)
        raise _StartFailed(f"not serving after {self._config.start_timeout_s:g}s")

    def draining(self, name: str) -> None:
        return  # its process serves what it has until retire() stops it

    async def retire(self, name: str) -> None:
        child = self._children.get(name)
        if child is not None:
            # Marked before the SIGTERM: a tick() while the process ends must not take the
            # exit for a crash (it reported a failure and freed the slot under this stop).
            child.retiring = True
            await self._stop(child)
            await self._forget(child)

    async def _stop(self, child: _Child) -> None:
        if child.waiter is not None and child.waiter is not asyncio.current_task():
            child.waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await child.waiter
        if child.popen.poll() is not None:
            return
        child.popen.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(child.popen.wait, self._config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("site %s ignored SIGTERM for %gs: killed", child.name,
                        self._config.stop_timeout_s)  # fmt: skip
            child.popen.kill()
            await asyncio.to_thread(child.popen.wait)
        log.info("site %s stopped", child.name)

    async def tick(self, sites: list[SiteState]) -> None:
        """A joined site whose process exited leaves (its requests moved or continued
        elsewhere, as for any failed site), and its slot is free again once it has."""
        self._unhealthy = {s.name for s in sites if not s.healthy and not s.draining}
        self._pool.fill()
        if self._idle is not None:
            await self._idle.renew_due()  # the borrowers' leases, before they lapse
        for child in list(self._children.values()):
            if child.joined and not child.retiring and child.popen.poll() is not None:
                child.joined, child.exited = False, True
                child.waiter = asyncio.create_task(self._exited(child), name=child.name)

    async def _exited(self, child: _Child) -> None:
        code = child.popen.returncode
        leaving = self._membership.leave(child.name, self.kind, f"its process exited ({code})")
        if leaving is not None:
            await leaving
        await self._forget(child)
        await self._on_failure(self._model, f"site {child.name} exited ({code})")

    async def run(self) -> None:
        return

    async def close(self) -> None:
        # Borrowers first: their lenders take their memory back before they stop too.
        borrowers = [c for c in self._children.values() if c.borrowing]
        await asyncio.gather(*(self._stop(child) for child in borrowers))
        for child in borrowers:
            await self._forget(child)
        await asyncio.gather(*(self._stop(child) for child in self._children.values()))
        self._children.clear()
        await asyncio.to_thread(self._pool.close)


class _StartFailed(Exception):
    pass
