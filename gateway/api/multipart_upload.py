"""Receiving a file upload (multipart/form-data, as the openai clients send `files.create`): read
as it streams in, refused with 413 as soon as the file passes its limit, every other field
small and bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from litestar import Request
from multipart import (  # type: ignore[import-untyped]
    MultipartSegment,
    ParserError,
    ParserLimitReached,
    PushMultipartParser,
    parse_options_header,
)

from gateway.api.openai_errors import OpenAIError, invalid_request

FILE_FIELD = "file"
# Form fields other than the file: a few short values (purpose, expires_after[...]).
MAX_FIELD_BYTES = 1024
MAX_PARTS = 16


@dataclass(slots=True)
class Upload:
    filename: str | None = None
    content: bytearray = field(default_factory=bytearray)
    fields: dict[str, str] = field(default_factory=dict)
    has_file: bool = False


def file_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the file is larger than {limit} bytes, this gateway's limit (GATEWAY_FILE_MAX_BYTES); "
        "split it into several batches",
        param=FILE_FIELD,
        code="file_too_large",
    )


def _boundary(request: Request[Any, Any, Any]) -> str:
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get("boundary")
    if kind != "multipart/form-data" or not boundary:
        raise invalid_request(
            "send the file as multipart/form-data with the fields 'file' and 'purpose'"
        )
    return str(boundary)


async def read_upload(request: Request[Any, Any, Any], max_file_bytes: int) -> Upload:
    """The upload's file and fields; 413 once the file passes `max_file_bytes` (before the
    rest of the body is read), 400 for a body that is not a valid multipart form."""
    boundary = _boundary(request)
    declared = request.headers.get("content-length", "")
    most_body = max_file_bytes + MAX_PARTS * (MAX_FIELD_BYTES + 1024)
    if declared.isdigit() and int(declared) > most_body:
        raise file_too_large(max_file_bytes)
    upload = Upload()
    segment: MultipartSegment | None = None
    value = bytearray()
    try:
        with PushMultipartParser(boundary, max_segment_count=MAX_PARTS) as parser:
            stream = request.stream()
            while not parser.closed:
                chunk = await anext(stream, b"")
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        segment, value = event, bytearray()
                        if segment.name == FILE_FIELD:
                            if upload.has_file:
                                raise invalid_request("send one file per upload", param="file")
                            upload.has_file, upload.filename = True, segment.filename
                    elif event is not None and segment is not None:
                        _take(upload, segment, event, value, max_file_bytes)
                    elif segment is not None:  # the end of a part
                        if segment.name != FILE_FIELD:
                            upload.fields[segment.name or ""] = value.decode(errors="replace")
                        segment = None
    except ParserLimitReached as exc:
        raise invalid_request(f"the form has more than {MAX_PARTS} fields") from exc
    except ParserError as exc:
        raise invalid_request(f"the body is not a valid multipart/form-data form: {exc}") from exc
    return upload


def _take(
    upload: Upload, segment: MultipartSegment, data: bytes, value: bytearray, max_file: int
) -> None:
    if segment.name == FILE_FIELD:
        upload.content += data
        if len(upload.content) > max_file:
            raise file_too_large(max_file)
        return
    value += data
    if len(value) > MAX_FIELD_BYTES:
        raise invalid_request(
            f"form field '{segment.name}' is longer than {MAX_FIELD_BYTES} bytes",
            param=segment.name,
        )
