"""A day of plausible history for 9 sites: load samples every 10 s and predicted requests."""

from __future__ import annotations

import asyncio
import math
import random
from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, insert

from gateway.db.migrate import sync_url, upgrade
from gateway.db.models import InferenceRequest, LoadSample, RequestStatus, Site
from gateway.db.session import create_engine as create_async_engine
from gateway.db.session import create_sessionmaker
from gateway.stores.load_history import roll_up

PLACES = [
    (cloud, region)
    for cloud, regions in {
        "aws": ("us-east-1", "us-west-2", "eu-west-1"),
        "gcp": ("us-central1", "europe-west4", "asia-east1"),
        "azure": ("eastus", "westeurope", "japaneast"),
    }.items()
    for region in regions
]
SITES = [(f"{cloud}-{region}", cloud, region) for cloud, region in PLACES]
_CHUNK = 10_000


def _samples(
    site_id: int, phase: float, start: datetime, seconds: int, interval_s: int, rng: random.Random
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for t in range(0, seconds, interval_s):
        day = 0.55 + 0.45 * math.sin(2 * math.pi * t / 86_400 + phase)  # a daily cycle
        load = max(0.0, 40_000 * day * rng.uniform(0.8, 1.2))
        completed = max(0, round(rng.gauss(12 * day, 3)))
        ttft = rng.uniform(40, 160) if completed else None
        rows.append(
            {
                "site_id": site_id,
                "bucket_at": start + timedelta(seconds=t),
                "queued_tokens": int(load * 0.2),
                "running_tokens": int(load * 0.5),
                "predicted_remaining_tokens": int(load * 0.3),
                "queued_requests": int(load * 0.2 / 400),
                "running_requests": int(load * 0.5 / 600),
                "completed_requests": completed,
                "ttft_mean_ms": ttft,
                "ttft_p50_ms": ttft,
                "e2e_mean_ms": ttft * 20 if ttft else None,
                "e2e_p50_ms": ttft * 18 if ttft else None,
                "healthy": rng.random() > 0.002,
            }
        )
    return rows


def _requests(
    site_ids: list[int], start: datetime, count: int, rng: random.Random
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(count):
        created = start + timedelta(seconds=rng.uniform(0, 86_400))
        actual = rng.randint(1, 1024)
        predicted = max(1, int(actual * rng.uniform(0.6, 1.4)))
        rows.append(
            {
                "id": f"bench-{i}",
                "api": "completions",
                "model": "tiny",
                "status": RequestStatus.COMPLETED,
                "stream": True,
                "prompt_tokens": rng.randint(16, 2048),
                "max_tokens": 1024,
                "completion_tokens": actual,
                "predicted_tokens": predicted,
                "routing_policy": "mico",
                "site_id": rng.choice(site_ids),
                "attempts": 1,
                "created_at": created,
                "dispatched_at": created,
                "first_token_at": created + timedelta(seconds=0.1),
                "finished_at": created + timedelta(seconds=actual / 50),
            }
        )
    return rows


def seed(database_url: str, *, interval_s: int, requests: int, seed: int = 7) -> dict[str, int]:
    """Creates the schema and a day of history ending now; returns row counts."""
    upgrade(database_url)
    rng = random.Random(seed)
    now = datetime.now(UTC)
    start = now - timedelta(seconds=86_400)
    engine = create_engine(sync_url(database_url))
    samples = 0
    try:
        with engine.begin() as connection:
            site_ids = []
            for name, cloud, region in SITES:
                result = connection.execute(
                    insert(Site).values(
                        name=name,
                        cloud=cloud,
                        region=region,
                        endpoint="127.0.0.1:1",
                        model="tiny",
                        capacity_weight=1.0,
                        enabled=True,
                        created_at=start,
                        updated_at=start,
                    )
                )
                key = result.inserted_primary_key
                assert key is not None
                site_ids.append(int(key[0]))
            for index, site_id in enumerate(site_ids):
                rows = _samples(site_id, index * 0.7, start, 86_400, interval_s, rng)
                samples += len(rows)
                for i in range(0, len(rows), _CHUNK):
                    connection.execute(insert(LoadSample), rows[i : i + _CHUNK])
            rows = _requests(site_ids, start, requests, rng)
            for i in range(0, len(rows), _CHUNK):
                connection.execute(insert(InferenceRequest), rows[i : i + _CHUNK])
    finally:
        engine.dispose()
    rollups = asyncio.run(_roll_up(database_url, now))
    return {
        "sites": len(SITES),
        "load_samples": samples,
        "load_rollups": rollups,
        "requests": requests,
    }


async def _roll_up(database_url: str, now: datetime) -> int:
    """What the gateway's sampler did over the day: 5-minute rollups of the samples."""
    engine = create_async_engine(database_url)
    try:
        return await roll_up(create_sessionmaker(engine), now)
    finally:
        await engine.dispose()
