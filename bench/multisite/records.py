"""What a gateway recorded in its database, read after a run (offloads, failed requests)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import create_engine, text

from gateway.db.migrate import sync_url


@dataclass(frozen=True, slots=True)
class Recorded:
    requests: int
    completed: int
    failed: int
    failed_before_first_token: int  # failed with no completion token: they were still queued
    offload_events: int
    moved_requests: int  # distinct requests that were offloaded at least once
    retried_requests: int  # requests started more than once (offload or failover)


def read_records(database_url: str) -> Recorded:
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as connection:
            requests, completed, failed, unstarted, retried = connection.execute(
                text(
                    "SELECT COUNT(*), "
                    "COALESCE(SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END), 0), "
                    "COALESCE(SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END), 0), "
                    "COALESCE(SUM(CASE WHEN status = 'failed' "
                    "AND COALESCE(completion_tokens, 0) = 0 THEN 1 ELSE 0 END), 0), "
                    "COALESCE(SUM(CASE WHEN attempts > 1 THEN 1 ELSE 0 END), 0) "
                    "FROM requests"
                )
            ).one()
            events, moved = connection.execute(
                text("SELECT COUNT(*), COUNT(DISTINCT request_id) FROM offload_events")
            ).one()
    finally:
        engine.dispose()
    return Recorded(
        int(requests),
        int(completed),
        int(failed),
        int(unstarted),
        int(events),
        int(moved),
        int(retried),
    )


def difference(after: Recorded, before: Recorded) -> Recorded:
    return Recorded(
        after.requests - before.requests,
        after.completed - before.completed,
        after.failed - before.failed,
        after.failed_before_first_token - before.failed_before_first_token,
        after.offload_events - before.offload_events,
        after.moved_requests - before.moved_requests,
        after.retried_requests - before.retried_requests,
    )
