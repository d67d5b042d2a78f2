"""Client API keys in the database: create (the plaintext is returned once), find by key, list,
revoke, and usage per key (from the request log's rows, which name their key).

Only a SHA-256 of each key is stored. A fast unsalted hash is the right tool here, unlike for
passwords: keys are 32 random bytes, so neither guessing nor precomputed tables get anywhere,
and every request is authenticated with one hash and one indexed lookup.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, func, select

from gateway.db.models import ApiKey, InferenceRequest, utcnow
from gateway.db.session import SessionStore
from gateway.tenancy.limiter import Limits

KEY_SCHEME = "fk-"
# Shown in listings to tell keys apart: the scheme and 8 of the key's ~43 random characters.
DISPLAY_PREFIX_CHARS = len(KEY_SCHEME) + 8


def generate_key() -> str:
    return KEY_SCHEME + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: int
    name: str
    prefix: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    created_at: datetime
    revoked_at: datetime | None
    max_concurrent_requests: int | None = None

    @property
    def limits(self) -> Limits:
        return Limits(self.requests_per_minute, self.tokens_per_minute)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True, slots=True)
class NewKey:
    record: KeyRecord
    # The only time the key exists outside its holder's hands: it is not stored.
    plaintext: str


@dataclass(frozen=True, slots=True)
class KeyUsage:
    api_key_id: int
    since: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int
    # The same per (model, LoRA adapter or None), by model then adapter (bases first).
    models: tuple[ModelUsage, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelUsage:
    model: str
    adapter: str | None
    requests: int
    prompt_tokens: int
    completion_tokens: int


def _record(row: ApiKey) -> KeyRecord:
    return KeyRecord(
        id=row.id,
        name=row.name,
        prefix=row.prefix,
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        max_concurrent_requests=row.max_concurrent_requests,
    )


class KeyService(SessionStore):
    async def create(
        self,
        name: str,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        max_concurrent_requests: int | None = None,
    ) -> NewKey:
        plaintext = generate_key()
        async with self._sessions.begin() as session:
            row = ApiKey(
                name=name,
                prefix=plaintext[:DISPLAY_PREFIX_CHARS],
                key_hash=hash_key(plaintext),
                requests_per_minute=requests_per_minute,
                tokens_per_minute=tokens_per_minute,
                max_concurrent_requests=max_concurrent_requests,
                created_at=utcnow(),
            )
            session.add(row)
            await session.flush()
            return NewKey(_record(row), plaintext)

    async def find(self, plaintext: str) -> KeyRecord | None:
        """The key with this plaintext, revoked or not; None for an unknown key."""
        async with self._sessions() as session:
            row = await session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(plaintext)))
            return _record(row) if row is not None else None

    async def get(self, key_id: int) -> KeyRecord | None:
        async with self._sessions() as session:
            row = await session.get(ApiKey, key_id)
            return _record(row) if row is not None else None

    async def list_keys(self) -> list[KeyRecord]:
        async with self._sessions() as session:
            rows = await session.scalars(select(ApiKey).order_by(ApiKey.id))
            return [_record(row) for row in rows]

    async def revoke(self, key_id: int) -> KeyRecord | None:
        """Revokes the key (a second revoke keeps the first time); None for an unknown key."""
        async with self._sessions.begin() as session:
            row = await session.get(ApiKey, key_id, with_for_update=True)
            if row is None:
                return None
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            return _record(row)

    async def usage(self, key_id: int, since: datetime) -> KeyUsage:
        """Requests made with the key since `since`, and their tokens: the prompt of those that
        reached a site (the others were refused with nothing processed) and what was generated,
        as the limiter settles them."""
        req = InferenceRequest
        reached_site = req.dispatched_at.is_not(None)
        query = (
            select(
                req.model,
                req.adapter,
                func.count(),
                func.coalesce(func.sum(case((reached_site, req.prompt_tokens), else_=0)), 0),
                func.coalesce(func.sum(req.completion_tokens), 0),
            )
            .where(req.api_key_id == key_id, req.created_at >= since)
            .group_by(req.model, req.adapter)
        )
        async with self._sessions() as session:
            rows = (await session.execute(query)).all()
        models = tuple(
            sorted(
                (ModelUsage(m, a, int(n), int(p), int(c)) for m, a, n, p, c in rows),
                key=lambda u: (u.model, u.adapter is not None, u.adapter or ""),
            )
        )
        return KeyUsage(
            key_id,
            since,
            sum(u.requests for u in models),
            sum(u.prompt_tokens for u in models),
            sum(u.completion_tokens for u in models),
            models,
        )
