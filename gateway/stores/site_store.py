"""Keeps the sites table in step with the federation file and with the sites that join and
leave at run time."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import Site
from gateway.federation import SiteConfig


async def sync_sites(
    sessions: async_sessionmaker[AsyncSession], configs: tuple[SiteConfig, ...]
) -> dict[str, int]:
    """Upserts every configured site, disables sites no longer configured; returns name -> id.

    Sites are never deleted: past requests keep pointing at the site that served them.
    """
    async with sessions.begin() as session:
        await _add_missing(session, configs)
        existing = {site.name: site for site in (await session.scalars(select(Site))).all()}
        configured = {config.name for config in configs}
        for config in configs:
            site = existing[config.name]
            site.cloud, site.region = config.cloud, config.region
            site.endpoint, site.model = config.endpoint, config.model
            site.capacity_weight, site.enabled = config.capacity_weight, True
        for name, site in existing.items():
            if name not in configured:
                site.enabled = False
        await session.flush()
        return {name: site.id for name, site in existing.items() if name in configured}


async def enable_site(sessions: async_sessionmaker[AsyncSession], config: SiteConfig) -> int:
    """A site that joins at run time: its row (new, or the one of an earlier site of that name,
    updated) enabled; returns its id."""
    async with sessions.begin() as session:
        await _add_missing(session, (config,))
        site = await session.scalar(select(Site).where(Site.name == config.name))
        assert site is not None  # added above if it was missing
        site.cloud, site.region = config.cloud, config.region
        site.endpoint, site.model = config.endpoint, config.model
        site.capacity_weight, site.enabled = config.capacity_weight, True
        await session.flush()
        return site.id


async def disable_site(sessions: async_sessionmaker[AsyncSession], name: str) -> None:
    """A site that left: its row stays (past requests point at it), disabled."""
    async with sessions.begin() as session:
        site = await session.scalar(select(Site).where(Site.name == name))
        if site is not None:
            site.enabled = False


async def _add_missing(session: AsyncSession, configs: Iterable[SiteConfig]) -> None:
    """A row for each site that has none, in one statement that skips the names another
    process added first: the workers of one gateway start at once on one database, and a
    check-then-add let all but one of them fail on the unique name."""
    rows = [{"name": config.name, "cloud": config.cloud, "region": config.region,
             "endpoint": config.endpoint, "model": config.model,
             "capacity_weight": config.capacity_weight, "enabled": True}
            for config in configs]  # fmt: skip
    if not rows:
        return
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = dialect.insert(Site).values(rows).on_conflict_do_nothing(index_elements=["name"])
    await session.execute(statement)
