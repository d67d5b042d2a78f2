"""Records each request: one insert when it is accepted, one update when it ends.

Two short transactions per request keep the database off the token path; timings observed in
between (first token) are carried in memory and written with the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import (
    InferenceRequest,
    LengthSample,
    OffloadEvent,
    RequestStatus,
    utcnow,
)


@dataclass(frozen=True, slots=True)
class NewRequest:
    request_id: str
    api: str
    model: str
    stream: bool
    user: str | None
    prompt_tokens: int
    max_tokens: int
    routing_policy: str
    site_id: int | None
    predicted_tokens: int | None = None
    predicted_bucket: int | None = None
    predictor_version: str | None = None
    predicted_p90_tokens: int | None = None
    routing_detail: dict[str, object] | None = None
    # The caller's API key, when it sent one (usage per key is summed from these rows).
    api_key_id: int | None = None


@dataclass(frozen=True, slots=True)
class NewSample:
    """A finished request's prompt and true answer length, for retraining the predictor."""

    model: str
    prompt: str
    prompt_tokens: int
    completion_tokens: int
    censored: bool
    predicted_tokens: int | None


@dataclass(frozen=True, slots=True)
class Outcome:
    status: RequestStatus
    site_id: int | None
    attempts: int
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: datetime | None = None
    # Sites an answer moved between mid-stream ({"from", "to", "after_tokens"}), in order.
    continuations: list[dict[str, object]] | None = None


class RequestLog:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def accepted(self, new: NewRequest) -> None:
        now = utcnow()
        async with self._sessions.begin() as session:
            session.add(
                InferenceRequest(
                    id=new.request_id,
                    api=new.api,
                    model=new.model,
                    status=RequestStatus.DISPATCHED,
                    stream=new.stream,
                    user=new.user,
                    prompt_tokens=new.prompt_tokens,
                    max_tokens=new.max_tokens,
                    predicted_tokens=new.predicted_tokens,
                    predicted_bucket=new.predicted_bucket,
                    predictor_version=new.predictor_version,
                    predicted_p90_tokens=new.predicted_p90_tokens,
                    routing_detail=new.routing_detail,
                    routing_policy=new.routing_policy,
                    site_id=new.site_id,
                    api_key_id=new.api_key_id,
                    attempts=1,
                    created_at=now,
                    dispatched_at=now if new.site_id is not None else None,
                )
            )

    async def offloaded(self, request_id: str, from_site_id: int, to_site_id: int) -> None:
        async with self._sessions.begin() as session:
            session.add(
                OffloadEvent(
                    request_id=request_id, from_site_id=from_site_id, to_site_id=to_site_id
                )
            )
            await session.execute(
                update(InferenceRequest)
                .where(InferenceRequest.id == request_id)
                .values(site_id=to_site_id)
            )

    async def finished(
        self, request_id: str, outcome: Outcome, sample: NewSample | None = None
    ) -> None:
        """Records the outcome, and the length sample with it in the same transaction."""
        async with self._sessions.begin() as session:
            if sample is not None:
                session.add(
                    LengthSample(
                        request_id=request_id,
                        model=sample.model,
                        prompt=sample.prompt,
                        prompt_tokens=sample.prompt_tokens,
                        completion_tokens=sample.completion_tokens,
                        censored=sample.censored,
                        predicted_tokens=sample.predicted_tokens,
                    )
                )
            await session.execute(
                update(InferenceRequest)
                .where(InferenceRequest.id == request_id)
                .values(
                    status=outcome.status,
                    site_id=outcome.site_id,
                    attempts=outcome.attempts,
                    completion_tokens=outcome.completion_tokens,
                    finish_reason=outcome.finish_reason,
                    error=outcome.error,
                    first_token_at=outcome.first_token_at,
                    continuations=outcome.continuations,
                    finished_at=utcnow(),
                )
            )
