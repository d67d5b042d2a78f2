"""The Terraform built-in functions this repository's configuration uses, with Terraform's
semantics (lexical key order for maps, errors where Terraform errors)."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import math
import re
from collections.abc import Callable
from typing import Any

Value = Any


class FunctionError(ValueError):
    """A function was called with arguments Terraform would refuse."""


def to_number(value: Value) -> int | float:
    if isinstance(value, bool) or value is None:
        raise FunctionError(f"not a number: {value!r}")
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        number = float(value)
        return int(number) if number.is_integer() and "." not in value else number
    raise FunctionError(f"not a number: {value!r}")


def to_string(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value
    raise FunctionError(f"cannot convert {value!r} to a string")


def _jsonable(value: Value) -> Value:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def jsonencode(value: Value) -> str:
    # Terraform writes object keys in lexical order, without spaces.
    return json.dumps(_jsonable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _flatten(value: Value) -> list[Value]:
    if not isinstance(value, list):
        raise FunctionError("flatten() needs a list")
    out: list[Value] = []
    for item in value:
        out.extend(_flatten(item) if isinstance(item, list) else [item])
    return out


def _regex(pattern: str, text: str) -> Value:
    match = re.search(pattern, text)
    if match is None:
        raise FunctionError(f"pattern {pattern!r} does not match {text!r}")
    if match.groupdict():
        return match.groupdict()
    return list(match.groups()) if match.groups() else match.group(0)


def _replace(text: str, search: str, replacement: str) -> str:
    if len(search) > 1 and search.startswith("/") and search.endswith("/"):
        return re.sub(search[1:-1], re.sub(r"\$(\d+)", r"\\\1", replacement), text)
    return text.replace(search, replacement)


def _coalesce(*values: Value) -> Value:
    for value in values:
        if value is not None and value != "":
            return value
    raise FunctionError("coalesce() got no non-null, non-empty argument")


def _range(*arguments: Value) -> list[int]:
    numbers = [int(to_number(a)) for a in arguments]
    return list(range(*numbers))


def _cidrhost(prefix: str, host: Value) -> str:
    network = ipaddress.ip_network(prefix, strict=False)
    number = int(to_number(host))
    if not 0 <= number < network.num_addresses:
        raise FunctionError(f"host number {number} is outside {prefix}")
    return str(network.network_address + number)


def _cidrsubnet(prefix: str, newbits: Value, netnum: Value) -> str:
    network = ipaddress.ip_network(prefix, strict=False)
    subnets = list(network.subnets(prefixlen_diff=int(to_number(newbits))))
    return str(subnets[int(to_number(netnum))])


def _format(pattern: str, *values: Value) -> str:
    remaining = list(values)

    def verb(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        value = remaining.pop(0)
        if match.group(1) == "q":
            return json.dumps(to_string(value))
        if match.group(1) == "d":
            return str(int(to_number(value)))
        return to_string(value)

    return re.sub(r"%%|%([sdvq])", verb, pattern)


def _lookup(mapping: dict[str, Value], key: str, *default: Value) -> Value:
    if key in mapping:
        return mapping[key]
    if default:
        return default[0]
    raise FunctionError(f"lookup(): no key {key!r}")


def _length(value: Value) -> int:
    if isinstance(value, str | list | dict):
        return len(value)
    raise FunctionError(f"length() of {value!r}")


def _all(values: list[Value]) -> bool:
    if not all(isinstance(v, bool) for v in values):
        raise FunctionError("alltrue()/anytrue() need a list of bools")
    return all(values)


def _any(values: list[Value]) -> bool:
    _all([True, *[isinstance(v, bool) for v in values]])
    return any(values)


def _startswith(text: str, prefix: str) -> bool:
    if not isinstance(text, str):
        raise FunctionError("startswith() needs a string")
    return text.startswith(prefix)


FUNCTIONS: dict[str, Callable[..., Value]] = {
    "abs": lambda x: abs(to_number(x)),
    "alltrue": _all,
    "anytrue": _any,
    "base64encode": lambda s: base64.b64encode(s.encode()).decode(),
    "ceil": lambda x: math.ceil(to_number(x)),
    "cidrhost": _cidrhost,
    "cidrsubnet": _cidrsubnet,
    "coalesce": _coalesce,
    "concat": lambda *lists: [item for lst in lists for item in lst],
    "contains": lambda collection, value: value in collection,
    "distinct": lambda values: list(dict.fromkeys(values)),
    "endswith": lambda text, suffix: text.endswith(suffix),
    "flatten": _flatten,
    "floor": lambda x: math.floor(to_number(x)),
    "format": _format,
    "join": lambda separator, values: separator.join(to_string(v) for v in values),
    "jsonencode": jsonencode,
    "keys": lambda mapping: sorted(mapping),
    "length": _length,
    "lookup": _lookup,
    "lower": lambda s: s.lower(),
    "max": lambda *xs: max(to_number(x) for x in xs),
    "merge": lambda *maps: {k: v for m in maps if m is not None for k, v in m.items()},
    "min": lambda *xs: min(to_number(x) for x in xs),
    "range": _range,
    "regex": _regex,
    "replace": _replace,
    "sha1": lambda s: hashlib.sha1(s.encode()).hexdigest(),
    "slice": lambda values, start, end: values[int(start) : int(end)],
    "sort": lambda values: sorted(to_string(v) for v in values),
    "split": lambda separator, text: text.split(separator),
    "startswith": _startswith,
    "substr": lambda text, offset, length: text[offset : None if length < 0 else offset + length],
    "sum": lambda values: sum(to_number(v) for v in values),
    "tonumber": to_number,
    "toset": lambda values: sorted(set(values), key=to_string),
    "tostring": to_string,
    "trimprefix": lambda text, prefix: text.removeprefix(prefix),
    "trimspace": lambda text: text.strip(),
    "trimsuffix": lambda text, suffix: text.removesuffix(suffix),
    "upper": lambda s: s.upper(),
    "values": lambda mapping: [mapping[k] for k in sorted(mapping)],
    "zipmap": lambda keys, values: dict(zip(keys, values, strict=True)),
}
