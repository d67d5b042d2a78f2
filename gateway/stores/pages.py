"""What every store of the kept-object APIs (files, batches, responses) shares: the owning key,
a page of a listing, and the row count of a conditional UPDATE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from sqlalchemy.engine import CursorResult, Result

T = TypeVar("T")

Owner = int | None  # the API key an object belongs to; None: made without a key


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    data: list[T]
    has_more: bool


def rowcount(result: Result[Any]) -> int:
    return cast(CursorResult[Any], result).rowcount
