"""Timestamp arithmetic as SQL functions, compiled per backend: seconds since 1970
(`epoch_seconds`) and the index of a time bucket (`bucket_index`), so time series are grouped
into buckets inside the database (PostgreSQL and SQLite; other backends refuse to compile)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Float, Integer
from sqlalchemy.exc import CompileError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement


class epoch_seconds(FunctionElement[float]):  # noqa: N801 - reads as a SQL function
    """Seconds since 1970 of a UTC timestamp column."""

    type = Float()
    inherit_cache = True
    name = "epoch_seconds"


@compiles(epoch_seconds, "postgresql")
def _epoch_postgres(element: epoch_seconds, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST(EXTRACT(EPOCH FROM {compiler.process(element.clauses, **kw)}) AS FLOAT)"


def _sqlite_epoch(column: str) -> str:
    # SQLAlchemy stores SQLite datetimes as UTC text, which julianday() parses; julianday is a
    # double, so round to milliseconds: 12:01:00 must not come back as 12:00:59.9999998.
    return f"ROUND((julianday({column}) - 2440587.5) * 86400.0, 3)"


@compiles(epoch_seconds, "sqlite")
def _epoch_sqlite(element: epoch_seconds, compiler: SQLCompiler, **kw: Any) -> str:
    return _sqlite_epoch(compiler.process(element.clauses, **kw))


@compiles(epoch_seconds)
def _epoch_other(element: epoch_seconds, compiler: SQLCompiler, **kw: Any) -> str:
    raise CompileError(f"epoch_seconds is not defined for {compiler.dialect.name}")


class bucket_index(FunctionElement[int]):  # noqa: N801 - reads as a SQL function
    """floor((epoch_seconds(column) - start) / step) for rows at or after `start`."""

    type = Integer()
    inherit_cache = True
    name = "bucket_index"


@compiles(bucket_index, "postgresql")
def _bucket_postgres(element: bucket_index, compiler: SQLCompiler, **kw: Any) -> str:
    column, start, step = (compiler.process(c, **kw) for c in element.clauses)
    return f"CAST(FLOOR((EXTRACT(EPOCH FROM {column}) - {start}) / {step}) AS INTEGER)"


@compiles(bucket_index, "sqlite")
def _bucket_sqlite(element: bucket_index, compiler: SQLCompiler, **kw: Any) -> str:
    column, start, step = (compiler.process(c, **kw) for c in element.clauses)
    # CAST truncates; rows are filtered to >= start, so truncation is floor.
    return f"CAST(({_sqlite_epoch(column)} - {start}) / {step} AS INTEGER)"


@compiles(bucket_index)
def _bucket_other(element: bucket_index, compiler: SQLCompiler, **kw: Any) -> str:
    raise CompileError(f"bucket_index is not defined for {compiler.dialect.name}")
