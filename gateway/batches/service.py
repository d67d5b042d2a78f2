"""The batch API's operations: submit (validate every item, then store the batch whole), read,
list, results and cancel, each scoped to the caller's key. Running batches is the runner's job
(gateway/batches/runner.py).

A batch is submitted in OpenAI's form (an uploaded JSONL file, its endpoint and completion
window) or inline (the model and the requests themselves). Either way every item is validated
by its endpoint's own preparation (gateway/batches/items.py), tokenizing on the tokenize pool.
An item its endpoint refuses (bad parameters, too long for the context) is stored failed with
that endpoint's error, as OpenAI does: that line's entry in the error file. A malformed batch
(or a line that is not a request of the batch's endpoint and model) is refused whole, nothing
written, the error naming the item (`requests[i]`, or the line of the file).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batches.finalize import BatchFinalizer
from gateway.batches.item_runner import StatusOf
from gateway.batches.items import Entry, ItemPreparer, file_entries, inline_entries, slices
from gateway.batches.leases import BatchLeases
from gateway.batches.progress import estimate
from gateway.batches.records import BatchView, ItemView, NewBatch, NewItem, Owner, Page
from gateway.batches.request import COMPLETIONS, BatchCreateRequest, window_hours
from gateway.batches.runner import BatchRunner
from gateway.batches.store import BatchStore
from gateway.chat.service import ChatService
from gateway.db.models import BatchStatus, utcnow
from gateway.errors import (
    Conflict,
    GatewayError,
    NotFound,
    invalid_request,
    service_unavailable,
)
from gateway.files.batch_input import ENDPOINTS, parse_lines
from gateway.files.service import FileService, file_not_found
from gateway.request_path.service import CompletionService
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.file_store import UPLOAD_PURPOSE
from gateway.tenancy.admission import Tenancy
from gateway.tokenize_pool import TokenizePool

MAX_BATCH_PAGE, MAX_RESULT_PAGE = 100, 1000
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
Admit = Callable[[Sequence[tuple[int, int]]], Awaitable[None]]


def not_found(batch_id: str) -> GatewayError:
    return NotFound(f"No batch found with id '{batch_id}'", code="batch_not_found")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(
            f"metadata takes at most {MAX_METADATA_PAIRS} pairs", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise invalid_request(
                f"metadata keys take at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE} (key '{key[:MAX_METADATA_KEY]}')",
                param="metadata",
            )


def check_limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise invalid_request(f"limit must be in 1..{most}", param="limit")


def _only(request: BatchCreateRequest, form: str, fields: tuple[str, ...]) -> None:
    for name in fields:
        if getattr(request, name) is not None:
            raise invalid_request(
                f"'{name}' is not part of a batch {form}: send input_file_id, endpoint and "
                "completion_window (OpenAI's form), or model and requests (inline)",
                param=name,
            )


class BatchService:
    @classmethod
    def build(
        cls,
        settings: GatewaySettings,
        sessions: async_sessionmaker[AsyncSession],
        completions: CompletionService,
        chat: ChatService,
        registry: SiteRegistry,
        files: FileService,
        pool: TokenizePool,
        status_of: StatusOf,
        tenancy: Tenancy,
    ) -> BatchService:
        store = BatchStore(sessions)
        preparer = ItemPreparer(completions, chat, status_of)
        runner = BatchRunner(
            settings,
            store,
            BatchLeases(sessions),
            completions,
            registry,
            preparer=preparer,
            pool=pool,
            finalizer=BatchFinalizer(sessions),
            status_of=status_of,
            tenancy=tenancy,
        )
        return cls(settings, store, runner, preparer, files, pool)

    def __init__(
        self,
        settings: GatewaySettings,
        store: BatchStore,
        runner: BatchRunner,
        preparer: ItemPreparer,
        files: FileService,
        pool: TokenizePool,
    ) -> None:
        self._settings = settings
        self._store = store
        self.runner = runner
        self._preparer = preparer
        self._files = files
        self._pool = pool

    async def submit(
        self,
        request: BatchCreateRequest,
        owner: Owner,
        admit: Admit | None = None,
        key_name: str | None = None,
    ) -> BatchView:
        """Validates every item first (4xx naming the first bad one), then needs a healthy site
        serving the model (503) and `admit` to take the items' (prompt tokens, max_tokens)
        against the caller's limits (429); nothing is written unless the batch is accepted."""
        _check_metadata(request.metadata)
        hours = window_hours(request.completion_window)
        if request.input_file_id is not None:
            _only(request, "made from a file", ("model", "requests"))
            endpoint, model, entries = await self._file_entries(request, owner, hours)
        elif request.requests is not None:
            _only(request, "sent inline", ("input_file_id",))
            endpoint, model, entries = await self._inline_entries(request)
        else:
            raise invalid_request(
                "send input_file_id (an uploaded JSONL file of purpose 'batch'), endpoint and "
                "completion_window; or, inline, model and requests",
                param="input_file_id",
            )
        # Another key's LoRA adapter is a model that does not exist (`key_name`: the caller's).
        self._preparer.requests.check_model_owner(model, owner, key_name)
        items = await self._validate(endpoint, model, entries)
        runnable = [item for item in items if item.error is None]
        if runnable and not self._preparer.requests.servable_now(model):
            # As /v1/completions answers: retry later, rather than a batch that waits unseen.
            raise service_unavailable(f"no site can serve model '{model}' now")
        if admit is not None:
            await admit([(item.prompt_tokens, item.max_tokens) for item in runnable])
        now = utcnow()
        new = NewBatch(
            id=f"batch_{uuid.uuid4().hex}",
            owner=owner,
            model=model,
            endpoint=endpoint,
            metadata=request.metadata,
            input_file_id=request.input_file_id,
            completion_window=request.completion_window,
            expires_at=now + timedelta(hours=hours) if hours is not None else None,
            created_at=now,
        )
        batch = await self._store.create(new, items)
        if batch is None:  # the file was deleted while its requests were being validated
            raise file_not_found(request.input_file_id or "")
        self.runner.wake()
        return batch

    async def _file_entries(
        self, request: BatchCreateRequest, owner: Owner, hours: int | None
    ) -> tuple[str, str, list[Entry]]:
        file_id = request.input_file_id or ""
        endpoint = request.endpoint
        if endpoint not in ENDPOINTS:
            raise invalid_request(
                f"endpoint must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})",
                param="endpoint",
            )
        if hours is None:
            raise invalid_request(
                "completion_window is required with input_file_id, e.g. '24h'",
                param="completion_window",
            )
        found = await self._files.store.get(file_id, owner)
        if found is None:
            raise file_not_found(file_id)
        if found.purpose != UPLOAD_PURPOSE:
            raise invalid_request(
                f"file {file_id} has purpose '{found.purpose}'; a batch reads a file uploaded "
                "with purpose 'batch'",
                param="input_file_id",
            )
        content = await self._files.store.content(file_id, owner)
        if content is None:
            raise file_not_found(file_id)
        settings = self._settings
        parse = partial(
            parse_lines,
            max_lines=settings.batches.max_items,
            max_line_bytes=settings.limits.max_body_bytes,
            param="input_file_id",
        )
        lines = await self._pool.run(parse, content)
        model, entries = await self._pool.run(
            partial(file_entries, file_id, endpoint=endpoint), lines
        )
        return endpoint, model, entries

    async def _inline_entries(self, request: BatchCreateRequest) -> tuple[str, str, list[Entry]]:
        requests = request.requests or []
        count, limit = len(requests), self._settings.batches.max_items
        if request.model is None:
            raise invalid_request("model is required with requests", param="model")
        if request.endpoint not in (None, COMPLETIONS):
            raise invalid_request(
                f"an inline batch's requests are of {COMPLETIONS}; to batch another endpoint "
                "upload a file (POST /v1/files) and send its input_file_id",
                param="endpoint",
            )
        if count == 0:
            raise invalid_request("a batch needs at least one request", param="requests")
        if count > limit:
            raise invalid_request(
                f"this batch has {count} requests; this gateway takes at most {limit} per batch",
                param="requests",
                code="batch_too_large",
            )
        max_item = self._settings.limits.max_body_bytes
        entries = await self._pool.run(partial(inline_entries, max_item_bytes=max_item), requests)
        return COMPLETIONS, request.model, entries

    async def _validate(self, endpoint: str, model: str, entries: list[Entry]) -> list[NewItem]:
        """Every entry prepared as its endpoint would, a bounded slice per turn of the pool.
        Takes `entries` (empties it): each slice is let go once its items are made, so a large
        batch's bodies are held once, not as entries and items both."""
        parts = slices(entries)
        entries.clear()
        items: list[NewItem] = []
        for number, part in enumerate(parts):
            items.extend(
                await self._pool.run(partial(self._preparer.validate, endpoint, model), part)
            )
            parts[number] = []
        return items

    async def get(self, batch_id: str, owner: Owner) -> BatchView:
        batch = await self._store.get(batch_id, owner)
        if batch is None:
            raise not_found(batch_id)
        return (await self.with_usage([batch]))[0]

    async def with_usage(self, batches: list[BatchView]) -> list[BatchView]:
        """The batches with the tokens their answered items took (OpenAI's batch usage) and
        their progress by planned tokens, with an estimate of the time left."""
        ids = [batch.id for batch in batches]
        usage = await self._store.usage(ids)
        work = await self._store.planned_work(ids)
        now = utcnow()
        out = []
        for b in batches:
            progress = None
            if b.id in work:
                progress = estimate(*work[b.id], b.in_progress_at, now)
            out.append(replace(b, usage=usage.get(b.id, b.usage), progress=progress))
        return out

    async def list_batches(self, owner: Owner, after: str | None, limit: int) -> Page[BatchView]:
        check_limit(limit, MAX_BATCH_PAGE)
        page = await self._store.list_batches(owner, after, limit)
        if page is None:
            raise invalid_request(f"after: no batch with id '{after}'", param="after")
        return replace(page, data=await self.with_usage(list(page.data)))

    async def open_batches(self, limit: int) -> list[BatchView]:
        """Every owner's batches not yet final, with their progress (operators only)."""
        return await self.with_usage(await self._store.open_batches(limit))

    async def results(
        self, batch_id: str, owner: Owner, after: str | None, limit: int
    ) -> Page[ItemView]:
        check_limit(limit, MAX_RESULT_PAGE)
        await self.get(batch_id, owner)  # 404 for a batch that is not the caller's
        page = await self._store.results(batch_id, after, limit)
        if page is None:
            raise invalid_request(
                f"after: batch {batch_id} has no request with custom_id '{after}'", param="after"
            )
        return page

    async def cancel(self, batch_id: str, owner: Owner) -> BatchView:
        """Stops the items not started; the running ones are cancelled at their sites."""
        batch = await self._store.cancel(batch_id, owner)
        if batch is None:
            raise not_found(batch_id)
        if batch.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise Conflict(
                f"batch {batch_id} is already {batch.status.value}; only a batch that is "
                "validating or in progress can be cancelled",
                code="batch_not_cancellable",
            )
        self.runner.cancel(batch_id)
        return (await self.with_usage([batch]))[0]
