"""The site's idle-memory RPCs (KvRoom, LendKv, ReturnKv): the protobuf face of
PagedEngine.kv_room / lend_kv / return_kv (docs/elastic.md, "Idle memory first"), mixed into the
site's servicer (grpc_server.py). The engine's calls run on its thread, between steps."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from fedllm_contract.proto import site_pb2

if TYPE_CHECKING:
    from site_engine.engine_service import EngineService

log = logging.getLogger(__name__)


class KvLendingHandlers:
    _service: EngineService

    async def KvRoom(
        self, request: site_pb2.KvRoomRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        return site_pb2.KvBytes(bytes=await self._service.kv_room())

    async def LendKv(
        self, request: site_pb2.LendKvRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        if request.bytes < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a lending needs bytes >= 1")
        try:
            lent = await self._service.lend_kv(request.bytes)
        except ValueError as exc:  # it lends already
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return site_pb2.KvBytes(bytes=lent)

    async def ReturnKv(
        self, request: site_pb2.ReturnKvRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        try:
            returned = await self._service.return_kv()
        except Exception as exc:  # the memory could not be had again: still lent
            log.exception("the lent KV memory could not be re-acquired")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"still lent: {exc}")
        return site_pb2.KvBytes(bytes=returned)
