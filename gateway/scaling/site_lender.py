"""IdleMemory's lender over the sites' own calls (gateway/sites/interface.KvLendingSite: the
gRPC client's KvRoom, LendKv, ReturnKv, RenewKvLease), each site looked up by name in the
registry. Any failure of a call (a site gone from the registry, one that cannot lend, an error
or no answer) is LendFailed: the placement tries the next site or a new GPU; a renewal of a
lease the site no longer holds is LeaseLost."""

from __future__ import annotations

from gateway.scaling.idle_memory import LeaseLost, LendFailed
from gateway.sites.interface import KvLease, KvLeaseLost, KvLendingSite, SiteCallError
from gateway.sites.registry import SiteRegistry


class SiteLender:
    def __init__(self, registry: SiteRegistry) -> None:
        self._registry = registry

    def _site(self, name: str) -> KvLendingSite:
        state = self._registry.get(name)
        if state is None:
            raise LendFailed(f"site {name} is not in the registry")
        if not isinstance(state.client, KvLendingSite):
            raise LendFailed(f"site {name} does not lend KV memory")
        return state.client

    async def room(self, site: str) -> int:
        try:
            return await self._site(site).kv_room()
        except SiteCallError as exc:
            raise LendFailed(str(exc)) from exc

    async def lend(self, site: str, wanted_bytes: int, lease: KvLease) -> int:
        try:
            return await self._site(site).lend_kv(wanted_bytes, lease)
        except SiteCallError as exc:
            raise LendFailed(str(exc)) from exc

    async def take_back(self, site: str, lease_id: str) -> None:
        try:
            await self._site(site).return_kv(lease_id)
        except SiteCallError as exc:
            raise LendFailed(str(exc)) from exc

    async def renew(self, site: str, lease: KvLease) -> None:
        try:
            await self._site(site).renew_kv_lease(lease)
        except KvLeaseLost as exc:
            raise LeaseLost(str(exc)) from exc
        except SiteCallError as exc:
            raise LendFailed(str(exc)) from exc
