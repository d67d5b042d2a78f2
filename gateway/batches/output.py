"""A batch's results as OpenAI's output and error files: one JSON line per item,
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.

An answered item goes to the output file with its completion as the body; an item its endpoint
failed goes to the error file with the status and error body the endpoint would have answered;
an item stopped before it finished (batch cancelled, completion window passed) goes to the
error file with no response and `error: {code, message}`, as OpenAI writes such lines.
"""

from __future__ import annotations

import hashlib

import msgspec

from gateway.batches.finalize import ResultFile
from gateway.batches.records import FinalItem
from gateway.db.models import BatchItemStatus


class LineResponse(msgspec.Struct):
    status_code: int
    request_id: str | None
    body: dict[str, object]


class LineError(msgspec.Struct):
    code: str | None
    message: str


class OutputLine(msgspec.Struct):
    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None


_encoder = msgspec.json.Encoder()


def line_id(batch_id: str, index: int) -> str:
    """The line's id: the same however often the files are written (a finalize that started
    over after its gateway died writes the same lines)."""
    digest = hashlib.sha256(f"{batch_id}/{index}".encode()).hexdigest()[:32]
    return f"batch_req_{digest}"


def output_line(batch_id: str, item: FinalItem) -> OutputLine:
    error = item.error or {}
    response: LineResponse | None = None
    stopped: LineError | None = None
    if item.status == BatchItemStatus.COMPLETED and item.completion is not None:
        response = LineResponse(200, item.request_id, item.completion)
    elif item.status_code is not None:
        response = LineResponse(item.status_code, item.request_id, {"error": error})
    else:
        code = error.get("code")
        stopped = LineError(
            code if isinstance(code, str) else None,
            str(error.get("message", f"the request ended {item.status.value}")),
        )
    return OutputLine(line_id(batch_id, item.index), item.custom_id, response, stopped)


def render(batch_id: str, item: FinalItem) -> tuple[ResultFile, bytes]:
    """Which file the item's line goes to, and the line."""
    line = output_line(batch_id, item)
    answered = line.response is not None and line.response.status_code == 200
    return ("output" if answered else "error"), _encoder.encode(line) + b"\n"
