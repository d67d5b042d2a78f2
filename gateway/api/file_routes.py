"""/v1/files: a thin controller over FileService (gateway/files/service.py), as the openai
clients call it (files.create, retrieve, list, delete, content)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Stream

from gateway.api.client_auth import require_client_key
from gateway.api.file_schemas import FileDeleted, FileList, FileObject
from gateway.api.multipart_upload import read_upload
from gateway.api.openai_errors import invalid_request
from gateway.api.openapi_body import multipart_body
from gateway.files.service import FileService
from gateway.settings import GatewaySettings
from gateway.stores.file_store import FileView
from gateway.tenancy.admission import Caller

DEFAULT_FILE_PAGE = 10_000
_UPLOAD_FORM = {
    "type": "object",
    "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["batch", "fine-tune"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer"},
    },
    "required": ["file", "purpose"],
}


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def file_object(view: FileView) -> FileObject:
    return FileObject(
        id=view.id,
        bytes=view.bytes,
        created_at=int(view.created_at.timestamp()),
        filename=view.filename,
        purpose=view.purpose,
        expires_at=_unix(view.expires_at),
    )


def _expires_after(fields: dict[str, str]) -> int | None:
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or seconds is None or not seconds.isdigit():
        raise invalid_request(
            "expires_after takes anchor 'created_at' and a number of seconds",
            param="expires_after",
        )
    return int(seconds)


class FilesController(Controller):
    path = "/v1/files"
    tags = ("files",)
    guards = [require_client_key]  # noqa: RUF012 (litestar's layered attribute)

    @post(
        "/",
        status_code=200,
        request_max_body_size=None,  # bounded by GATEWAY_FILE_MAX_BYTES while it is read
        summary="Upload a batch input file (purpose 'batch') or training data ('fine-tune')",
        operation_class=multipart_body(_UPLOAD_FORM),
    )
    async def upload_file(
        self,
        request: Request[Any, Any, Any],
        files: NamedDependency[FileService],
        settings: NamedDependency[GatewaySettings],
        caller: NamedDependency[Caller],
    ) -> FileObject:
        with files.uploads.admit(caller.key_id):
            upload = await read_upload(request, settings.files.max_bytes)
            if not upload.has_file:
                raise invalid_request("the form has no 'file' field", param="file")
            purpose = upload.fields.get("purpose")
            if purpose is None:
                raise invalid_request("the form has no 'purpose' field", param="purpose")
            async with files.uploads.validating():
                view = await files.upload(
                    caller.key_id,
                    upload.filename or "upload.jsonl",
                    purpose,
                    bytes(upload.content),
                    _expires_after(upload.fields),
                )
        return file_object(view)

    @get("/", summary="The caller's files, newest first unless order=asc")
    async def list_files(
        self,
        files: NamedDependency[FileService],
        caller: NamedDependency[Caller],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_FILE_PAGE,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
        purpose: FromQuery[str | None] = None,
    ) -> FileList:
        page = await files.list_files(caller.key_id, after, limit, order, purpose)
        data = [file_object(view) for view in page.data]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return FileList(data=data, first_id=first, last_id=last, has_more=page.has_more)

    @get("/{file_id:str}", summary="A file's object")
    async def get_file(
        self,
        files: NamedDependency[FileService],
        caller: NamedDependency[Caller],
        file_id: FromPath[str],
    ) -> FileObject:
        return file_object(await files.get(file_id, caller.key_id))

    @delete("/{file_id:str}", status_code=200, summary="Delete a file")
    async def delete_file(
        self,
        files: NamedDependency[FileService],
        caller: NamedDependency[Caller],
        file_id: FromPath[str],
    ) -> FileDeleted:
        await files.delete(file_id, caller.key_id)
        return FileDeleted(id=file_id)

    @get("/{file_id:str}/content", summary="A file's bytes")
    async def file_content(
        self,
        files: NamedDependency[FileService],
        caller: NamedDependency[Caller],
        file_id: FromPath[str],
    ) -> Stream:
        view, parts = await files.content(file_id, caller.key_id)
        return Stream(
            parts,
            media_type="application/octet-stream",
            headers={
                "Content-Length": str(view.bytes),
                "Content-Disposition": f'attachment; filename="{view.id}.jsonl"',
            },
        )
