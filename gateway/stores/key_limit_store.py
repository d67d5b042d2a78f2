"""SQL of the per-key limits that every gateway on one PostgreSQL database shares
(gateway/tenancy/shared_limits.py): admitting a request, settling its tokens, giving back its
concurrency slot, and handing back the slots of gateways that stopped renewing them.

An admission is one statement and one round trip: an upsert of the key's counters whose
conditional update checks every limit on the locked row, so two gateways admitting at once
are serialized by the row lock and neither sees the other's count late. The counters are the
requests and tokens of each of the last 61 seconds, in two arrays (oldest first) and the second
of their last element; the arithmetic is that of gateway/tenancy/second_windows.py
(tests/integration/test_shared_limits.py checks that they agree). The statements run on an
autocommit connection: one statement, no BEGIN/COMMIT trips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from sqlalchemy import TextClause, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

# The seconds a key's row counts (its arrays' length: migration 0016): the current one and the
# minute before it (gateway/tenancy/second_windows.py).
BUCKETS = 61
# The seconds the stored counts (`w`, their last second w.bucket) move by to end in the caller's
# :bucket (none for a caller whose clock is behind: it sees them as they are).
_SHIFT = f"CAST(LEAST(GREATEST(:bucket - w.bucket, 0), {BUCKETS}) AS integer)"
# The second the row's counts end in once rolled.
_NOW = "GREATEST(w.bucket, :bucket)"


def _rolled(column: str) -> str:
    """The column's counts rolled to the caller's second: the seconds that left the window
    dropped at the front, as many empty ones added at the end."""
    return f"(w.{column}[{_SHIFT} + 1 : {BUCKETS}] || array_fill(0::bigint, ARRAY[{_SHIFT}]))"


def _used(column: str) -> str:
    """What the column counts in the window at the caller's second (the seconds it still
    holds: those added by rolling are empty)."""
    return f"(SELECT COALESCE(sum(c), 0) FROM unnest(w.{column}[{_SHIFT} + 1 : {BUCKETS}]) AS c)"


def _charged(column: str, amount: str) -> str:
    """The rolled counts with `amount` added to the current second (built once: a same-second
    charge adds to the last count, a later one ends the rolled counts with it)."""
    amount = f"CAST({amount} AS bigint)"
    return (
        f"CASE WHEN {_SHIFT} = 0 "
        f"THEN w.{column}[1 : {BUCKETS - 1}] || (w.{column}[{BUCKETS}] + {amount}) "
        f"ELSE w.{column}[{_SHIFT} + 1 : {BUCKETS}] "
        f"|| array_fill(0::bigint, ARRAY[{_SHIFT} - 1]) || {amount} END"
    )


def _fresh(amount: str) -> str:
    """The counts of a key's first charge."""
    return f"(array_fill(0::bigint, ARRAY[{BUCKETS - 1}]) || CAST({amount} AS bigint))"


@cache
def _admit_sql(requests_limited: bool, tokens_limited: bool, capped: bool, bounded: bool) -> str:
    tokens_now = _used("second_tokens")
    checks = ["TRUE"]
    if requests_limited:
        checks.append(f"{_used('second_requests')} + :requests <= :rpm")
    if tokens_limited:
        checks.append(f"{tokens_now} + :tokens <= :tpm")
    if bounded:  # the request's most beside the key's unsettled margins, within the overshoot
        checks.append(f"{tokens_now} + w.margin + :most <= :tokens_most")
    if capped:
        checks.append("w.in_flight + :slot <= :cap")
    # This gateway's share of the key's requests in flight and of their margins.
    hold = (
        ", held AS (INSERT INTO key_in_flight_holds AS h "
        "(api_key_id, gateway_id, in_flight, margin, renewed_at) "
        "SELECT api_key_id, CAST(:gateway AS VARCHAR), :slot, :margin, now() FROM admitted "
        "WHERE :slot = 1 OR :margin > 0 "
        "ON CONFLICT (api_key_id, gateway_id) DO UPDATE "
        "SET in_flight = h.in_flight + :slot, margin = h.margin + :margin, renewed_at = now())"
    )
    return f"""
WITH admitted AS (
  INSERT INTO key_limit_windows AS w
    (api_key_id, bucket, second_requests, second_tokens, in_flight, margin)
  VALUES (:key, :bucket, {_fresh(":requests")}, {_fresh(":tokens")}, :slot, :margin)
  ON CONFLICT (api_key_id) DO UPDATE SET
    bucket = {_NOW},
    second_requests = {_charged("second_requests", ":requests")},
    second_tokens = {_charged("second_tokens", ":tokens")},
    in_flight = w.in_flight + :slot,
    margin = w.margin + :margin
  WHERE {" AND ".join(checks)}
  RETURNING w.api_key_id
){hold}
SELECT count(*) FROM admitted"""


def _settle_sql() -> str:
    # Where the charge's second is in the rolled counts (1-based): corrected there while it is
    # counted; an overrun of an older charge counts in the current second, an over-charge of
    # one is forgotten.
    position = f"{BUCKETS} - ({_NOW} - :charged)"
    target = (
        f"CASE WHEN {position} >= 1 THEN LEAST({position}, {BUCKETS}) "
        f"WHEN :delta > 0 THEN {BUCKETS} ELSE 0 END"
    )
    return f"""
UPDATE key_limit_windows AS w SET
  bucket = {_NOW},
  second_requests = {_rolled("second_requests")},
  second_tokens = (
    SELECT array_agg(CASE WHEN s.at = {target} THEN GREATEST(s.n + :delta, 0) ELSE s.n END
                     ORDER BY s.at)
    FROM unnest({_rolled("second_tokens")}) WITH ORDINALITY AS s(n, at))
WHERE w.api_key_id = :key"""


_SETTLE = text(_settle_sql())
_RELEASE = text("""
WITH released AS (
  UPDATE key_in_flight_holds SET in_flight = in_flight - :count, margin = margin - :margin
  WHERE api_key_id = :key AND gateway_id = :gateway AND in_flight >= :count
    AND margin >= :margin
  RETURNING api_key_id
)
UPDATE key_limit_windows SET in_flight = GREATEST(in_flight - :count, 0),
  margin = GREATEST(margin - :margin, 0)
WHERE api_key_id IN (SELECT api_key_id FROM released)""")
_RENEW = text("UPDATE key_in_flight_holds SET renewed_at = now() WHERE gateway_id = :gateway")
_REAP = text("""
WITH lapsed AS (
  DELETE FROM key_in_flight_holds
  WHERE renewed_at < now() - make_interval(secs => :lease_s) AND gateway_id <> :gateway
  RETURNING api_key_id, in_flight, margin
), per_key AS (
  SELECT api_key_id, sum(in_flight) AS in_flight, sum(margin) AS margin
  FROM lapsed GROUP BY api_key_id
)
UPDATE key_limit_windows AS w SET in_flight = GREATEST(w.in_flight - per_key.in_flight, 0),
  margin = GREATEST(w.margin - per_key.margin, 0)
FROM per_key WHERE w.api_key_id = per_key.api_key_id
RETURNING w.api_key_id""")
_READ = text(
    "SELECT bucket, second_requests, second_tokens, in_flight, margin "
    "FROM key_limit_windows WHERE api_key_id = :key"
)


@dataclass(frozen=True, slots=True)
class Admit:
    """One admission: `requests` and `tokens` charged in second `bucket` (Unix seconds), and a
    concurrency slot if `slot`."""

    key_id: int
    # The key's limits (None: unlimited).
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_in_flight: int | None
    bucket: int
    requests: int
    tokens: int
    slot: bool
    # The most the request may take (prompt + max_tokens) and the key's ceiling for it beside
    # its unsettled margins (tokens_per_minute x the overshoot allowed); None: not bounded.
    most: int | None = None
    tokens_most: int | None = None

    @property
    def margin(self) -> int:
        """What the request may take beyond its charge, held until it is settled."""
        if self.most is None or self.tokens_per_minute is None:
            return 0
        return max(self.most - self.tokens, 0)


@dataclass(frozen=True, slots=True)
class KeyLimitsRow:
    # The second of the last of the counts, which are oldest first.
    bucket: int
    requests: tuple[int, ...]
    tokens: tuple[int, ...]
    in_flight: int
    margin: int = 0


@dataclass(frozen=True, slots=True)
class Settlement:
    """A correction of `delta` tokens to charges made in second `charged`."""

    key_id: int
    charged: int
    delta: int


class KeyLimitStore:
    def __init__(self, engine: AsyncEngine, gateway_id: str) -> None:
        # db.session.create_counter_engine's (the statements rely on its autocommit: each is
        # committed on its own, one round trip).
        self._engine = engine
        self.gateway_id = gateway_id

    async def admit(self, admit: Admit) -> bool:
        """Charges the admission if every limit allows it; False (nothing charged) if not."""
        sql = _admit_sql(
            admit.requests_per_minute is not None,
            admit.tokens_per_minute is not None,
            admit.max_in_flight is not None and admit.slot,
            admit.most is not None and admit.tokens_most is not None,
        )
        params = {
            "key": admit.key_id,
            "bucket": admit.bucket,
            "requests": admit.requests,
            "tokens": admit.tokens,
            "slot": int(admit.slot),
            "rpm": admit.requests_per_minute,
            "tpm": admit.tokens_per_minute,
            "cap": admit.max_in_flight,
            "most": admit.most,
            "tokens_most": admit.tokens_most,
            "margin": admit.margin,
            "gateway": self.gateway_id,
        }
        try:
            return await self._admit_once(text(sql), params)
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            # A pooled connection the database had closed (restart, failover): its pool is
            # refreshed; once more on a new connection.
            return await self._admit_once(text(sql), params)

    async def _admit_once(self, statement: TextClause, params: Mapping[str, object]) -> bool:
        async with self._engine.connect() as connection:
            return bool(await connection.scalar(statement, params))

    async def read(self, key_id: int) -> KeyLimitsRow | None:
        """The key's counters as stored (to explain a refusal)."""
        async with self._engine.connect() as connection:
            row = (await connection.execute(_READ, {"key": key_id})).first()
        if row is None:
            return None
        bucket, requests, tokens, in_flight, margin = row
        return KeyLimitsRow(bucket, tuple(requests), tuple(tokens), in_flight, margin)

    async def write(
        self,
        bucket: int,
        settlements: Sequence[Settlement],
        releases: Mapping[int, tuple[int, int]],
    ) -> None:
        """Applies token corrections and gives back concurrency slots and margins (per key:
        slots, margin), in one transaction: all of them or none (the caller keeps them all to
        retry)."""
        async with self._engine.connect() as autocommit:
            connection = await autocommit.execution_options(isolation_level="READ COMMITTED")
            await connection.begin()
            if settlements:
                await connection.execute(
                    _SETTLE,
                    [
                        {"key": s.key_id, "charged": s.charged, "delta": s.delta, "bucket": bucket}
                        for s in settlements
                    ],
                )
            if releases:
                await connection.execute(
                    _RELEASE,
                    [
                        {
                            "key": key_id,
                            "count": count,
                            "margin": margin,
                            "gateway": self.gateway_id,
                        }
                        for key_id, (count, margin) in releases.items()
                    ],
                )
            await connection.commit()

    async def renew(self, lease_s: float) -> int:
        """Renews this gateway's holds and hands back those of gateways that have not renewed
        theirs for `lease_s`; returns how many keys got slots back."""
        async with self._engine.connect() as connection:
            await connection.execute(_RENEW, {"gateway": self.gateway_id})
            reaped = await connection.execute(
                _REAP, {"lease_s": lease_s, "gateway": self.gateway_id}
            )
            return len(reaped.all())

    async def dispose(self) -> None:
        await self._engine.dispose()
