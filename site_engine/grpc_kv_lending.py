"""The site's idle-memory RPCs (KvRoom, LendKv, ReturnKv, RenewKvLease): the protobuf face of
PagedEngine.kv_room / lend_kv / return_kv (docs/elastic.md, "Idle memory first"), mixed into the
site's servicer (grpc_server.py). The engine's calls run on its thread, between steps.

Each call answers the gateway alone (site_engine/kv_lending_access.py), and a lending is held by
its caller's lease (site_engine/kv_leases.py): only that lease returns or renews it, and one not
renewed in time is taken back by the site."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from fedllm_contract.proto import site_pb2
from site_engine.kv_leases import AlreadyLending, LeaseArgumentError, LeaseNotHeld

if TYPE_CHECKING:
    from site_engine.engine_service import EngineService
    from site_engine.kv_leases import KvLeases
    from site_engine.kv_lending_access import LendingAccess

log = logging.getLogger(__name__)


class KvLendingHandlers:
    _service: EngineService
    _kv_leases: KvLeases
    _lending_access: LendingAccess

    async def _only_the_gateway(self, context: grpc.aio.ServicerContext) -> None:
        refusal = self._lending_access.refusal(context.peer(), context.auth_context())
        if refusal is not None:
            log.warning("a KV lending call from %s refused: %s", context.peer(), refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    async def KvRoom(
        self, request: site_pb2.KvRoomRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        await self._only_the_gateway(context)
        return site_pb2.KvBytes(bytes=await self._service.kv_room())

    async def LendKv(
        self, request: site_pb2.LendKvRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        await self._only_the_gateway(context)
        if request.bytes < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a lending needs bytes >= 1")
        ttl_s = request.lease_ttl_ms / 1000
        try:
            lent = await self._kv_leases.lend(request.lease_id, request.bytes, ttl_s)
        except LeaseArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (AlreadyLending, ValueError) as exc:  # the engine's: it lends already
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return site_pb2.KvBytes(bytes=lent)

    async def ReturnKv(
        self, request: site_pb2.ReturnKvRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        await self._only_the_gateway(context)
        try:
            returned = await self._kv_leases.give_back(request.lease_id)
        except LeaseArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # the memory could not be had again: still lent
            log.exception("the lent KV memory could not be re-acquired")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"still lent: {exc}")
        return site_pb2.KvBytes(bytes=returned)

    async def RenewKvLease(
        self, request: site_pb2.RenewKvLeaseRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        await self._only_the_gateway(context)
        try:
            lent = await self._kv_leases.renew(request.lease_id, request.lease_ttl_ms / 1000)
        except LeaseArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LeaseNotHeld as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return site_pb2.KvBytes(bytes=lent)
