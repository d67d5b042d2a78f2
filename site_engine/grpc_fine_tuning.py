"""The site's fine-tuning RPCs (StartFineTune, GetFineTuneProgress, CancelFineTune,
ListFineTunes, GetFineTunedAdapter): the protobuf face of site_engine/finetune/jobs.py, mixed
into the site's servicer (grpc_server.py).

StartFineTune registers the job and answers at once, on the event loop, with no await between
the deadline's check and the registration: a start that arrives after its deadline (the gateway
has given up on it, and may send the job elsewhere) registers nothing, and one that registers is
answered. Its files are saved and read afterwards on a thread of the job's own, tenants' readings
in turns (issue 67, issue 75)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from fedllm_contract.fine_tuning import FineTuneProgress
from fedllm_contract.proto import site_pb2
from fedllm_contract.proto.fine_tuning import progress_to_proto, spec_from_proto
from site_engine.adapter_archive import chunks, pack
from site_engine.finetune import FineTuneRefused

if TYPE_CHECKING:
    from site_engine.finetune.jobs import FineTuneJobs

_FINE_TUNE_STATUS = {
    FineTuneRefused.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    FineTuneRefused.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    FineTuneRefused.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    FineTuneRefused.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
}


class FineTuneHandlers:
    _jobs: FineTuneJobs | None  # None: this site takes no fine-tuning jobs

    async def StartFineTune(
        self, request: site_pb2.FineTuneSpec, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneProgress:
        jobs = await self._fine_tune_jobs(context)
        try:
            spec = spec_from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fine-tuning job: {exc}")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the start of job {spec.job_id!r} arrived after its deadline: nothing started",
            )
        try:
            progress = jobs.start(spec)  # quick: the files are saved and read on another thread
        except FineTuneRefused as exc:
            await context.abort(_FINE_TUNE_STATUS[exc.code], str(exc))
        return progress_to_proto(progress)

    async def GetFineTuneProgress(
        self, request: site_pb2.FineTuneJobRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneProgress:
        return await self._fine_tune(context, lambda jobs: jobs.progress(request.job_id))

    async def CancelFineTune(
        self, request: site_pb2.FineTuneJobRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneProgress:
        return await self._fine_tune(context, lambda jobs: jobs.cancel(request.job_id))

    async def ListFineTunes(
        self, request: site_pb2.ListFineTunesRequest, context: grpc.aio.ServicerContext
    ) -> site_pb2.FineTuneJobIds:
        jobs = await self._fine_tune_jobs(context)
        return site_pb2.FineTuneJobIds(job_ids=jobs.live())

    async def GetFineTunedAdapter(
        self, request: site_pb2.FineTuneJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[site_pb2.DataChunk]:
        progress = await self._fine_tune(context, lambda jobs: jobs.progress(request.job_id))
        if progress.state != site_pb2.FINE_TUNE_STATE_SUCCEEDED or not progress.adapter_path:
            message = f"job {request.job_id!r} has not succeeded: no adapter yet"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        data = await asyncio.to_thread(pack, Path(progress.adapter_path))
        for piece in chunks(data):
            yield site_pb2.DataChunk(data=piece)

    async def _fine_tune(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[FineTuneJobs], FineTuneProgress],
    ) -> site_pb2.FineTuneProgress:
        jobs = await self._fine_tune_jobs(context)
        try:
            progress = await asyncio.to_thread(call, jobs)
        except FineTuneRefused as exc:
            await context.abort(_FINE_TUNE_STATUS[exc.code], str(exc))
        return progress_to_proto(progress)

    async def _fine_tune_jobs(self, context: grpc.aio.ServicerContext) -> FineTuneJobs:
        jobs = self._jobs
        if jobs is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this site takes no fine-tuning jobs (SITE_FINETUNE_RESERVE_BYTES is 0)",
            )
            raise AssertionError("abort raises")
        return jobs
