"""Path parameters that name a database row by its integer id."""

from __future__ import annotations

from typing import Any

from litestar.params import Parameter

# Ids are 32-bit integer columns: a larger id is refused (400) before it reaches the database,
# whose driver would fail on it (500; the schema fuzzer found both cases).
MAX_ROW_ID = 2**31 - 1


def row_id(what: str) -> Any:
    """The bounds of an id path parameter for the rows of `what`: `Annotated[int, row_id(...)]`."""
    return Parameter(ge=1, le=MAX_ROW_ID, description=f"the {what}'s id")
