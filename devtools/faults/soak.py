"""A bounded soak: concurrent clients (streaming and not) for a fixed time while faults are
injected at random, one at a time: a site SIGKILLed and restarted, a site SIGSTOPped past the
load-report staleness limit and SIGCONTed, the gateway's database backends terminated."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import httpx

from devtools.faults.client import Tally, complete
from devtools.faults.cluster import Cluster
from devtools.faults.scenarios import CLIENT_TIMEOUT_S, recorded

FAULTS = ("site kill + restart", "site SIGSTOP/SIGCONT", "database backends terminated")


async def soak(
    cluster: Cluster,
    seconds: float,
    *,
    clients: int = 6,
    stale_s: float = 2.0,
    seed: int = 0,
) -> dict[str, Any]:
    rng = random.Random(seed)
    tally = Tally()
    stop = asyncio.Event()
    injected: Counter[str] = Counter()
    timeline: list[str] = []
    began = time.monotonic()

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        worker_rng = random.Random(seed * 1000 + index)
        n = 0
        while not stop.is_set():
            tokens = worker_rng.choice((8, 16, 32, 64, 128))
            stream = index % 2 == 0
            result = await complete(
                client, f"soak client {index} request {n}", tokens, stream=stream
            )
            tally.add(result)
            await result.back_off()
            n += 1

    async def inject() -> None:
        names = list(cluster.site_names)
        while time.monotonic() - began < seconds - 5:
            await asyncio.sleep(rng.uniform(2.0, 6.0))
            if time.monotonic() - began >= seconds - 5:
                break
            fault = rng.choice(FAULTS)
            at = f"{time.monotonic() - began:5.1f}s"
            if fault == "site kill + restart":
                name = rng.choice(names)
                await asyncio.to_thread(cluster.kill_site, name)
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                await asyncio.to_thread(cluster.restart_site, name)
                await asyncio.to_thread(cluster.wait_site_health, name, True, 60.0)
                timeline.append(f"{at} kill + restart {name}")
            elif fault == "site SIGSTOP/SIGCONT":
                name = rng.choice(names)
                pause = stale_s + rng.uniform(0.5, 2.0)
                await asyncio.to_thread(cluster.freeze, name)
                await asyncio.sleep(pause)
                await asyncio.to_thread(cluster.thaw, name)
                timeline.append(f"{at} SIGSTOP {name} for {pause:.1f}s")
            else:
                block = rng.choice((0.0, 0.0, 1.0))
                count = await asyncio.to_thread(cluster.drop_database_connections, block)
                timeline.append(f"{at} terminate {count} db backends, refuse {block:g}s")
            injected[fault] += 1

    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        tasks = [asyncio.create_task(client_loop(i, client)) for i in range(clients)]
        await inject()
        await asyncio.sleep(max(0.0, seconds - (time.monotonic() - began)))
        stop.set()
        await asyncio.gather(*tasks)
    return {
        "scenario": "soak",
        "fault": f"{seconds:.0f} s, {clients} clients (half streaming), "
        f"{len(cluster.site_names)} sites, random faults one at a time (seed {seed})",
        "seconds": round(time.monotonic() - began, 1),
        **tally.summary(),
        "faults_injected": dict(injected),
        "timeline": timeline,
        **recorded(cluster, tally),
        "lost_detail": tally.lost_detail(),
    }
