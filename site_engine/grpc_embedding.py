"""The gRPC adapter of a site that serves an embedding model: protobuf in, the batcher's typed
calls, protobuf out (with grpc_server.py, the only site modules that touch the generated types).

Such a site answers Embed, Info (task MODEL_TASK_EMBED, its vectors' dimension, no KV cache) and
StreamLoad (inputs waiting and being embedded, in requests and tokens), so the gateway checks,
routes and balances it like any site. Generate is refused, as a generative site refuses Embed;
nothing is ever queued for release.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from fedllm_contract.proto import site_pb2, site_pb2_grpc
from site_engine.embedding.batcher import EmbeddingBatcher, InvalidEmbedRequest
from site_engine.engine_service import DuplicateRequest, EngineFailure, QueueFull
from site_engine.grpc_server import MAX_REQUEST_ID_LEN, SiteIdentity


class EmbeddingServicer(site_pb2_grpc.SiteEngineServicer):
    def __init__(self, batcher: EmbeddingBatcher, identity: SiteIdentity, dimension: int) -> None:
        self._batcher = batcher
        self._identity = identity
        self._dimension = dimension
        self._report_sequence = 0

    async def Embed(
        self, request: site_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.EmbedResponse:
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_LEN:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters",
            )
        if request.dimensions not in (0, self._dimension):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {self._identity.model_name} gives {self._dimension}-dimensional "
                f"vectors and cannot shorten them (dimensions={request.dimensions})",
            )
        inputs = [tuple(item.token_ids) for item in request.inputs]
        try:
            output = await self._batcher.embed(request.request_id, inputs)
        except InvalidEmbedRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DuplicateRequest as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineFailure as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        return site_pb2.EmbedResponse(
            embeddings=[site_pb2.Embedding(float32_le=vector) for vector in output.vectors],
            prompt_tokens=output.prompt_tokens,
        )

    async def Generate(
        self, request: site_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[site_pb2.GenerateChunk]:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._does_not_generate())
        yield site_pb2.GenerateChunk()  # never reached: abort raises

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[site_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[site_pb2.GenerateStreamBatch]:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._does_not_generate())
        yield site_pb2.GenerateStreamBatch()  # never reached: abort raises

    def _does_not_generate(self) -> str:
        return (
            f"site {self._identity.site_name} serves embedding model "
            f"{self._identity.model_name}: it embeds (Embed) and does not generate"
        )

    async def Cancel(
        self, request: site_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.CancelResponse:
        return site_pb2.CancelResponse(cancelled=False)

    async def ReleaseQueued(
        self, request: site_pb2.ReleaseQueuedRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.ReleaseQueuedResponse:
        return site_pb2.ReleaseQueuedResponse()

    async def LoadAdapter(
        self, request: site_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.AdapterList:
        await self._no_adapters(context)
        return site_pb2.AdapterList()  # never reached: abort raises

    async def UnloadAdapter(
        self, request: site_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.AdapterList:
        await self._no_adapters(context)
        return site_pb2.AdapterList()  # never reached: abort raises

    async def LoadAdapterArchive(
        self,
        request_iterator: AsyncIterator[site_pb2.AdapterArchiveChunk],
        context: grpc.aio.ServicerContext,
    ) -> site_pb2.AdapterList:
        await self._no_adapters(context)
        return site_pb2.AdapterList()

    async def GetFineTunedAdapter(
        self, request: site_pb2.FineTuneJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[site_pb2.DataChunk]:
        await self._no_fine_tuning(context)
        yield site_pb2.DataChunk()  # never reached: abort raises

    async def StartFineTune(
        self, request: site_pb2.FineTuneSpec, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneProgress:
        await self._no_fine_tuning(context)
        return site_pb2.FineTuneProgress()  # never reached: abort raises

    async def GetFineTuneProgress(
        self, request: site_pb2.FineTuneJobRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneProgress:
        await self._no_fine_tuning(context)
        return site_pb2.FineTuneProgress()

    async def CancelFineTune(
        self, request: site_pb2.FineTuneJobRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneProgress:
        await self._no_fine_tuning(context)
        return site_pb2.FineTuneProgress()

    async def ListFineTunes(
        self, request: site_pb2.ListFineTunesRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneJobIds:
        await self._no_fine_tuning(context)
        return site_pb2.FineTuneJobIds()

    async def KvRoom(
        self, request: site_pb2.KvRoomRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        return site_pb2.KvBytes(bytes=0)  # no KV cache: nothing to lend

    async def LendKv(
        self, request: site_pb2.LendKvRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        return site_pb2.KvBytes(bytes=0)  # refused: no KV cache

    async def ReturnKv(
        self, request: site_pb2.ReturnKvRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        return site_pb2.KvBytes(bytes=0)  # nothing was lent

    async def RenewKvLease(
        self, request: site_pb2.RenewKvLeaseRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.KvBytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "an embedding site lends nothing")
        return site_pb2.KvBytes()  # never reached: abort raises

    async def _no_fine_tuning(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"site {self._identity.site_name} serves embedding model "
            f"{self._identity.model_name}: it takes no fine-tuning jobs",
        )

    async def _no_adapters(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"site {self._identity.site_name} serves embedding model "
            f"{self._identity.model_name}: it serves no LoRA adapters",
        )

    async def Info(
        self, request: site_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.SiteInfo:
        ident, limits = self._identity, self._batcher.limits
        return site_pb2.SiteInfo(
            site_name=ident.site_name,
            model=ident.model_name,
            max_model_len=self._batcher.max_seq_length,
            vocab_size=ident.vocab_size,
            tokenizer_fingerprint=ident.tokenizer_fingerprint,
            device=ident.device,
            dtype=ident.dtype,
            kv_block_size=1,
            kv_blocks_total=0,
            max_num_seqs=limits.max_batch_inputs,
            engine="embedding",
            version=ident.version,
            task=site_pb2.MODEL_TASK_EMBED,
            embedding_dimension=self._dimension,
        )

    def load_report(self) -> site_pb2.LoadReport:
        stats = self._batcher.stats()
        self._report_sequence += 1
        return site_pb2.LoadReport(
            site_name=self._identity.site_name,
            timestamp_ms=int(time.time() * 1000),
            sequence=self._report_sequence,
            queued_requests=stats.queued_requests,
            running_requests=stats.running_requests,
            queued_prompt_tokens=stats.queued_tokens,
            running_tokens=stats.running_tokens,
            iterations=stats.forward_passes,
            prefill_tokens_per_s=self._batcher.tokens_per_s(),
        )

    async def StreamLoad(
        self, request: site_pb2.LoadStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[site_pb2.LoadReport]:
        """Reports without cache events whatever was asked: an embedding site caches nothing."""
        interval_s = max(request.interval_ms, 10) / 1000
        while True:
            yield self.load_report()
            await asyncio.sleep(interval_s)
