"""Terraform's type conversion for variable values: optional() defaults, primitive conversion,
and refusal of unknown or missing object attributes."""

from __future__ import annotations

from typing import Any

from lark import Tree

from tests.infra.hcl_eval import literal, normalize
from tests.infra.hcl_functions import to_number, to_string
from tests.infra.hcl_tree import HclError, name_of, subtrees

Value = Any


def apply_type(type_tree: Tree, value: Value, where: str = "value") -> Value:
    """Converts a value to a variable's type as Terraform does: fills optional() defaults,
    turns numbers and bools into strings where strings are wanted, and refuses unknown or
    missing object attributes (a typo in a .tfvars file is an error, not a silent drop)."""
    node = type_tree
    while node.data == "expr_term" and len(subtrees(node)) == 1:
        node = subtrees(node)[0]
    if value is None:
        return None
    if node.data == "identifier":
        return _primitive(name_of(node), value, where)
    if node.data != "function_call":
        raise HclError(f"{where}: unsupported type expression {node.data}")
    name_tree, *rest = subtrees(node)
    kind = name_of(name_tree)
    arguments = subtrees(rest[0]) if rest else []
    if kind in ("list", "set"):
        if not isinstance(value, list):
            raise HclError(f"{where}: expected a {kind}, got {value!r}")
        return [apply_type(arguments[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "map":
        if not isinstance(value, dict):
            raise HclError(f"{where}: expected a map, got {value!r}")
        return {k: apply_type(arguments[0], v, f"{where}[{k!r}]") for k, v in value.items()}
    if kind == "object":
        return _object(arguments[0], value, where)
    raise HclError(f"{where}: unsupported type {kind}()")


def _primitive(kind: str, value: Value, where: str) -> Value:
    if kind == "any":
        return value
    if kind == "string" and isinstance(value, str | int | float | bool):
        return to_string(value)
    if kind == "number" and not isinstance(value, bool):
        return normalize(to_number(value))
    if kind == "bool" and isinstance(value, bool):
        return value
    raise HclError(f"{where}: expected {kind}, got {value!r}")


def _object(spec: Tree, value: Value, where: str) -> Value:
    if not isinstance(value, dict):
        raise HclError(f"{where}: expected an object, got {value!r}")
    while spec.data == "expr_term" and len(subtrees(spec)) == 1:
        spec = subtrees(spec)[0]
    attributes: dict[str, tuple[Tree, bool, Tree | None]] = {}
    for element in subtrees(spec):
        key_tree, type_tree = subtrees(element)
        name = name_of(subtrees(subtrees(key_tree)[0])[0])
        inner = type_tree
        while inner.data == "expr_term" and len(subtrees(inner)) == 1:
            inner = subtrees(inner)[0]
        if inner.data == "function_call" and name_of(subtrees(inner)[0]) == "optional":
            optional_args = subtrees(subtrees(inner)[1])
            default = optional_args[1] if len(optional_args) > 1 else None
            attributes[name] = (optional_args[0], True, default)
        else:
            attributes[name] = (type_tree, False, None)
    unknown = sorted(set(value) - set(attributes))
    if unknown:
        raise HclError(f"{where}: unknown attributes {unknown} (allowed: {sorted(attributes)})")
    result: dict[str, Value] = {}
    for name, (type_tree, optional, default) in attributes.items():
        if name in value:
            result[name] = apply_type(type_tree, value[name], f"{where}.{name}")
        elif optional:
            fallback = literal(default) if default is not None else None
            result[name] = apply_type(type_tree, fallback, f"{where}.{name}")
        else:
            raise HclError(f"{where}: missing required attribute {name!r}")
    return result
