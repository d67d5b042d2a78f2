"""Wire schemas of the Files API (msgspec), shaped like OpenAI's file objects."""

from __future__ import annotations

from typing import Literal

import msgspec


class FileObject(msgspec.Struct):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None
    # Deprecated by OpenAI, still read by older clients: a stored file is always processed.
    status: Literal["processed"] = "processed"
    status_details: None = None
    object: Literal["file"] = "file"


class FileList(msgspec.Struct):
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class FileDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"
