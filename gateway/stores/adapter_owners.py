"""SQL of the owners of LoRA adapters loaded at run time (gateway/model_catalogue.py decides who
may use what; gateway/admin/adapters.py and gateway/fine_tuning/runner.py write them), and of
the keys the federation file's owners by name stand for."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError

from gateway.db.models import AdapterOwner, ApiKey
from gateway.db.session import SessionStore


@dataclass(frozen=True, slots=True)
class Ownership:
    """Who may use the adapter `name` (served over `parent`): every key if `public`, else only
    the key `key_id` (None: callers without a key)."""

    name: str
    parent: str
    public: bool = False
    key_id: int | None = None


def _ownership(row: AdapterOwner) -> Ownership:
    return Ownership(row.name, row.parent, row.public, None if row.public else row.api_key_id)


class AdapterOwnerStore(SessionStore):
    async def all(self) -> list[Ownership]:
        async with self._sessions() as session:
            rows = await session.scalars(select(AdapterOwner).order_by(AdapterOwner.name))
            return [_ownership(row) for row in rows]

    async def get(self, name: str) -> Ownership | None:
        async with self._sessions() as session:
            row = await session.get(AdapterOwner, name)
            return _ownership(row) if row is not None else None

    async def put(self, owner: Ownership) -> None:
        """Writes the adapter's owner, replacing any earlier row of the name."""
        for attempt in range(2):
            try:
                async with self._sessions.begin() as session:
                    row = await session.get(AdapterOwner, owner.name, with_for_update=True)
                    if row is None:
                        row = AdapterOwner(name=owner.name)
                        session.add(row)
                    row.parent, row.public = owner.parent, owner.public
                    row.api_key_id = owner.key_id
                return
            except IntegrityError:  # another gateway inserted the name meanwhile: update it
                if attempt:
                    raise

    async def remove(self, name: str) -> None:
        async with self._sessions.begin() as session:
            await session.execute(delete(AdapterOwner).where(AdapterOwner.name == name))

    async def oldest_live_keys(self, names: Collection[str]) -> dict[str, int]:
        """For each of `names` that a live (unrevoked) key has, the id of the oldest such key."""
        if not names:
            return {}
        query = (
            select(ApiKey.name, func.min(ApiKey.id))
            .where(ApiKey.name.in_(sorted(names)), ApiKey.revoked_at.is_(None))
            .group_by(ApiKey.name)
        )
        async with self._sessions() as session:
            rows = (await session.execute(query)).all()
        return {str(name): int(key_id) for name, key_id in rows}
