"""Who is calling and whether they may: API-key authentication and per-key limits for the
client APIs, between the HTTP controllers, the key store and where the limits are counted
(key_limits.py: in this process, or in PostgreSQL for every gateway together).

A request is charged twice: at admission, once its answer length is predicted, with its prompt
plus the predicted answer (max_tokens without a prediction); at its end, settled to the prompt
plus what was really generated, whether it completed, failed or was cancelled. A batch is
charged whole at submission (every item's prompt + max_tokens: nothing is predicted yet) and
not settled: its items run later, outside the window that charge counts in.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from gateway.errors import GatewayError, RateLimited, Unauthenticated
from gateway.tenancy.key_limits import Hold, InFlightRefusal, KeyLimits
from gateway.tenancy.keys import DISPLAY_PREFIX_CHARS, KEY_SCHEME, KeyRecord, KeyService
from gateway.tenancy.limiter import Refusal

log = logging.getLogger(__name__)
# How often work that waits for one of its key's concurrency slots looks again (at most).
SLOT_POLL_FIRST_S = 0.05
SLOT_POLL_MOST_S = 0.5
# Called with a revoked key's id (for work other than client requests: queued batch items).
RevokeHook = Callable[[int], None]


def invalid_api_key(message: str) -> GatewayError:
    return Unauthenticated(message, code="invalid_api_key")


def rate_limited(key: KeyRecord, refusal: Refusal, what: str = "this request") -> GatewayError:
    where = f"API key {key.prefix}... ('{key.name}') on {refusal.kind} per minute"
    if refusal.retry_after_s is None:
        message = (
            f"{what} is too large for {where}: limit {refusal.limit}, requested "
            f"{refusal.requested}; it can never fit, send less at once"
        )
    else:
        message = (
            f"Rate limit reached for {where}: limit {refusal.limit}, used {refusal.used}, "
            f"requested {refusal.requested}. Please try again in {refusal.retry_after_header}s."
        )
    return RateLimited(
        message,
        limit=refusal.kind,
        code="rate_limit_exceeded",
        retry_after_s=refusal.retry_after_header,
    )


def bearer_credential(authorization: str | None) -> str | None:
    scheme, _, credential = (authorization or "").partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and credential else None


def too_many_in_flight(key: KeyRecord, limit: int) -> GatewayError:
    return RateLimited(
        f"API key {key.prefix}... ('{key.name}') has {limit} requests in flight, its limit; "
        "retry when one ends",
        limit="requests",
        code="concurrency_limit_exceeded",
        retry_after_s=1,
    )


@dataclass(slots=True, weakref_slot=True, eq=False)  # by identity: kept in weak sets
class KeyAdmission:
    """One request's hold on its key's limits (CompletionService.dispatch's Admission)."""

    limits: KeyLimits
    key: KeyRecord
    _hold: Hold | None = None
    # What stops the request if its key is revoked while it runs (set by its dispatch).
    _on_revoke: Callable[[], None] | None = None
    revoked: bool = False

    @property
    def api_key_id(self) -> int:
        return self.key.id

    @property
    def api_key_name(self) -> str:
        return self.key.name

    async def charge(self, tokens: int, most_tokens: int) -> None:
        """Takes one request, `tokens` from the key's budget and, for a key with a concurrency
        cap, one of its slots; or raises 429. A request that could take more than a whole
        minute's budget (`most_tokens`: prompt + max_tokens) is refused outright: one request
        may not outrun its key's limit, whatever was predicted."""
        limit = self.key.limits.tokens_per_minute
        if limit is not None and most_tokens > limit:
            raise rate_limited(self.key, Refusal("tokens", limit, 0, most_tokens, None))
        outcome = await self.limits.admit(self.key, 1, tokens, slot=True, most_tokens=most_tokens)
        if isinstance(outcome, InFlightRefusal):
            raise too_many_in_flight(self.key, outcome.limit)
        if isinstance(outcome, Refusal):
            raise rate_limited(self.key, outcome)
        self._hold = outcome
        # A request dropped without being settled (a stream never started) gives its slot back.
        weakref.finalize(self, outcome.release)

    def settle(self, tokens: int) -> None:
        if self._hold is not None:
            self._hold.settle(tokens)

    def watch_revocation(self, stop: Callable[[], None]) -> None:
        """`stop` is called if the key is revoked while the request runs (at once if it was
        revoked already)."""
        self._on_revoke = stop
        if self.revoked:
            stop()

    def revoke(self) -> None:
        self.revoked = True
        if self._on_revoke is not None:
            self._on_revoke()


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made a client API request: a live key, or nobody (keys not required, none sent)."""

    tenancy: Tenancy
    key: KeyRecord | None

    @property
    def key_id(self) -> int | None:
        return self.key.id if self.key is not None else None

    def admission(self) -> KeyAdmission | None:
        """The request's hold on the key's limits (for CompletionService.dispatch)."""
        if self.key is None:
            return None
        admission = KeyAdmission(self.tenancy.limits, self.key)
        self.tenancy.running.setdefault(self.key.id, weakref.WeakSet()).add(admission)
        return admission

    async def admit_batch(self, items: Sequence[tuple[int, int]]) -> None:
        """Charges a batch of (prompt tokens, max_tokens) items whole, or raises 429."""
        if self.key is None:
            return
        key = self.key
        tokens = sum(prompt + max_tokens for prompt, max_tokens in items)
        outcome = await self.tenancy.limits.admit(key, len(items), tokens, slot=False)
        if isinstance(outcome, Refusal):
            raise rate_limited(key, outcome, f"this batch of {len(items)} requests")


class Tenancy:
    def __init__(self, keys: KeyService, limits: KeyLimits, require_keys: bool) -> None:
        self.keys = keys
        # In this process (SQLite) or shared by every gateway of the database (PostgreSQL).
        self.limits = limits
        self.require_keys = require_keys
        # Requests admitted per key, while they exist: revoking the key stops them.
        self.running: dict[int, weakref.WeakSet[KeyAdmission]] = {}
        self._revoke_hooks: list[RevokeHook] = []

    def add_revoke_hook(self, hook: RevokeHook) -> None:
        """Runs `hook(key_id)` whenever a key is revoked through this gateway (the batch
        runner's queued items are its to stop)."""
        self._revoke_hooks.append(hook)

    async def authenticate(self, authorization: str | None) -> Caller:
        """The caller, by its live key or anonymous (only when keys are not required); 401 for
        a missing key when required, an unknown key or a revoked one.

        A credential that looks like one of this gateway's keys is always checked; anything
        else (clients insist on sending some key) is ignored unless keys are required.
        """
        credential = bearer_credential(authorization)
        if credential is None or not credential.startswith(KEY_SCHEME):
            if not self.require_keys:
                return Caller(self, None)
            if credential is None:
                raise invalid_api_key(
                    "You didn't provide an API key: send it as 'Authorization: Bearer <key>'"
                )
            raise invalid_api_key("Incorrect API key provided: not a key of this gateway")
        key = await self.keys.find(credential)
        if key is None:
            raise invalid_api_key(
                f"Incorrect API key provided: {credential[:DISPLAY_PREFIX_CHARS]}..."
            )
        if key.revoked:
            raise invalid_api_key(f"API key {key.prefix}... ('{key.name}') has been revoked")
        return Caller(self, key)

    @asynccontextmanager
    async def key_slot(self, key: KeyRecord | None) -> AsyncIterator[None]:
        """Holds one of the key's concurrency slots for work it was charged for already (a
        batch item), waiting while the key is at its cap: a key's cap bounds its batch items
        as it bounds its requests. No key, or no cap: nothing is held."""
        if key is None:
            yield
            return
        delay = SLOT_POLL_FIRST_S
        while isinstance(held := await self.limits.take_slot(key), InFlightRefusal):
            await asyncio.sleep(delay)
            delay = min(delay * 2, SLOT_POLL_MOST_S)
        try:
            yield
        finally:
            held.release()

    async def revoke(self, key_id: int) -> KeyRecord | None:
        key = await self.keys.revoke(key_id)
        if key is not None:
            self.limits.forget(key_id)
            for admission in list(self.running.pop(key_id, ())):
                admission.revoke()
            for hook in self._revoke_hooks:
                try:
                    hook(key_id)
                except Exception:  # one hook's failure must not keep the others from running
                    log.exception("a revoke hook failed for key %d", key_id)
        return key
