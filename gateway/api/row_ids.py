"""Path parameters that name a database row by its integer id."""

from __future__ import annotations

from typing import Any

from litestar.params import Parameter

from gateway.db.models import MAX_ROW_ID

__all__ = ["MAX_ROW_ID", "row_id"]


def row_id(what: str) -> Any:
    """The bounds of an id path parameter for the rows of `what`: `Annotated[int, row_id(...)]`."""
    return Parameter(ge=1, le=MAX_ROW_ID, description=f"the {what}'s id")
