"""The batch API's operations: submit (validate every item, then store the batch whole), read,
list, results and cancel. Running batches is the runner's job (gateway/batch_runner.py).

Validation is /v1/completions' own (CompletionService.prepare) applied to each item, so a batch
is accepted only if every item would have been; otherwise nothing is written and the error
names the item.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.api.batch_schemas import BatchCreateRequest, completion_request, item_body
from gateway.api.errors import (
    OpenAIError,
    invalid_request,
    model_not_found,
    service_unavailable,
)
from gateway.batch_runner import BatchRunner
from gateway.completions import CompletionService
from gateway.db.models import BatchStatus
from gateway.services.batch_leases import BatchLeases
from gateway.services.batch_records import BatchView, ItemView, NewItem, Page
from gateway.services.batches import BatchStore
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry

MAX_BATCH_PAGE, MAX_RESULT_PAGE = 100, 1000
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# Items validated between yields to the event loop: a large batch must not stall other requests.
_VALIDATE_SLICE = 256


def not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id}'", code="batch_not_found")


def _item_error(index: int, custom_id: str, exc: OpenAIError) -> OpenAIError:
    where = f"requests[{index}]"
    return invalid_request(
        f"{where} (custom_id '{custom_id}'): {exc.body.message}; no request of the batch was "
        "accepted",
        param=f"{where}.{exc.body.param}" if exc.body.param else where,
        code=exc.body.code,
    )


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


class BatchService:
    @classmethod
    def build(
        cls,
        settings: GatewaySettings,
        sessions: async_sessionmaker[AsyncSession],
        completions: CompletionService,
        registry: SiteRegistry,
    ) -> BatchService:
        store = BatchStore(sessions)
        runner = BatchRunner(settings, store, BatchLeases(sessions), completions, registry)
        return cls(settings, completions, registry, store, runner)

    def __init__(
        self,
        settings: GatewaySettings,
        completions: CompletionService,
        registry: SiteRegistry,
        store: BatchStore,
        runner: BatchRunner,
    ) -> None:
        self._settings = settings
        self._completions = completions
        self._registry = registry
        self._store = store
        self.runner = runner

    async def submit(
        self,
        request: BatchCreateRequest,
        admit: Callable[[Sequence[tuple[int, int]]], None] | None = None,
    ) -> BatchView:
        """Validates every item first (4xx naming the first bad one), then needs a healthy site
        serving the model (503) and `admit` to take the items' (prompt tokens, max_tokens)
        against the caller's limits (429); nothing is written unless the batch is accepted."""
        count, limit = len(request.requests), self._settings.batch_max_items
        if count == 0:
            raise invalid_request("a batch needs at least one request", param="requests")
        if count > limit:
            raise invalid_request(
                f"this batch has {count} requests; this gateway takes at most {limit} per batch",
                param="requests",
                code="batch_too_large",
            )
        _check_metadata(request.metadata)
        items = await self._validate(request)
        if not any(s.healthy and s.model == request.model for s in self._registry.all()):
            # As /v1/completions answers: retry later, rather than a batch that waits unseen.
            raise service_unavailable(f"no site can serve model '{request.model}' now")
        if admit is not None:
            admit([(item.prompt_tokens, item.max_tokens) for item in items])
        batch = await self._store.create(
            f"batch_{uuid.uuid4().hex}", request.model, request.metadata, items
        )
        self.runner.wake()
        return batch

    async def _validate(self, request: BatchCreateRequest) -> list[NewItem]:
        seen: dict[str, int] = {}
        items: list[NewItem] = []
        for index, item in enumerate(request.requests):
            if item.custom_id in seen:
                raise invalid_request(
                    f"requests[{index}]: custom_id '{item.custom_id}' is also the custom_id of "
                    f"requests[{seen[item.custom_id]}]; custom_ids must be unique in a batch",
                    param=f"requests[{index}].custom_id",
                )
            seen[item.custom_id] = index
            body = item_body(item)
            try:
                prepared = self._completions.prepare(completion_request(request.model, body))
            except OpenAIError as exc:
                if exc.body.code == "model_not_found":
                    raise model_not_found(request.model) from exc
                raise _item_error(index, item.custom_id, exc) from exc
            params = prepared.params
            items.append(
                NewItem(item.custom_id, body, len(params.prompt_token_ids), params.max_tokens)
            )
            if index % _VALIDATE_SLICE == _VALIDATE_SLICE - 1:
                await asyncio.sleep(0)
        return items

    async def get(self, batch_id: str) -> BatchView:
        batch = await self._store.get(batch_id)
        if batch is None:
            raise not_found(batch_id)
        return batch

    async def list_batches(self, after: str | None, limit: int) -> Page[BatchView]:
        check_limit(limit, MAX_BATCH_PAGE)
        page = await self._store.list_batches(after, limit)
        if page is None:
            raise invalid_request(f"after: no batch with id '{after}'", param="after")
        return page

    async def results(self, batch_id: str, after: str | None, limit: int) -> Page[ItemView]:
        check_limit(limit, MAX_RESULT_PAGE)
        page = await self._store.results(batch_id, after, limit)
        if page is None or (not page.data and after is None):
            await self.get(batch_id)  # 404 for an unknown batch
        if page is None:
            raise invalid_request(
                f"after: batch {batch_id} has no request with custom_id '{after}'", param="after"
            )
        return page

    async def cancel(self, batch_id: str) -> BatchView:
        """Stops the items not started; the running ones are cancelled at their sites."""
        batch = await self._store.cancel(batch_id)
        if batch is None:
            raise not_found(batch_id)
        if batch.status in (BatchStatus.COMPLETED, BatchStatus.FAILED):
            raise OpenAIError(
                409,
                f"batch {batch_id} is already {batch.status.value}; only a batch that is "
                "validating or in progress can be cancelled",
                code="batch_not_cancellable",
            )
        self.runner.cancel(batch_id)
        return batch
