"""Holding the sites while a burst is queued, so that a run starts with every query waiting.

MICO counts time in engine iterations from a state where all queries are present. Through a
real gateway a burst takes a while to arrive (tokenizing, predicting, routing and recording
each request), and a site that starts on the first arrivals runs its first iterations with
half-empty batches: the iteration count would then measure the arrival rate, not the
scheduling. So before the burst is sent, each measured site gets long "hold" requests sent
straight to it over gRPC (not through the gateway, so no routing decision or ledger sees them):
`max_batch` of them fill an iteration-level site's batch, one makes a static site's batch, and
the burst queues behind them. While the burst arrives the held sites are also slowed down to a
twentieth of their speed (SIGSTOP/SIGCONT, see throttle.py): they stay reachable and keep
reporting, but their holds do not take the CPU the gateway needs to dispatch the burst, and
last twenty times longer. Once the sites report every query queued, the counters are read, the
holds are cancelled and the sites run at full speed: the next iteration starts on the burst.

Every site of a run is held the same way, so the load the holds add to the sites' own reports
is the same everywhere (in proportion to the batch size). A hold that runs to its end before
the release lets the burst start early; that is counted (`leaked`) and reported with the run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.multisite.cluster import SiteSpec
from bench.multisite.counters import SiteCounters, read_counters
from bench.multisite.throttle import Throttle
from fedllm_contract.request_options import RequestOptions
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import GenerateParams, SiteCallError

# "The quick brown fox jumps over the lazy" in GPT-2 token ids: any valid ids would do.
HOLD_PROMPT = (464, 2068, 7586, 21831, 18045, 625, 262, 16931)
HOLD_STOPPED_SHARE = 0.95


class HoldError(RuntimeError):
    """The holds could not be placed, or the burst never fully queued behind them."""


def holds_needed(site: SiteSpec) -> int:
    """A static site admits nothing while a batch runs: one hold is a batch. An iteration-level
    site admits whenever a slot is free: every slot needs one."""
    return 1 if site.policy == "static" else site.max_batch


@dataclass
class Hold:
    sites: Sequence[SiteSpec]
    pids: Mapping[str, int]  # site name -> process id
    max_model_len: int
    leaked: int = 0  # holds that ended on their own before the release
    _clients: dict[str, GrpcSiteClient] = field(default_factory=dict)
    _ids: dict[str, list[str]] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _throttle: Throttle | None = None
    _released: bool = False

    @property
    def endpoints(self) -> dict[str, str]:
        return {s.name: s.endpoint for s in self.sites}

    @property
    def holds(self) -> int:
        return sum(holds_needed(s) for s in self.sites)

    async def engage(self, timeout_s: float = 60.0) -> None:
        """Places the holds, waits until each site reports them, then slows the sites down."""
        max_tokens = self.max_model_len - len(HOLD_PROMPT)
        for site in self.sites:
            client = GrpcSiteClient(site.name, site.endpoint, connect_timeout_s=30)
            self._clients[site.name] = client
            self._ids[site.name] = [f"hold-{uuid.uuid4().hex}" for _ in range(holds_needed(site))]
            for request_id in self._ids[site.name]:
                params = GenerateParams(
                    request_id=request_id,
                    prompt_token_ids=HOLD_PROMPT,
                    max_tokens=max_tokens,
                    options=RequestOptions(temperature=0.0, top_p=1.0, ignore_eos=True),
                    # What the site reports as a request's remaining load is its prediction:
                    # a hold then adds only its few cached tokens to the load routing sees.
                    predicted_tokens=1,
                )
                self._tasks.append(asyncio.create_task(self._consume(client, params)))
        need = {s.name: holds_needed(s) for s in self.sites}
        await self._wait(
            lambda seen: all(
                c.running >= 1 and c.running + c.queued >= need[n] for n, c in seen.items()
            ),
            timeout_s,
            "holds never reached every site",
        )
        self._throttle = Throttle(tuple(self.pids[s.name] for s in self.sites), HOLD_STOPPED_SHARE)
        self._throttle.start()

    async def wait_queued(
        self, queries: int, submission: asyncio.Task[Any], timeout_s: float = 900.0
    ) -> dict[str, SiteCounters]:
        """Until the sites hold `queries` requests besides the holds (or the submission ended,
        e.g. refused); returns that reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = await read_counters(self.endpoints)
            queued = sum(c.queued + c.running for c in seen.values()) - self.holds
            if queued >= queries or submission.done():
                return seen
            if time.monotonic() > deadline:
                raise HoldError(f"only {queued} of {queries} queries queued in {timeout_s:.0f}s")
            await asyncio.sleep(0.1)

    async def release(self) -> None:
        """Cancels every hold (queued ones too), restores full speed, closes the connections."""
        if self._released:
            return
        self._released = True
        try:
            await asyncio.gather(
                *(
                    self._clients[name].cancel(request_id)
                    for name, ids in self._ids.items()
                    for request_id in ids
                ),
                return_exceptions=True,
            )
        finally:
            if self._throttle is not None:
                self._throttle.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            await client.close()

    async def _consume(self, client: GrpcSiteClient, params: GenerateParams) -> None:
        try:
            async for chunk in client.generate(params, timeout_s=3600):
                if chunk.finish_reason is not None and chunk.finish_reason != "cancelled":
                    self.leaked += 1
        except SiteCallError:
            if not self._released:
                raise

    async def _wait(
        self, done: Callable[[dict[str, SiteCounters]], bool], timeout_s: float, message: str
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(await read_counters(self.endpoints)):
            if time.monotonic() > deadline:
                await self.release()
                raise HoldError(message)
            await asyncio.sleep(0.05)
