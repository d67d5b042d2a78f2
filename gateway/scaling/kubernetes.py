"""The Kubernetes actuator: Kubernetes scales the sites, this gateway gives the signal and
follows the pods.

The sites are a StatefulSet behind a headless Service (deploy/k8s/): pod i answers at
`<statefulset>-<i>.<service>.<namespace>.svc` while it is ready. KEDA (or the HPA on an
external metric) sets the StatefulSet's replicas to fedllm_gateway_scaling_desired_pods, which
this gateway's controller computes: its desired sites plus `pool_size`. Here:

- every `resolve_every_s`, each ordinal below the model's max_sites + pool_size is resolved; a
  name that resolves and is not registered joins (gateway/admin/membership.py) if its ordinal is
  one this gateway wants serving, a registered one that no longer resolves (its pod is
  terminating, or gone) leaves by draining;
- a scale-out asks for sites: they are pending until as many new pods joined, or
  `start_timeout_s` (a failed start, reported once);
- a StatefulSet removes its highest ordinal first, so that is the only site the controller may
  take away: it drains it before Kubernetes stops the pod (the pod's preStop hook gives it
  time), and it does not join again while its name still resolves.

Without a pool every pod that resolves serves. With `pool_size` P the gateway wants ordinals
0..n-1 serving and the P pods above them are the warm pool: started (weights loaded, cache and
graphs ready, so their readiness probe passes and their names resolve) and never joined, so
nothing is routed to them. A scale-out by k wants k more ordinals: the pool's pods join on the
spot, with no pod start, and the autoscaler starts k new pool pods behind them. A scale-in
drains the highest serving ordinal, which stays up as a pool pod; the StatefulSet removes the
ordinal above the pool. docs/elastic.md, "The warm pool", says why a pool pod is Ready.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from gateway.admin.membership import SiteMembership
from gateway.errors import GatewayError
from gateway.federation import SiteConfig
from gateway.scaling.actuator import AskedStarts, OnFailure
from gateway.scaling.config import ActuatorConfig
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)


async def resolves(host: str, port: int) -> bool:
    try:
        await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return True


class KubernetesPods:
    kind = "kubernetes"

    def __init__(
        self,
        model: str,
        config: ActuatorConfig,
        max_sites: int,
        registry: SiteRegistry,
        membership: SiteMembership,
        on_failure: OnFailure,
    ) -> None:
        self._model = model
        self._config = config
        self._max_sites = max_sites
        self._registry = registry
        self._membership = membership
        self._on_failure = on_failure
        self._asked = AskedStarts(config.start_timeout_s)
        # Drained out by the controller: not joined again until their name stops resolving.
        self._retired: set[str] = set()
        # With a pool: the ordinals below this serve, the rest wait unjoined (None: not known
        # until the first pass over the pods).
        self._serving_ordinals: int | None = None
        self.resolve = resolves

    @property
    def pool_size(self) -> int:
        return self._config.pool_size

    @property
    def serving_ordinals(self) -> int | None:
        """With a pool: how many ordinals, from 0, this gateway wants serving."""
        return self._serving_ordinals

    def name(self, ordinal: int) -> str:
        return f"{self._config.name_prefix}-{ordinal}"

    def host(self, ordinal: int) -> str:
        return self._config.host_pattern.format(i=ordinal) if self._config.host_pattern else ""

    def _ordinal(self, name: str) -> int | None:
        prefix = f"{self._config.name_prefix}-"
        tail = name.removeprefix(prefix)
        return int(tail) if name.startswith(prefix) and tail.isdigit() else None

    def pending(self) -> int:
        return len(self._asked)

    def start_seconds(self) -> float | None:
        return self._asked.last_start_s

    def removable(self, site: SiteState) -> bool:
        ours = [
            o
            for s in self._registry.all()
            if s.origin == self.kind and (o := self._ordinal(s.name)) is not None
        ]
        ordinal = self._ordinal(site.name)
        return site.origin == self.kind and ordinal is not None and ordinal == max(ours)

    async def start(self, count: int, idle_memory: bool = False) -> int:
        # A pod holds a GPU of its own (the scheduler places it): `idle_memory` is not followed.
        self._asked.ask(count)
        if self.pool_size:
            if self._serving_ordinals is None:  # asked before the first pass over the pods
                await self.follow_once()
            assert self._serving_ordinals is not None
            first = self._serving_ordinals
            self._serving_ordinals = min(self._max_sites, first + count)
            # The pool's pods are up already: they join now, not at the next pass.
            for ordinal in range(first, self._serving_ordinals):
                name, host = self.name(ordinal), self.host(ordinal)
                if self._registry.get(name) is None and await self.resolve(host, self._config.port):
                    await self._join(name, host)
        return count

    def draining(self, name: str) -> None:
        self._retired.add(name)
        ordinal = self._ordinal(name)
        if self.pool_size and ordinal is not None and self._serving_ordinals is not None:
            # Removable means the highest serving ordinal: it goes back to the pool.
            self._serving_ordinals = min(self._serving_ordinals, ordinal)

    async def retire(self, name: str) -> None:
        self.draining(name)

    async def tick(self, sites: list[SiteState]) -> None:
        if expired := self._asked.expired():
            await self._on_failure(self._model, f"{expired} pod(s) asked for never served")

    async def run(self) -> None:
        while True:
            await self.follow_once()
            await asyncio.sleep(self._config.resolve_every_s)

    async def follow_once(self) -> None:
        """One pass over the ordinals: joins the pods that resolve (with a pool, those this
        gateway wants serving), drains out the ones that stopped resolving."""
        present = [
            await self.resolve(self.host(ordinal), self._config.port)
            for ordinal in range(self._max_sites + self.pool_size)
        ]
        if self.pool_size and self._serving_ordinals is None:
            # A gateway (re)starting: the pods above the pool's are the ones to serve.
            running = present.index(False) if False in present else len(present)
            self._serving_ordinals = min(self._max_sites, max(0, running - self.pool_size))
        for ordinal, up in enumerate(present):
            name = self.name(ordinal)
            site = self._registry.get(name)
            if not up:
                self._retired.discard(name)
                if site is not None and site.origin == self.kind:
                    self._membership.leave(name, self.kind, "its pod no longer resolves")
            elif site is None and self._wanted(ordinal, name):
                await self._join(name, self.host(ordinal))

    def _wanted(self, ordinal: int, name: str) -> bool:
        if self.pool_size and self._serving_ordinals is not None:
            return ordinal < self._serving_ordinals
        return name not in self._retired

    async def _join(self, name: str, host: str) -> None:
        config = SiteConfig(
            name=name,
            cloud=self._config.cloud,
            region=self._config.region,
            endpoint=f"{host}:{self._config.port}",
            model=self._model,
            capacity_weight=self._config.capacity_weight,
            tls_server_name=self._config.tls_server_name,
            prefill_tokens_per_s=self._config.prefill_tokens_per_s,
        )
        try:
            await self._membership.join(config, self.kind, f"pod {host}")
        except GatewayError as exc:
            log.warning("pod %s could not join: %s", host, exc)
            return
        self._asked.arrived()

    async def close(self) -> None:
        return
