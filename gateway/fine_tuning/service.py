"""The fine-tuning API's operations: create, list, retrieve, cancel, events and checkpoints,
each scoped to the caller's key (another key's job is the 404 of an unknown one).

A job is created only whole: its model a base model that a site serving it trains jobs of, its
files the caller's own of purpose `fine-tune`, within GATEWAY_FINE_TUNING_MAX_FILE_BYTES, each a
valid chat training file (every bad line named: gateway/fine_tuning/training_file.py), and its
key within its training limits (gateway/fine_tuning/limits.py). Then it is queued, and the runner
(gateway/fine_tuning/runner.py) hands it to a site.
"""

from __future__ import annotations

import logging
import random
import re
import uuid
from collections.abc import Collection

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admin.adapters import AdapterAdmin
from gateway.batch_settings import FineTuningSettings
from gateway.db.models import FineTuningStatus
from gateway.errors import GatewayError, NotFound, invalid_request
from gateway.files.service import file_too_large
from gateway.fine_tuning.limits import TrainingLimits, estimated_tokens, window_start
from gateway.fine_tuning.request import JobCreateRequest, resolve
from gateway.fine_tuning.runner import FineTuningRunner
from gateway.fine_tuning.training_file import read_training_file
from gateway.metrics import GatewayMetrics
from gateway.model_catalogue import AdapterCatalogue
from gateway.sites.interface import SiteCallError
from gateway.sites.registry import SiteRegistry
from gateway.stores.file_store import FINE_TUNE_PURPOSE, FileStore, FileView
from gateway.stores.fine_tuning_store import (
    CheckpointView,
    EventView,
    FineTuningStore,
    JobUse,
    JobView,
    NewJob,
)
from gateway.stores.pages import Owner, Page
from gateway.tenancy.keys import KeyRecord
from gateway.tokenize_pool import TokenizePool

log = logging.getLogger(__name__)

JOB_PREFIX = "ftjob-"
MAX_PAGE = 100
# What an id of this API can be (a job's, an event's, a checkpoint's): anything else names
# nothing, and is answered so without a query (a NUL, say, PostgreSQL would refuse).
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_after(after: str | None) -> None:
    if after is not None and not _ID.fullmatch(after):
        raise invalid_request(f"after: no such id '{after[:64]}'", param="after")


def job_not_found(job_id: str) -> GatewayError:
    return NotFound(
        f"No such fine-tuning job: {job_id}",
        param="fine_tuning_job_id",
        code="fine_tuning_job_not_found",
    )


class FineTuningService:
    def __init__(
        self,
        store: FineTuningStore,
        files: FileStore,
        runner: FineTuningRunner,
        base_models: Collection[str],
        settings: FineTuningSettings,
        pool: TokenizePool,
    ) -> None:
        self.store = store
        self._files = files
        self.runner = runner
        self._bases = frozenset(base_models)
        self._max_file_bytes = settings.max_file_bytes
        self._limits = TrainingLimits(settings.jobs_per_key, settings.tokens_per_key_day)
        self._pool = pool

    @classmethod
    def build(
        cls,
        sessions: async_sessionmaker[AsyncSession],
        registry: SiteRegistry,
        catalogue: AdapterCatalogue,
        adapters: AdapterAdmin,
        metrics: GatewayMetrics,
        base_models: Collection[str],
        settings: FineTuningSettings,
        pool: TokenizePool,
    ) -> FineTuningService:
        store, files = FineTuningStore(sessions), FileStore(sessions)
        runner = FineTuningRunner(
            store,
            files,
            registry,
            catalogue,
            adapters,
            metrics,
            settings.poll_s,
            settings.start_timeout_s,
        )
        return cls(store, files, runner, base_models, settings, pool)

    async def create(
        self, request: JobCreateRequest, owner: Owner, key: KeyRecord | None
    ) -> JobView:
        """The job, queued; 400 and nothing made for a model no site trains, a file that is
        not the caller's fine-tune file, a file past GATEWAY_FINE_TUNING_MAX_FILE_BYTES or a
        bad line in either file; 429 for a key at its training limits (limits.py)."""
        self._check_model(request.model)
        training_view = await self._file(request.training_file, owner, "training_file")
        validation_view = None
        if request.validation_file is not None:
            validation_view = await self._file(request.validation_file, owner, "validation_file")
        size = training_view.bytes + (validation_view.bytes if validation_view else 0)
        if size > self._max_file_bytes:
            param = (
                "validation_file"
                if training_view.bytes <= self._max_file_bytes
                else "training_file"
            )
            raise file_too_large(param, size, self._max_file_bytes)
        who = f"API key {key.prefix}... ('{key.name}')" if key is not None else "this caller"
        tokens_per_minute = key.tokens_per_minute if key is not None else None
        epochs = resolve(request.hyperparameters, 1).n_epochs  # epochs depend on no example
        wanted = estimated_tokens(training_view.bytes, epochs)

        def admit(uses: list[JobUse]) -> None:
            self._limits.check(who, tokens_per_minute, uses, wanted)

        # Refused before the files are read and parsed, and again as the job is written.
        admit(await self.store.uses(owner, window_start()))
        training = await self._content(request.training_file, owner, "training_file")
        examples = (await read_training_file(self._pool, training, "training_file")).examples
        if request.validation_file is not None:
            validation = await self._content(request.validation_file, owner, "validation_file")
            await read_training_file(self._pool, validation, "validation_file")
        hyper = resolve(request.hyperparameters, examples)
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        new = NewJob(
            f"{JOB_PREFIX}{uuid.uuid4().hex[:24]}",
            owner,
            key.name if key is not None else None,
            request.model,
            request.training_file,
            request.validation_file,
            request.suffix,
            seed,
            hyper.n_epochs,
            hyper.batch_size,
            hyper.learning_rate_multiplier,
        )
        job = await self.store.create(new, admit, window_start())
        if job is None:  # a file deleted while it was checked
            raise invalid_request(
                "the training or validation file was deleted meanwhile",
                param="training_file",
                code="file_not_found",
            )
        log.info("fine-tuning job %s created for %s (%d examples)", job.id, job.model, examples)
        self.runner.wake()
        return job

    def _check_model(self, model: str) -> None:
        if model not in self._bases:
            raise invalid_request(
                f"model {model!r} is not a base model served here: fine-tuning starts from one "
                f"of {', '.join(sorted(self._bases)) or 'none'}",
                param="model",
                code="model_not_found",
            )
        if not self.runner.training_sites(model):
            raise invalid_request(
                f"no site serving {model!r} accepts fine-tuning jobs",
                param="model",
                code="model_not_available",
            )

    async def _file(self, file_id: str, owner: Owner, param: str) -> FileView:
        view = await self._files.get(file_id, owner)
        if view is None:
            raise _no_file(file_id, param)
        if view.purpose != FINE_TUNE_PURPOSE:
            raise invalid_request(
                f"{param}: file {file_id} has purpose {view.purpose!r}; upload training data "
                f"with purpose {FINE_TUNE_PURPOSE!r}",
                param=param,
                code="invalid_file_purpose",
            )
        return view

    async def _content(self, file_id: str, owner: Owner, param: str) -> bytes:
        content = await self._files.content(file_id, owner)
        if content is None:
            raise _no_file(file_id, param)  # deleted since it was looked at
        return content

    async def get(self, job_id: str, owner: Owner) -> JobView:
        job = await self.store.get(job_id, owner) if _ID.fullmatch(job_id) else None
        if job is None:
            raise job_not_found(job_id)
        return job

    async def list_jobs(self, owner: Owner, after: str | None, limit: int) -> Page[JobView]:
        _check_limit(limit)
        _check_after(after)
        page = await self.store.list_jobs(owner, after, limit)
        if page is None:
            raise invalid_request(f"after: no fine-tuning job with id '{after}'", param="after")
        return page

    async def events(
        self, job_id: str, owner: Owner, after: str | None, limit: int
    ) -> Page[EventView]:
        _check_limit(limit)
        _check_after(after)
        await self.get(job_id, owner)
        return await self.store.events(job_id, after, limit)

    async def checkpoints(
        self, job_id: str, owner: Owner, after: str | None, limit: int
    ) -> Page[CheckpointView]:
        _check_limit(limit)
        _check_after(after)
        await self.get(job_id, owner)
        return await self.store.checkpoints(job_id, after, limit)

    async def cancel(self, job_id: str, owner: Owner) -> JobView:
        """Cancels the job at its site (if one has it) and here; 400 for a final job, which
        never changes again."""
        job = await self.get(job_id, owner)
        if job.status.is_final:
            raise invalid_request(
                f"fine-tuning job {job_id} is {job.status.value} already; a "
                "finished job cannot be cancelled",
                param="fine_tuning_job_id",
                code="job_not_cancellable",
            )
        message = "Fine-tuning job cancelled"
        if job.site is not None:
            try:
                await self.runner.cancel_at_site(job)
            except SiteCallError as exc:
                # Cancelled here all the same: the runner never asks after it again, and its
                # adapter is never served.
                message += f" (site {job.site} could not be told: {exc.detail})"
        await self.store.finish(job_id, FineTuningStatus.CANCELLED, message)
        return await self.get(job_id, owner)


def _no_file(file_id: str, param: str) -> GatewayError:
    return invalid_request(f"{param}: no such file: {file_id}", param=param, code="file_not_found")


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise invalid_request(f"limit must be in 1..{MAX_PAGE}", param="limit")
