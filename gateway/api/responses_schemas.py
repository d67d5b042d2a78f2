"""Wire schemas of the Responses API (msgspec): the request (gateway/responses/request.py), the
`response` object (gateway/responses/result.py) and the items (gateway/responses/items.py) are
the responses package's own; here are the list and deletion objects and the request's decoding,
which refuses an unknown field by name."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.api.body import decode_naming_unknown
from gateway.responses.items import Item
from gateway.responses.request import ResponseCreateRequest as ResponseCreateRequest
from gateway.responses.result import ResponseObject as ResponseObject


def decode_response_request(body: bytes) -> ResponseCreateRequest:
    return decode_naming_unknown(body, ResponseCreateRequest)


class InputItemList(msgspec.Struct):
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class ResponseDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    object: Literal["response"] = "response"
