"""JSON that clients send, decoded with msgspec: every decode and conversion of a client's body,
a batch item or an upload line goes through here.

msgspec recurses once per level of nesting and raises RecursionError past what the interpreter
allows (about a thousand levels, fewer deep in a call stack); that error reached clients as a
500 (issue 32). Here it is what it is, malformed input: msgspec's own DecodeError (ValidationError
for a conversion), which every caller already answers with a 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
TOO_DEEP = "the JSON is nested too deeply to be read"


@contextmanager
def _bounded(error: type[msgspec.DecodeError] = msgspec.DecodeError) -> Iterator[None]:
    try:
        yield
    except RecursionError as exc:
        raise error(TOO_DEEP) from exc


def decode(data: bytes, type: type[T]) -> T:
    """`data` decoded as `type`; msgspec.DecodeError for nesting too deep."""
    with _bounded():
        return msgspec.json.decode(data, type=type)


def decode_any(data: bytes) -> Any:
    """`data` decoded into Python objects; msgspec.DecodeError for nesting too deep."""
    with _bounded():
        return msgspec.json.decode(data)


def decode_with(decoder: msgspec.json.Decoder[T], data: bytes) -> T:
    """`data` decoded by `decoder`; msgspec.DecodeError for nesting too deep."""
    with _bounded():
        return decoder.decode(data)


def convert(value: object, type: type[T]) -> T:
    """`value` converted to `type`; msgspec.ValidationError for nesting too deep."""
    with _bounded(msgspec.ValidationError):
        return msgspec.convert(value, type)
