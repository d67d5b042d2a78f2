"""SQL of the admin login throttle: failed sign-ins per client address, in the database, so every
gateway sharing it counts them together (gateway/api/admin_auth.py's LoginThrottle)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select

from gateway.db.models import AdminLoginFailure
from gateway.db.session import SessionStore

# The column's width: a longer "address" (none is) is cut to it wherever it is used.
_ADDRESS_CHARS = 64


class LoginFailureStore(SessionStore):
    async def recent(self, address: str, since: datetime, most: int) -> list[datetime]:
        """The address's failures after `since`, newest first, at most `most` of them."""
        query = (
            select(AdminLoginFailure.failed_at)
            .where(
                AdminLoginFailure.address == address[:_ADDRESS_CHARS],
                AdminLoginFailure.failed_at > since,
            )
            .order_by(AdminLoginFailure.failed_at.desc())
            .limit(most)
        )
        async with self._sessions() as session:
            return list(await session.scalars(query))

    async def failed(self, address: str, at: datetime, window: timedelta) -> None:
        async with self._sessions.begin() as session:
            # Failures out of every window are of no use: swept as new ones come.
            await session.execute(
                delete(AdminLoginFailure).where(AdminLoginFailure.failed_at <= at - window)
            )
            session.add(AdminLoginFailure(address=address[:_ADDRESS_CHARS], failed_at=at))

    async def succeeded(self, address: str) -> None:
        async with self._sessions.begin() as session:
            await session.execute(
                delete(AdminLoginFailure).where(
                    AdminLoginFailure.address == address[:_ADDRESS_CHARS]
                )
            )
