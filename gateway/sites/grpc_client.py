"""The gateway's gRPC adapter to one of this project's site engines: the first implementation of
SiteClient (gateway/sites/interface.py). Typed calls in, typed results out: protobuf types do
not leave this module, and gRPC failures become the interface's exceptions."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedllm_contract.cache_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
    Tier,
)
from fedllm_contract.fine_tuning import FineTuneProgress, FineTuneSpec
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.proto.fine_tuning import progress_from_proto, spec_to_proto
from fedllm_contract.proto.options import options_to_proto, priority_from_proto
from gateway.federation import ModelTask
from gateway.sites.grpc_generate_stream import ChunkPacer, GenerateStreams
from gateway.sites.interface import (
    ALL_CAPABILITIES,
    AdapterChangeRefused,
    ClassLoadView,
    EmbedParams,
    EmbedResult,
    FineTuneCallRefused,
    GenerateParams,
    HealthAnswer,
    KvLease,
    KvLeaseLost,
    LoadView,
    SiteBusy,
    SiteCallError,
    SiteChunk,
    SiteFailed,
    SiteInfoView,
    SiteRejected,
    SiteTimedOut,
    SiteUnavailable,
)
from gateway.sites.tls import SiteTls, open_channel

HEALTH_SERVICE = "fedllm.site.v1.SiteEngine"

_TASK_FROM_PROTO: dict[int, ModelTask] = {
    site_pb2.MODEL_TASK_GENERATE: "generate",
    site_pb2.MODEL_TASK_EMBED: "embed",
}
_TIER_FROM_PROTO = {
    site_pb2.CACHE_TIER_DEVICE: Tier.DEVICE,
    site_pb2.CACHE_TIER_HOST: Tier.HOST,
}
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # An Embed answer of 2,048 inputs of 1,024 dimensions is 8 MiB of float32, past gRPC's 4 MiB
    # default.
    ("grpc.max_receive_message_length", 64 << 20),
)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}
_ADAPTER_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.ALREADY_EXISTS: "exists",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "busy",
}
# Health checks, Info and load reports travel on a connection of their own (a local subchannel
# pool keeps gRPC from sharing the generation channel's TCP connection): on the one HTTP/2
# connection of thousands of generation streams, their small answers waited behind those
# streams' data for the connection's flow-control window and stream slots, and an overloaded
# site looked dead to the gateway.
_CONTROL_CHANNEL_OPTIONS = (*_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
_FINE_TUNE_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.ALREADY_EXISTS: "exists",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "precondition",
}
# Starting a job carries its files (64 MiB at most) to the site, which registers the job and
# answers; it reads the files afterwards (issue 67), so this bounds the transfer only.
_FINE_TUNE_TIMEOUT_S = 120.0
# Loading reads and checks the adapter's weights at the site: seconds for a large one.
_ADAPTER_CHANGE_TIMEOUT_S = 120.0
# A lending resizes the site's KV cache between two of its steps and, with CUDA graphs captured
# at start, captures them again: seconds on a large model.
_KV_LENDING_TIMEOUT_S = 120.0
# A message of an adapter sent whole (LoadAdapterArchive), under gRPC's 4 MiB default.
_ARCHIVE_CHUNK_BYTES = 1 << 20


def _to_proto(params: GenerateParams) -> site_pb2.GenerateRequest:
    request = site_pb2.GenerateRequest(
        request_id=params.request_id,
        prompt_token_ids=params.prompt_token_ids,
        sampling=site_pb2.SamplingParams(
            max_tokens=params.max_tokens, generated_before=params.generated_before
        ),
        predicted_tokens=params.predicted_tokens or 0,
        cache_salt=params.cache_salt,
    )
    options_to_proto(params.options, request)
    return request


def _cache_event_from_proto(event: site_pb2.CacheEvent) -> CacheEvent | None:
    """None for a kind or tier this gateway does not know (an index must never learn a block
    from an event it cannot read)."""
    tier = _TIER_FROM_PROTO.get(event.tier)
    if tier is None:
        return None
    if event.kind == site_pb2.CacheEvent.STORED:
        return BlocksStored(tuple(event.block_hashes), event.parent_block_hash, tier)
    if event.kind == site_pb2.CacheEvent.REMOVED:
        return BlocksRemoved(tuple(event.block_hashes), tier)
    if event.kind == site_pb2.CacheEvent.CLEARED:
        return AllBlocksCleared()
    return None


def _cache_events_from_proto(message: site_pb2.CacheEvents) -> CacheEventBatch:
    """Typed events, dropping those _cache_event_from_proto cannot read."""
    events = (_cache_event_from_proto(event) for event in message.events)
    return CacheEventBatch(
        epoch=message.epoch,
        block_size=message.block_size,
        sequence=message.sequence,
        events=tuple(event for event in events if event is not None),
        snapshot=message.snapshot,
    )


def _class_loads_from_proto(report: site_pb2.LoadReport) -> tuple[ClassLoadView, ...]:
    """Typed per-class entries, dropping those of a class this gateway does not know."""
    loads = []
    for entry in report.by_class:
        priority = priority_from_proto(entry.priority)
        if priority is None:
            continue
        loads.append(
            ClassLoadView(
                priority=priority,
                queued_requests=entry.queued_requests,
                running_requests=entry.running_requests,
                queued_prompt_tokens=entry.queued_prompt_tokens,
                running_tokens=entry.running_tokens,
                predicted_remaining_tokens=entry.predicted_remaining_tokens,
            )
        )
    return tuple(loads)


def _load_from_proto(report: site_pb2.LoadReport) -> LoadView:
    return LoadView(
        queued_requests=report.queued_requests,
        running_requests=report.running_requests,
        queued_prompt_tokens=report.queued_prompt_tokens,
        running_tokens=report.running_tokens,
        predicted_remaining_tokens=report.predicted_remaining_tokens,
        kv_blocks_used=report.kv_blocks_used,
        kv_blocks_total=report.kv_blocks_total,
        decode_tokens_per_s=report.decode_tokens_per_s,
        iterations=report.iterations,
        sequence=report.sequence,
        kv_block_iterations=report.kv_block_iterations,
        kv_token_iterations=report.kv_token_iterations,
        prefix_cache_queries=report.prefix_cache_queries,
        prefix_cache_hits=report.prefix_cache_hits,
        prefix_cache_host_hits=report.prefix_cache_host_hits,
        prefill_tokens_per_s=report.prefill_tokens_per_s,
        by_class=_class_loads_from_proto(report),
        adapters_on_device=tuple(report.adapters_on_device),
        adapters_in_host=tuple(report.adapters_in_host),
        adapter_load_s=report.adapter_load_s,
        cache_events=(
            _cache_events_from_proto(report.cache_events)
            if report.HasField("cache_events")
            else None
        ),
    )


class GrpcSiteClient:
    """A site engine of this project, over gRPC (fedllm_contract/proto/site.proto)."""

    can_release_queued = True
    capabilities = ALL_CAPABILITIES

    def __init__(
        self,
        name: str,
        endpoint: str,
        connect_timeout_s: float,
        tls: SiteTls | None = None,
        tls_server_name: str | None = None,
        pacer: ChunkPacer | None = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self._timeout = connect_timeout_s
        # A site that restarts must be seen again within a health interval: gRPC's default
        # reconnect backoff grows to minutes, and calls fail at once while it waits. One
        # channel (TLS or not) carries generation and offload calls, the other (its own
        # connection) health checks, Info and load reports.
        # gRPC core takes min_reconnect_backoff_ms as the floor of each connection attempt's
        # deadline (TCP, TLS and the HTTP/2 SETTINGS frame), not of the wait between attempts.
        # At 200 ms, a site across a wide-area link, or one busy for a moment, failed every call
        # made while its connection opened; a site that is down still refuses at once.
        attempt = (("grpc.min_reconnect_backoff_ms", max(200, int(connect_timeout_s * 1000))),)
        self._channel = open_channel(endpoint, tls, (*_CHANNEL_OPTIONS, *attempt), tls_server_name)
        self._stub = site_pb2_grpc.SiteEngineStub(self._channel)
        self._generation = GenerateStreams(self._stub, self._status_error, pacer)
        self._control_channel = open_channel(
            endpoint, tls, (*_CONTROL_CHANNEL_OPTIONS, *attempt), tls_server_name
        )
        self._control = site_pb2_grpc.SiteEngineStub(self._control_channel)
        self._health = health_pb2_grpc.HealthStub(self._control_channel)

    def _error(self, exc: grpc.aio.AioRpcError, accepted: bool = False) -> SiteCallError:
        return self._status_error(exc.code(), exc.details() or exc.code().name, accepted)

    def _status_error(self, code: grpc.StatusCode, detail: str, accepted: bool) -> SiteCallError:
        detail = detail or code.name
        if code in _REJECTED:
            return SiteRejected(self.name, detail)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not accepted:
            return SiteBusy(self.name, detail)
        if code in _RETRYABLE and not accepted:
            return SiteUnavailable(self.name, detail)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if not accepted:
                return SiteUnavailable(self.name, "did not answer in time")
            return SiteTimedOut(self.name, "the request's deadline passed")
        return SiteFailed(self.name, f"{code.name}: {detail}")

    async def check_health(self) -> HealthAnswer:
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            # UNAVAILABLE: the connection was refused, reset or its TLS refused (a killed site
            # fails this way at once), except a connect() that timed out (a host too busy to
            # accept in time says so the same way). Anything else, a deadline above all, is no
            # answer yet.
            detail = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "timed out" not in detail.lower():
                return HealthAnswer.REFUSED
            return HealthAnswer.NO_ANSWER
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            # Health travels on its own connection, so a serving site's generation connection
            # is opened here, not by the first request: that request would pay the handshake,
            # and a site that stalls before it (or is briefly too busy to answer it) would look
            # dead to dispatch while its health says it serves.
            self._channel.get_state(try_to_connect=True)
            return HealthAnswer.SERVING
        return HealthAnswer.NOT_SERVING

    async def info(self) -> SiteInfoView:
        try:
            info = await self._control.Info(site_pb2.InfoRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        return SiteInfoView(
            site_name=info.site_name,
            model=info.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            device=info.device,
            dtype=info.dtype,
            kv_block_size=info.kv_block_size,
            kv_blocks_total=info.kv_blocks_total,
            max_num_seqs=info.max_num_seqs,
            engine=info.engine,
            version=info.version,
            prefix_caching=info.prefix_caching,
            block_hash_scheme=info.block_hash_scheme,
            host_kv_blocks=info.host_kv_blocks,
            task=self._task(info.task),
            embedding_dimension=info.embedding_dimension,
            adapters=tuple(info.adapters),
            accepts_fine_tuning=info.accepts_fine_tuning,
            fine_tuning_max_example_tokens=info.fine_tuning_max_example_tokens,
        )

    async def load_adapter(self, name: str, path: str) -> tuple[str, ...]:
        request = site_pb2.LoadAdapterRequest(name=name, path=path)
        try:
            answer = await self._stub.LoadAdapter(request, timeout=_ADAPTER_CHANGE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise self._adapter_error(exc) from exc
        return tuple(answer.adapters)

    async def unload_adapter(self, name: str) -> tuple[str, ...]:
        request = site_pb2.UnloadAdapterRequest(name=name)
        try:
            answer = await self._stub.UnloadAdapter(request, timeout=_ADAPTER_CHANGE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise self._adapter_error(exc) from exc
        return tuple(answer.adapters)

    # ---- idle memory first (KvLendingSite) -------------------------------------------------
    async def kv_room(self) -> int:
        return await self._kv_call(self._stub.KvRoom, site_pb2.KvRoomRequest())

    async def lend_kv(self, wanted_bytes: int, lease: KvLease) -> int:
        request = site_pb2.LendKvRequest(
            bytes=wanted_bytes, lease_id=lease.id, lease_ttl_ms=round(lease.ttl_s * 1000)
        )
        return await self._kv_call(self._stub.LendKv, request)

    async def return_kv(self, lease_id: str) -> int:
        return await self._kv_call(self._stub.ReturnKv, site_pb2.ReturnKvRequest(lease_id=lease_id))

    async def renew_kv_lease(self, lease: KvLease) -> int:
        request = site_pb2.RenewKvLeaseRequest(
            lease_id=lease.id, lease_ttl_ms=round(lease.ttl_s * 1000)
        )
        try:
            answer = await self._stub.RenewKvLease(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise KvLeaseLost(self.name, exc.details() or "no such lease") from exc
            raise self._error(exc) from exc
        return int(answer.bytes)

    async def _kv_call(self, method: Any, request: Any) -> int:
        try:
            answer = await method(request, timeout=_KV_LENDING_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        return int(answer.bytes)

    async def load_adapter_archive(self, name: str, archive: bytes) -> tuple[str, ...]:
        async def messages() -> AsyncGenerator[site_pb2.AdapterArchiveChunk, None]:
            yield site_pb2.AdapterArchiveChunk(name=name)
            for start in range(0, len(archive), _ARCHIVE_CHUNK_BYTES):
                data = archive[start : start + _ARCHIVE_CHUNK_BYTES]
                yield site_pb2.AdapterArchiveChunk(data=data)

        try:
            answer = await self._stub.LoadAdapterArchive(
                messages(), timeout=_ADAPTER_CHANGE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise self._adapter_error(exc) from exc
        return tuple(answer.adapters)

    async def fine_tuned_adapter(self, job_id: str) -> bytes:
        request = site_pb2.FineTuneJobRequest(job_id=job_id)
        call = self._stub.GetFineTunedAdapter(request, timeout=_ADAPTER_CHANGE_TIMEOUT_S)
        data = bytearray()
        try:
            async for chunk in call:
                data += chunk.data
        except grpc.aio.AioRpcError as exc:
            raise self._fine_tune_error(exc) from exc
        return bytes(data)

    async def start_fine_tune(self, spec: FineTuneSpec) -> FineTuneProgress:
        call = self._stub.StartFineTune(spec_to_proto(spec), timeout=_FINE_TUNE_TIMEOUT_S)
        try:
            return await self._fine_tune(call)
        except SiteBusy as exc:
            # The site's handler never answers RESOURCE_EXHAUSTED: gRPC does, for a message past
            # the site's receive limit. Sending it again would fail the same way, for ever.
            raise FineTuneCallRefused(self.name, str(exc), "too_large") from exc
        except FineTuneCallRefused as exc:
            if exc.reason != "exists":
                raise
        # The gateway sends a start again when the answer to the first was lost: the job the
        # site already has is the one asked for (job ids are the gateway's own).
        return await self.fine_tune_progress(spec.job_id)

    async def fine_tune_progress(self, job_id: str) -> FineTuneProgress:
        request = site_pb2.FineTuneJobRequest(job_id=job_id)
        return await self._fine_tune(self._stub.GetFineTuneProgress(request, timeout=self._timeout))

    async def cancel_fine_tune(self, job_id: str) -> FineTuneProgress:
        request = site_pb2.FineTuneJobRequest(job_id=job_id)
        return await self._fine_tune(self._stub.CancelFineTune(request, timeout=self._timeout))

    async def live_fine_tunes(self) -> list[str]:
        call = self._stub.ListFineTunes(site_pb2.ListFineTunesRequest(), timeout=self._timeout)
        try:
            answer = await call
        except grpc.aio.AioRpcError as exc:
            raise self._fine_tune_error(exc) from exc
        return list(answer.job_ids)

    async def _fine_tune(
        self, call: grpc.aio.UnaryUnaryCall[Any, site_pb2.FineTuneProgress]
    ) -> FineTuneProgress:
        try:
            answer = await call
        except grpc.aio.AioRpcError as exc:
            raise self._fine_tune_error(exc) from exc
        try:
            return progress_from_proto(answer)
        except ValueError as exc:
            raise SiteFailed(self.name, str(exc)) from exc

    def _fine_tune_error(self, exc: grpc.aio.AioRpcError) -> SiteCallError:
        reason = _FINE_TUNE_REFUSALS.get(exc.code())
        if reason is None:
            return self._error(exc)
        return FineTuneCallRefused(self.name, exc.details() or exc.code().name, reason)

    def _adapter_error(self, exc: grpc.aio.AioRpcError) -> SiteCallError:
        reason = _ADAPTER_REFUSALS.get(exc.code())
        if reason is None:
            return self._error(exc)
        return AdapterChangeRefused(self.name, exc.details() or exc.code().name, reason)

    def _task(self, task: int) -> ModelTask:
        known = _TASK_FROM_PROTO.get(task)
        if known is None:  # a newer site's task: nothing this gateway sends it would be right
            raise SiteUnavailable(self.name, f"its model's task ({task}) is unknown to the gateway")
        return known

    def generate(self, params: GenerateParams, timeout_s: float) -> AsyncGenerator[SiteChunk, None]:
        """Streams the site's chunks, on the site's one GenerateStream call
        (grpc_generate_stream.py); closing the iterator early cancels it at the site."""
        return self._generation.generate(_to_proto(params), params.options.n, timeout_s)

    async def embed(self, params: EmbedParams, timeout_s: float) -> EmbedResult:
        request = site_pb2.EmbedRequest(
            request_id=params.request_id,
            inputs=[site_pb2.EmbedInput(token_ids=ids) for ids in params.inputs],
            dimensions=params.dimensions or 0,
        )
        try:
            # Not retried by gRPC: a call the site may have taken is the dispatcher's to move.
            response = await self._stub.Embed(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise SiteTimedOut(self.name, "the request's deadline passed") from exc
            raise self._error(exc) from exc
        vectors = tuple(embedding.float32_le for embedding in response.embeddings)
        if len(vectors) != len(params.inputs):
            raise SiteFailed(
                self.name, f"answered {len(vectors)} embeddings for {len(params.inputs)} inputs"
            )
        return EmbedResult(vectors, response.prompt_tokens)

    async def cancel(self, request_id: str) -> bool:
        try:
            response = await self._stub.Cancel(
                site_pb2.CancelRequest(request_id=request_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        return bool(response.cancelled)

    async def load_reports(
        self, interval_ms: int, cache_events: bool = False
    ) -> AsyncGenerator[LoadView, None]:
        """The site's load report stream; raises SiteUnavailable when it breaks."""
        call = self._control.StreamLoad(
            site_pb2.LoadStreamRequest(interval_ms=interval_ms, cache_events=cache_events)
        )
        try:
            async for report in call:
                yield _load_from_proto(report)
        except grpc.aio.AioRpcError as exc:
            raise SiteUnavailable(self.name, f"load report stream: {exc.code().name}") from exc
        finally:
            call.cancel()

    async def release_queued(self, max_requests: int) -> list[str]:
        """Asks the site to hand back up to max_requests queued, not-started requests."""
        try:
            response = await self._stub.ReleaseQueued(
                site_pb2.ReleaseQueuedRequest(max_requests=max_requests), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        return [released.request_id for released in response.released]

    async def close(self) -> None:
        await self._generation.close()
        await self._channel.close()
        await self._control_channel.close()
