"""Idempotency-Key: a client that retries a request with the same key gets the first result back
instead of a second run, also after a gateway restart (the records are in the database).

- The first request with a key claims it (running), runs, and stores its response (completed).
  A retry with the same key and the same request gets the stored response, marked with
  `Idempotent-Replayed: true`.
- A retry while the first is still running gets 409 with Retry-After (the client retries
  later and then gets the stored response); it does not wait, so no connection hangs on it.
- The same key with a different request (endpoint or JSON body, compared after parsing, so key
  order and spacing do not matter) is refused with 422.
- Only successes are stored: a request that fails (or whose client goes away) frees its key, so
  the retry runs it again. A running record whose gateway died is taken as abandoned after the
  request timeout, and the retry runs it again.
- Streaming requests cannot carry a key (400): a stream cannot be replayed as it was sent.
- Keys are scoped by API key, and forgotten after GATEWAY_IDEMPOTENCY_TTL_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from sqlalchemy.exc import DBAPIError

from gateway import client_json
from gateway.db.models import IdempotencyStatus
from gateway.errors import Conflict, Mismatch, invalid_request
from gateway.stores.idempotency_records import IdempotencyStore

log = logging.getLogger(__name__)
HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_CHARS = 255
# Expired records are deleted at most this often (and always when their own key comes back).
_PURGE_EVERY_S = 60.0
# A running record older than the request timeout plus this is abandoned (its gateway died).
_ABANDONED_MARGIN_S = 30.0
# Storing a finished answer under its key: retried while the client waits (about 1.5 s in all),
# then in the background (capped backoff) until the record would lapse as abandoned. Without
# it a database blip cost a 503 for a served answer, 409s for its retries, then a second run
# and a second charge.
_COMPLETE_INLINE_DELAYS_S = (0.1, 0.2, 0.4, 0.8)
_COMPLETE_BACKGROUND_MAX_DELAY_S = 10.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Claim:
    """This request holds the key: its response will answer the retries."""

    scope: str
    key: str


@dataclass(frozen=True, slots=True)
class Replay:
    """The key's first request already succeeded: its stored response."""

    status: int
    body: bytes


def _request_hash(endpoint: str, body: bytes) -> str:
    canonical = msgspec.json.encode(client_json.decode_any(body), order="sorted")
    return hashlib.sha256(endpoint.encode() + b"\0" + canonical).hexdigest()


class Idempotency:
    def __init__(self, store: IdempotencyStore, ttl_s: float, request_timeout_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._abandoned_after_s = request_timeout_s + _ABANDONED_MARGIN_S
        self._purged_at = 0.0
        self._background: set[asyncio.Task[None]] = set()

    async def claim(
        self, key: str | None, api_key_id: int | None, endpoint: str, body: bytes, stream: bool
    ) -> Claim | Replay | None:
        """None without a key; raises InvalidRequest (bad key, or a stream), Conflict (the key's
        request is still running) or Mismatch (the key came with a different request)."""
        if key is None:
            return None
        if not 0 < len(key) <= MAX_KEY_CHARS or not key.isascii() or not key.isprintable():
            raise invalid_request(
                f"{HEADER} must be 1 to {MAX_KEY_CHARS} printable ASCII characters", param=HEADER
            )
        if stream:
            raise invalid_request(
                f"{HEADER} cannot be used with stream=true: a stream cannot be replayed; send "
                "the request without stream to make it idempotent",
                param="stream",
            )
        scope = f"key:{api_key_id}" if api_key_id is not None else "anonymous"
        request_hash = _request_hash(endpoint, body)
        await self._purge_now_and_then()
        stored = await self._store.claim(
            scope, key, request_hash, self._ttl_s, self._abandoned_after_s
        )
        if stored is None:
            return Claim(scope, key)
        if stored.request_hash != request_hash:
            raise Mismatch(
                f"this {HEADER} was already used with a different request; use a new key for a "
                "new request",
                param=HEADER,
                code="idempotency_key_reused",
            )
        if stored.status is IdempotencyStatus.RUNNING or stored.response_body is None:
            raise Conflict(
                f"a request with this {HEADER} is still running; retry to get its result",
                param=HEADER,
                code="idempotency_key_in_use",
                retry_after_s=1,
            )
        return Replay(stored.response_status or 200, stored.response_body)

    async def once(
        self,
        claim: Claim | Replay | None,
        response_type: type[T],
        produce: Callable[[], Awaitable[T]],
    ) -> tuple[T, bool]:
        """The response: the stored one for a replay (True), else what `produce` makes (False),
        stored for the key's retries when there is a claim."""
        if isinstance(claim, Replay):
            return msgspec.json.decode(claim.body, type=response_type), True
        try:
            response = await produce()
        except BaseException:
            if claim is not None:
                # In the background: the caller may be being cancelled (client went away).
                self._in_background(self._release(claim))
            raise
        if claim is not None:
            await self._store_answer(claim, msgspec.json.encode(response))
        return response, False

    async def _store_answer(self, claim: Claim, body: bytes) -> None:
        """The answer is served whatever happens here; storing it is retried with backoff."""
        for delay_s in (*_COMPLETE_INLINE_DELAYS_S, None):
            try:
                await self._store.complete(claim.scope, claim.key, 200, body)
                return
            except DBAPIError as exc:
                if delay_s is None:
                    log.warning("storing an idempotent answer failed (%s); retrying in the "
                                "background", type(exc).__name__)  # fmt: skip
                    self._in_background(self._store_answer_later(claim, body))
                    return
                await asyncio.sleep(delay_s)

    async def _store_answer_later(self, claim: Claim, body: bytes) -> None:
        deadline = time.monotonic() + self._abandoned_after_s
        delay_s = _COMPLETE_INLINE_DELAYS_S[-1]
        while time.monotonic() < deadline:
            await asyncio.sleep(delay_s)
            try:
                await self._store.complete(claim.scope, claim.key, 200, body)
                return
            except DBAPIError:
                delay_s = min(delay_s * 2, _COMPLETE_BACKGROUND_MAX_DELAY_S)
        log.error("could not store an idempotent answer; a retry with its key will run again")

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, claim: Claim) -> None:
        try:
            await self._store.release(claim.scope, claim.key)
        except Exception:  # the record then lapses as abandoned; the retry still runs
            log.exception("could not free idempotency key of a failed request")

    async def _purge_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._purged_at >= _PURGE_EVERY_S:
            self._purged_at = now
            await self._store.purge_expired()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits a little for the background writes; one still retrying is given up (its key
        then lapses as abandoned)."""
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=timeout_s)
            for task in pending:
                task.cancel()
