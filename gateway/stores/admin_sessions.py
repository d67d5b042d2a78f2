"""SQL of the dashboard's sign-ins (gateway/api/admin_auth.py signs and checks the cookies)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select, update

from gateway.db.models import AdminSession, utcnow
from gateway.db.session import SessionStore


class AdminSessionStore(SessionStore):
    async def open(self, session_id: str, expires_at: datetime) -> None:
        async with self._sessions.begin() as session:
            # Sign-ins past their expiry are of no use to anyone: swept as new ones come.
            await session.execute(delete(AdminSession).where(AdminSession.expires_at <= utcnow()))
            session.add(AdminSession(id=session_id, expires_at=expires_at))

    async def is_live(self, session_id: str) -> bool:
        async with self._sessions() as session:
            found = await session.scalar(
                select(AdminSession.id).where(
                    AdminSession.id == session_id,
                    AdminSession.revoked_at.is_(None),
                    AdminSession.expires_at > utcnow(),
                )
            )
        return found is not None

    async def revoke(self, session_id: str) -> None:
        async with self._sessions.begin() as session:
            await session.execute(
                update(AdminSession)
                .where(AdminSession.id == session_id, AdminSession.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
