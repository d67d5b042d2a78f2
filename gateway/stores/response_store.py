"""SQL of stored responses (gateway/responses/service.py decides what is stored and when).

Every query is scoped to the key that owns the response: another key's response reads as one
that does not exist. Expired responses are neither read nor kept (deleted in the background).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.sql.elements import ColumnElement

from gateway.db.models import StoredResponse, utcnow
from gateway.db.session import SessionStore
from gateway.stores.file_store import owned_by
from gateway.stores.pages import Owner


@dataclass(frozen=True, slots=True)
class NewResponse:
    id: str
    owner: Owner
    model: str
    expires_at: datetime
    response: dict[str, Any]
    input_items: list[Any]
    history: list[Any]


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    response: dict[str, Any]
    input_items: list[Any]
    history: list[Any]


def _mine(response_id: str, owner: Owner) -> ColumnElement[bool]:
    return (
        (StoredResponse.id == response_id)
        & owned_by(StoredResponse.api_key_id, owner)
        & (StoredResponse.expires_at > utcnow())
    )


class ResponseStore(SessionStore):
    async def add(self, new: NewResponse) -> None:
        async with self._sessions.begin() as session:
            await session.execute(
                insert(StoredResponse).values(
                    id=new.id,
                    api_key_id=new.owner,
                    model=new.model,
                    created_at=utcnow(),
                    expires_at=new.expires_at,
                    response=new.response,
                    input_items=new.input_items,
                    history=new.history,
                )
            )

    async def get(self, response_id: str, owner: Owner) -> ResponseRecord | None:
        """The owner's live response; None for one that does not exist, expired, or is another
        key's."""
        query = select(
            StoredResponse.response, StoredResponse.input_items, StoredResponse.history
        ).where(_mine(response_id, owner))
        async with self._sessions() as session:
            row = (await session.execute(query)).first()
        return None if row is None else ResponseRecord(row[0], row[1], row[2])

    async def delete(self, response_id: str, owner: Owner) -> bool:
        """Deletes the owner's response; False when it has no such response."""
        async with self._sessions.begin() as session:
            result = await session.execute(delete(StoredResponse).where(_mine(response_id, owner)))
        return bool(getattr(result, "rowcount", 0))

    async def delete_expired(self) -> int:
        async with self._sessions.begin() as session:
            result = await session.execute(
                delete(StoredResponse).where(StoredResponse.expires_at <= utcnow())
            )
        return int(getattr(result, "rowcount", 0) or 0)
