"""SQL of the owners of LoRA adapters loaded at run time (gateway/model_catalogue.py decides who
may use what; gateway/admin/adapters.py and gateway/fine_tuning/runner.py write them)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import AdapterOwner


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


class AdapterOwnerStore:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

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
