"""A request's options (fedllm_contract/request_options.py) on site.proto's wire: the one codec
of the two gRPC adapters (gateway/sites/grpc_client.py writes, site_engine/grpc_server.py reads),
so a message built by one is read back field for field by the other.

Field-driven: each field of RequestOptions is the field of the same name in SamplingParams, or
else in GenerateRequest. Scalars, repeated scalars, optional fields (None: unset) and enums
(PRIORITY_<member>) map by their kind; only message-typed fields (logit_bias, constraint) have
their own converters. A new option needs nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from enum import Enum
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from fedllm_contract.grammar import ConstraintSpec
from fedllm_contract.priority import Priority
from fedllm_contract.proto import site_pb2
from fedllm_contract.request_options import RequestOptions

_SAMPLING_FIELDS = site_pb2.SamplingParams.DESCRIPTOR.fields_by_name
# proto3 sends 0 for a field nobody set: for these, 0 is no valid value, so it reads as the
# option's default (an older gateway that never set them).
_ZERO_IS_UNSET = frozenset({"top_p", "n", "repetition_penalty"})


def constraint_to_proto(spec: ConstraintSpec) -> site_pb2.Constraint:
    if spec.kind == "json_object":
        return site_pb2.Constraint(json_object=True)
    if spec.kind == "json_schema":
        return site_pb2.Constraint(json_schema=spec.schema)
    tagged = site_pb2.TaggedJson(
        begin=spec.begin,
        end=spec.end,
        json_schema=spec.schema,
        min_items=spec.min_items,
        max_items=spec.max_items,
        separator=spec.separator,
    )
    return site_pb2.Constraint(tagged_json=tagged)


def constraint_from_proto(constraint: site_pb2.Constraint) -> ConstraintSpec:
    """Raises ValueError for a constraint of no kind this side knows."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        return ConstraintSpec("json_schema", schema=constraint.json_schema)
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "tagged_json":
        tagged = constraint.tagged_json
        return ConstraintSpec(
            "tagged_json",
            schema=tagged.json_schema,
            begin=tagged.begin,
            end=tagged.end,
            separator=tagged.separator,
            min_items=tagged.min_items,
            max_items=tagged.max_items,
        )
    raise ValueError("the constraint has no kind this site knows")


def _write_logit_bias(holder: Any, value: tuple[tuple[int, float], ...]) -> None:
    holder.logit_bias.extend(site_pb2.LogitBias(token_id=t, bias=b) for t, b in value)


def _write_constraint(holder: Any, value: ConstraintSpec) -> None:
    holder.constraint.CopyFrom(constraint_to_proto(value))


def _read_logit_bias(holder: Any) -> tuple[tuple[int, float], ...]:
    return tuple((entry.token_id, entry.bias) for entry in holder.logit_bias)


def _read_constraint(holder: Any) -> ConstraintSpec:
    return constraint_from_proto(holder.constraint)


# The message-typed fields: their converters (scalars, repeated scalars and enums need none).
_WRITE: dict[str, Callable[[Any, Any], None]] = {
    "logit_bias": _write_logit_bias,
    "constraint": _write_constraint,
}
_READ: dict[str, Callable[[Any], object]] = {
    "logit_bias": _read_logit_bias,
    "constraint": _read_constraint,
}


def _holder(request: site_pb2.GenerateRequest, name: str) -> Message:
    return request.sampling if name in _SAMPLING_FIELDS else request


def _enum_prefix(descriptor: FieldDescriptor) -> str:
    return descriptor.name.upper() + "_"


def options_to_proto(options: RequestOptions, request: site_pb2.GenerateRequest) -> None:
    """Writes the options into `request` (its sampling message and its own fields)."""
    for field in fields(RequestOptions):
        value = getattr(options, field.name)
        if value is None:
            continue  # an optional field left unset
        holder: Any = _holder(request, field.name)
        descriptor = holder.DESCRIPTOR.fields_by_name[field.name]
        if field.name in _WRITE:
            _WRITE[field.name](holder, value)
        elif isinstance(value, Enum):
            number = descriptor.enum_type.values_by_name[_enum_prefix(descriptor) + value.name]
            setattr(holder, field.name, number.number)
        elif descriptor.is_repeated:
            getattr(holder, field.name).extend(value)
        else:
            setattr(holder, field.name, value)


def _read(holder: Any, descriptor: FieldDescriptor, default: object) -> object:
    value = getattr(holder, descriptor.name)
    if isinstance(default, Enum) and descriptor.enum_type is not None:
        known = descriptor.enum_type.values_by_number.get(value)
        if known is None:
            raise ValueError(f"{descriptor.name} {value} is not one this site knows")
        return type(default)[known.name.removeprefix(_enum_prefix(descriptor))]
    if descriptor.is_repeated:
        return tuple(value)
    return value


def options_from_proto(request: site_pb2.GenerateRequest) -> RequestOptions:
    """The options a request carries; fields it leaves unset keep their defaults. Raises
    ValueError for a value this side cannot read (a constraint or priority it does not know)."""
    values: dict[str, object] = {}
    for field in fields(RequestOptions):
        holder: Any = _holder(request, field.name)
        descriptor = holder.DESCRIPTOR.fields_by_name[field.name]
        if descriptor.has_presence and not holder.HasField(field.name):
            continue
        if field.name in _READ:
            value = _READ[field.name](holder)
        else:
            value = _read(holder, descriptor, field.default)
        if field.name in _ZERO_IS_UNSET and not value:
            continue
        values[field.name] = value
    return RequestOptions(**values)  # type: ignore[arg-type]


def priority_to_proto(priority: Priority) -> site_pb2.Priority.ValueType:
    """site.proto's PRIORITY_<member> of a class (a load report's per-class entries)."""
    return site_pb2.Priority.Value(f"PRIORITY_{priority.name}")


def priority_from_proto(value: int) -> Priority | None:
    """The class of a wire value; None for one this side does not know (a newer peer's)."""
    try:
        return Priority[site_pb2.Priority.Name(value).removeprefix("PRIORITY_")]  # type: ignore[arg-type]
    except (KeyError, ValueError):
        return None
