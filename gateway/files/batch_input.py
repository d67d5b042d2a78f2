"""The batch input file format (OpenAI's): one request per line,
`{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.

Parsed when such a file is uploaded (a malformed file is refused then, naming the line) and again
when a batch is created from it, where each body is validated as the endpoint it names would.
Bodies are kept as raw JSON until then: a 64 MiB file decoded into Python objects would take
several times that in memory.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

import msgspec

from gateway import client_json
from gateway.errors import GatewayError, invalid_request

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[Endpoint, ...] = ("/v1/completions", "/v1/chat/completions")
# custom_id as stored with each batch item (batch_items.custom_id): it names the item's result
# as the client sent it, so one a database column cannot hold as it is (U+0000) is refused.
MAX_CUSTOM_ID = 256
CustomId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_CUSTOM_ID, pattern="^[^\x00]*$")
]


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: CustomId
    method: str
    url: str
    body: msgspec.Raw


class InputLine(NamedTuple):
    """A tuple, not an object: the garbage collector stops walking a 100k-line file's lines
    after their first collection (gateway/batches/records.py NewItem says why that matters)."""

    number: int  # 1-based, as an editor shows it
    custom_id: str
    url: Endpoint
    body: msgspec.Raw  # a JSON object, not decoded yet


_decoder = msgspec.json.Decoder(_Line)


def _line_error(number: int, message: str, param: str, code: str | None = None) -> GatewayError:
    return invalid_request(f"line {number} of the file: {message}", param=param, code=code)


def parse_lines(
    content: bytes, *, max_lines: int, max_line_bytes: int, param: str = "file"
) -> list[InputLine]:
    """Every request of the file, in order; 400 naming the first malformed line (`param`: the
    request field that named the file). Blank lines are skipped. A line is at most
    `max_line_bytes` (the request body limit of the endpoint it names)."""
    try:
        content.decode()
    except UnicodeDecodeError as exc:
        raise invalid_request(
            f"the file is not UTF-8 text (byte {exc.start}); a batch file is JSON Lines",
            param=param,
        ) from exc
    lines: list[InputLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            raise _line_error(
                number,
                f"{len(raw)} bytes; a request takes at most {max_line_bytes} bytes (the body "
                "limit of the endpoint it names)",
                param,
                "request_too_large",
            )
        if len(lines) == max_lines:
            raise invalid_request(
                f"the file has more than {max_lines} requests; this gateway takes at most "
                f"{max_lines} per batch",
                param=param,
                code="batch_too_large",
            )
        line = _parse(number, raw, param)
        if line.custom_id in seen:
            raise _line_error(
                number,
                f"custom_id '{line.custom_id}' is also the custom_id of line "
                f"{seen[line.custom_id]}; custom_ids must be unique in a batch",
                param,
            )
        seen[line.custom_id] = number
        lines.append(line)
    if not lines:
        raise invalid_request("the file holds no request; a batch needs at least one", param=param)
    return lines


def _parse(number: int, raw: bytes, param: str) -> InputLine:
    try:
        line = client_json.decode_with(_decoder, raw)
    except msgspec.ValidationError as exc:
        raise _line_error(
            number,
            f'{exc}; each line is {{"custom_id", "method", "url", "body"}}',
            param,
        ) from exc
    except msgspec.DecodeError as exc:
        raise _line_error(number, f"not valid JSON: {exc}", param) from exc
    if line.method != "POST":
        raise _line_error(number, f"method must be POST, got '{line.method}'", param)
    if line.url not in ENDPOINTS:
        raise _line_error(
            number,
            f"url '{line.url}' is not an endpoint this gateway batches; use one of "
            f"{', '.join(ENDPOINTS)}",
            param,
        )
    if not bytes(line.body).lstrip().startswith(b"{"):
        raise _line_error(number, "body must be a JSON object (the request's body)", param)
    return InputLine(number, line.custom_id, line.url, line.body)
