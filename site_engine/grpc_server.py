"""The site's gRPC adapter: protobuf in, typed engine calls, protobuf out.

This, its sibling for embedding models (grpc_embedding.py), gateway/sites/grpc_client.py and
the request options' codec they share (fedllm_contract/proto/options.py) are the only modules
that touch the generated protobuf types.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedllm_contract.block_hash import HASH_SCHEME
from fedllm_contract.cache_events import (
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
    Tier,
)
from fedllm_contract.fine_tuning import FINE_TUNE_MESSAGE_OVERHEAD_BYTES, MAX_JOB_FILES_BYTES
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.proto.options import options_from_proto, priority_to_proto
from fedllm_contract.request_options import RequestOptions
from site_engine.adapter_archive import MAX_ARCHIVE_BYTES, ArchiveError, received_dir, unpack
from site_engine.answer_stream import StreamEvent
from site_engine.cache_event_journal import CacheEventStream
from site_engine.engine.core.api import AdapterRefused, EngineRequest, RequestRejected
from site_engine.engine.core.scheduler_config import ClassLoad
from site_engine.engine.core.types import FinishReason, TokenLogprob
from site_engine.engine_service import (
    DuplicateRequest,
    EngineFailure,
    EngineService,
    QueueFull,
)
from site_engine.grpc_fine_tuning import FineTuneHandlers
from site_engine.grpc_generate_stream import GenerateStreamHandler
from site_engine.grpc_kv_lending import KvLendingHandlers
from site_engine.kv_leases import KvLeases
from site_engine.kv_lending_access import LendingAccess
from site_engine.request_options import engine_request

if TYPE_CHECKING:
    from site_engine.finetune.jobs import FineTuneJobs

log = logging.getLogger(__name__)
SERVICE_NAME = "fedllm.site.v1.SiteEngine"
MAX_REQUEST_ID_LEN = 128
# Set explicitly rather than left to gRPC's default: the largest message is a fine-tuning job's
# start, its files whole (a prompt of a full context fits many times over), and a larger message
# is refused with RESOURCE_EXHAUSTED before anything is decoded or allocated for it.
MAX_RECEIVE_MESSAGE_BYTES = MAX_JOB_FILES_BYTES + FINE_TUNE_MESSAGE_OVERHEAD_BYTES
# Stop strings are matched against the text after every token: bounded so no request can make
# decoding slow for everyone in its batch. Looser than the gateway's own limits.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# The gateway sends a fixed-length digest; anything far longer is a misuse of the field.
MAX_CACHE_SALT_CHARS = 256
# Choices of one request, and logit_bias entries: bounded as the gateway bounds them (looser).
MAX_CHOICES = 128
MAX_LOGIT_BIAS_ENTRIES = 1024

_ADAPTER_STATUS = {
    AdapterRefused.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    AdapterRefused.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    AdapterRefused.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    AdapterRefused.BUSY: grpc.StatusCode.FAILED_PRECONDITION,
}
_TIER_TO_PROTO = {
    Tier.DEVICE: site_pb2.CACHE_TIER_DEVICE,
    Tier.HOST: site_pb2.CACHE_TIER_HOST,
}
_FINISH_TO_PROTO = {
    FinishReason.STOP: site_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: site_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: site_pb2.FINISH_REASON_CANCELLED,
    FinishReason.RELEASED: site_pb2.FINISH_REASON_RELEASED,
}


@dataclass(frozen=True, slots=True)
class SiteIdentity:
    site_name: str
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    device: str
    dtype: str
    version: str


class InvalidRequest(ValueError):
    pass


def _check_options(options: RequestOptions, vocab_size: int, adapters: Collection[str]) -> None:
    if len(options.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in options.stop):
        raise InvalidRequest(
            f"stop takes up to {MAX_STOP_STRINGS} strings of up to {MAX_STOP_CHARS} characters"
        )
    if len(options.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"logit_bias takes up to {MAX_LOGIT_BIAS_ENTRIES} entries")
    if any(token >= vocab_size for token, _ in options.logit_bias):
        raise InvalidRequest(f"logit_bias names a token id >= the vocabulary size {vocab_size}")
    if options.n > MAX_CHOICES:
        raise InvalidRequest(f"n takes up to {MAX_CHOICES} choices")
    if options.adapter and options.adapter not in adapters:
        raise InvalidRequest(f"adapter '{options.adapter}' is not served by this site")


def _logprob_to_proto(value: TokenLogprob) -> site_pb2.TokenLogprob:
    return site_pb2.TokenLogprob(
        logprob=value.logprob,
        top=[site_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in value.top],
    )


def _event_to_proto(request_id: str, event: StreamEvent) -> site_pb2.GenerateChunk:
    chunk = site_pb2.GenerateChunk(
        request_id=request_id,
        accepted=event.accepted,
        token_ids=event.token_ids,
        text=event.text,
        index=event.index,
        logprobs=[_logprob_to_proto(value) for value in event.logprobs],
    )
    if event.finish_reason is not None:
        chunk.finish_reason = _FINISH_TO_PROTO[event.finish_reason]
        chunk.usage.prompt_tokens = event.prompt_tokens
        chunk.usage.completion_tokens = event.completion_tokens
        chunk.usage.cached_prompt_tokens = event.cached_prompt_tokens
    return chunk


def _cache_event_to_proto(event: CacheEvent) -> site_pb2.CacheEvent:
    if isinstance(event, BlocksStored):
        return site_pb2.CacheEvent(
            kind=site_pb2.CacheEvent.STORED,
            block_hashes=event.block_ids,
            parent_block_hash=event.parent,
            tier=_TIER_TO_PROTO[event.tier],
        )
    if isinstance(event, BlocksRemoved):
        return site_pb2.CacheEvent(
            kind=site_pb2.CacheEvent.REMOVED,
            block_hashes=event.block_ids,
            tier=_TIER_TO_PROTO[event.tier],
        )
    return site_pb2.CacheEvent(kind=site_pb2.CacheEvent.CLEARED)


def _class_load_to_proto(load: ClassLoad) -> site_pb2.LoadReport.ClassLoad:
    return site_pb2.LoadReport.ClassLoad(
        priority=priority_to_proto(load.priority),
        queued_requests=load.num_waiting,
        running_requests=load.num_running,
        queued_prompt_tokens=load.queued_prompt_tokens,
        running_tokens=load.running_tokens,
        predicted_remaining_tokens=load.predicted_remaining_tokens,
    )


def _cache_events_to_proto(batch: CacheEventBatch) -> site_pb2.CacheEvents:
    return site_pb2.CacheEvents(
        epoch=batch.epoch,
        block_size=batch.block_size,
        snapshot=batch.snapshot,
        sequence=batch.sequence,
        events=[_cache_event_to_proto(event) for event in batch.events],
    )


class SiteServicer(
    GenerateStreamHandler, FineTuneHandlers, KvLendingHandlers, site_pb2_grpc.SiteEngineServicer
):
    def __init__(
        self,
        service: EngineService,
        identity: SiteIdentity,
        jobs: FineTuneJobs | None = None,
        adapter_dir: Path | None = None,
        lending_access: LendingAccess | None = None,
    ) -> None:
        self._service = service
        # Idle memory first (grpc_kv_lending.py): who may lend (the gateway: over plaintext a
        # caller on loopback), and the lease the lending is held by.
        self._lending_access = lending_access or LendingAccess()
        self._kv_leases = KvLeases(service)
        self._jobs = jobs  # None: this site takes no fine-tuning jobs
        # The site's adapter directory (--lora-dir), where adapters sent whole are kept.
        self._adapter_dir = adapter_dir
        self._identity = identity
        self._tokenizer = service.tokenizer
        self._report_sequence = 0

    def _to_engine_request(self, request: site_pb2.GenerateRequest) -> EngineRequest:
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters")
        try:
            options = options_from_proto(request)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        # The adapters served now (read from the site's adapter directory, which LoadAdapter
        # and UnloadAdapter change at run time), looked up only for a request that names one.
        served = self._service.served_adapters() if options.adapter else ()
        _check_options(options, self._identity.vocab_size, served)
        if request.prompt_token_ids:
            prompt_ids = tuple(request.prompt_token_ids)
            if max(prompt_ids) >= self._identity.vocab_size:
                raise InvalidRequest(
                    f"prompt_token_ids contains an id >= the vocabulary size "
                    f"{self._identity.vocab_size}"
                )
        else:
            prompt_ids = tuple(self._tokenizer.encode(request.prompt))
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequest(f"cache_salt takes up to {MAX_CACHE_SALT_CHARS} characters")
        try:
            return engine_request(
                request.request_id,
                prompt_ids,
                options,
                max_tokens=request.sampling.max_tokens,
                generated_before=request.sampling.generated_before,
                predicted_tokens=request.predicted_tokens or None,
                cache_salt=request.cache_salt,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _finish_to_proto(self, reason: object) -> site_pb2.FinishReason.ValueType:
        if isinstance(reason, FinishReason):
            return _FINISH_TO_PROTO[reason]
        return site_pb2.FINISH_REASON_UNSPECIFIED

    async def Generate(
        self, request: site_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[site_pb2.GenerateChunk]:
        try:
            engine_request = self._to_engine_request(request)
            n = request.sampling.n or 1
            stream = self._service.generate(engine_request, engine_request.sampling.stop, n)
            async for event in stream:
                yield _event_to_proto(request.request_id, event)
        except (InvalidRequest, RequestRejected) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DuplicateRequest as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineFailure as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))

    async def Embed(
        self, request: site_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.EmbedResponse:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"site {self._identity.site_name} serves generative model "
            f"{self._identity.model_name}: it generates (Generate) and does not embed",
        )
        return site_pb2.EmbedResponse()  # never reached: abort raises

    async def Cancel(
        self, request: site_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.CancelResponse:
        cancelled = await self._service.cancel(request.request_id)
        return site_pb2.CancelResponse(cancelled=cancelled)

    async def ReleaseQueued(
        self, request: site_pb2.ReleaseQueuedRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.ReleaseQueuedResponse:
        released = await self._service.release_queued(request.max_requests)
        return site_pb2.ReleaseQueuedResponse(
            released=[
                site_pb2.ReleasedRequest(
                    request_id=r.request_id,
                    prompt_tokens=len(r.prompt_token_ids),
                    predicted_tokens=r.predicted_tokens or 0,
                )
                for r in released
            ]
        )

    async def LoadAdapter(
        self, request: site_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.AdapterList:
        if not request.path.isprintable():  # a NUL would fail the file calls: not the site's
            message = "an adapter path must not hold control characters (NUL among them)"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            await self._service.load_adapter(request.name, request.path)
        except AdapterRefused as exc:
            await context.abort(_ADAPTER_STATUS[exc.reason], str(exc))
        return site_pb2.AdapterList(adapters=self._service.served_adapters())

    async def LoadAdapterArchive(
        self,
        request_iterator: AsyncIterator[site_pb2.AdapterArchiveChunk],
        context: grpc.aio.ServicerContext,
    ) -> site_pb2.AdapterList:
        name, data = "", bytearray()
        async for chunk in request_iterator:
            name = name or chunk.name
            data += chunk.data
            if len(data) > MAX_ARCHIVE_BYTES:
                message = f"an adapter archive is at most {MAX_ARCHIVE_BYTES} bytes"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if self._adapter_dir is None:
            message = "this site was started without --lora-dir: no adapters"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
            raise AssertionError("abort raises")
        target = received_dir(self._adapter_dir)
        try:
            await asyncio.to_thread(unpack, bytes(data), target)
        except ArchiveError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            await self._service.load_adapter(name, str(target))
        except AdapterRefused as exc:
            shutil.rmtree(target, ignore_errors=True)
            await context.abort(_ADAPTER_STATUS[exc.reason], str(exc))
        return site_pb2.AdapterList(adapters=self._service.served_adapters())

    async def UnloadAdapter(
        self, request: site_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.AdapterList:
        try:
            await self._service.unload_adapter(request.name)
        except AdapterRefused as exc:
            await context.abort(_ADAPTER_STATUS[exc.reason], str(exc))
        return site_pb2.AdapterList(adapters=self._service.served_adapters())

    async def Info(
        self, request: site_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.SiteInfo:
        limits = self._service.engine.limits
        ident = self._identity
        return site_pb2.SiteInfo(
            site_name=ident.site_name,
            model=ident.model_name,
            max_model_len=limits.max_model_len,
            vocab_size=ident.vocab_size,
            tokenizer_fingerprint=ident.tokenizer_fingerprint,
            device=ident.device,
            dtype=ident.dtype,
            kv_block_size=limits.kv_block_size,
            kv_blocks_total=limits.kv_blocks_total,
            max_num_seqs=limits.max_num_seqs,
            engine=limits.name,
            version=ident.version,
            prefix_caching=limits.prefix_caching,
            block_hash_scheme=HASH_SCHEME if limits.prefix_caching else "",
            host_kv_blocks=limits.host_kv_blocks,
            adapters=self._service.served_adapters(),
            accepts_fine_tuning=self._jobs is not None,
            fine_tuning_max_example_tokens=(
                self._jobs.longest_example if self._jobs is not None else 0
            ),
        )

    def load_report(self) -> site_pb2.LoadReport:
        stats = self._service.stats()
        cumulative_kv = self._service.cumulative_kv()
        self._report_sequence += 1
        return site_pb2.LoadReport(
            site_name=self._identity.site_name,
            timestamp_ms=int(time.time() * 1000),
            sequence=self._report_sequence,
            queued_requests=stats.num_waiting,
            running_requests=stats.num_running,
            queued_prompt_tokens=stats.queued_prompt_tokens,
            running_tokens=stats.running_tokens,
            predicted_remaining_tokens=stats.predicted_remaining_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            decode_tokens_per_s=self._service.decode_tokens_per_s(),
            prefill_tokens_per_s=self._service.prefill_tokens_per_s(),
            iterations=stats.iterations,
            kv_block_iterations=cumulative_kv.block_iterations,
            kv_token_iterations=cumulative_kv.token_iterations,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_host_hits=stats.prefix_cache_host_hits,
            by_class=[_class_load_to_proto(load) for load in stats.by_class],
            adapters_on_device=stats.adapters_on_device,
            adapters_in_host=stats.adapters_in_host,
            adapter_load_s=stats.adapter_load_s,
        )

    async def StreamLoad(
        self, request: site_pb2.LoadStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[site_pb2.LoadReport]:
        interval_s = max(request.interval_ms, 10) / 1000
        events = (
            CacheEventStream(self._service.cache_journal, self._service.cache_snapshot)
            if request.cache_events
            else None
        )
        while True:
            report = self.load_report()
            if events is not None:
                report.cache_events.CopyFrom(_cache_events_to_proto(await events.next_batch()))
            yield report
            await asyncio.sleep(interval_s)


async def start_server(
    servicer: site_pb2_grpc.SiteEngineServicer,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Starts serving; returns the server, its health servicer and the bound port.

    With `credentials` (site_engine/tls.py) the one port, health service included, speaks only
    TLS; without, only plaintext.
    """
    # No SO_REUSEPORT (gRPC sets it by default): a second server on a taken port would bind too
    # and the kernel would split connections between the two, so a gateway could reach another
    # site's engine (seen in CI: a test's site port reused by a bench's site serving another
    # model). A taken port fails the start instead.
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    site_pb2_grpc.add_SiteEngineServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, bound
