"""The declarative base and the column types every table shares."""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from sqlalchemy import DateTime, Dialect, Enum, MetaData, TypeDecorator
from sqlalchemy.orm import DeclarativeBase

# Ids are 32-bit integer columns: a larger id an API is given is refused (400) before it reaches
# the database, whose driver would fail on it (500; the schema fuzzer and issue 67 found cases).
MAX_ROW_ID = 2**31 - 1

# Deterministic constraint names, so migrations can address them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC, returns aware datetimes: SQLite would otherwise hand back naive ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def checked_enum(enum_type: type[enum.StrEnum], name: str) -> Enum:
    return Enum(
        enum_type,
        native_enum=False,
        length=16,
        name=name,
        values_callable=lambda members: [m.value for m in members],
    )
