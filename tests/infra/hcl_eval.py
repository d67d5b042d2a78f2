"""Evaluates Terraform expressions from python-hcl2 parse trees, with Terraform's semantics for
the subset this repository's configuration uses (maps iterate in key order, numbers print
without a fraction when whole, `can`/`try` catch errors, object types fill optional defaults).

Anything outside that subset raises HclError, so a check never passes on a guess.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lark import Token, Tree

from tests.infra.hcl_functions import FUNCTIONS, to_number, to_string
from tests.infra.hcl_tree import (
    HclError,
    heredoc_text,
    name_of,
    parse_expression,
    subtrees,
    template_parts,
)

Value = Any

_BINARY: dict[str, Callable[[Value, Value], Value]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: to_number(a) < to_number(b),
    ">": lambda a, b: to_number(a) > to_number(b),
    "<=": lambda a, b: to_number(a) <= to_number(b),
    ">=": lambda a, b: to_number(a) >= to_number(b),
    "+": lambda a, b: to_number(a) + to_number(b),
    "-": lambda a, b: to_number(a) - to_number(b),
    "*": lambda a, b: to_number(a) * to_number(b),
    "/": lambda a, b: to_number(a) / to_number(b),
    "%": lambda a, b: to_number(a) % to_number(b),
}


def normalize(value: Value) -> Value:
    """Whole floats become ints, as Terraform prints them."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")


def _unescape(raw: str) -> str:
    """HCL string escapes: \\n \\r \\t \\" \\\\ \\uNNNN \\UNNNNNNNN."""

    def one(match: re.Match[str]) -> str:
        code = match.group(1)
        if code[0] in "uU" and len(code) > 1:
            return chr(int(code[1:], 16))
        if code not in _ESCAPES:
            raise HclError(f"unknown escape \\{code} in a string")
        return _ESCAPES[code]

    return _ESCAPE.sub(one, raw)


@dataclass
class Evaluator:
    """Evaluates expressions of one module: `var`, `local` (lazily, from `locals`), `module`
    (outputs supplied by the caller), `path.module` and anything else passed in `roots`."""

    variables: Mapping[str, Value] = field(default_factory=dict)
    locals: Mapping[str, Tree] = field(default_factory=dict)
    modules: Mapping[str, Value] = field(default_factory=dict)
    directory: Path = Path(".")
    roots: Mapping[str, Value] = field(default_factory=dict)
    _local_values: dict[str, Value] = field(default_factory=dict)
    _evaluating: set[str] = field(default_factory=set)

    def local(self, name: str) -> Value:
        if name in self._local_values:
            return self._local_values[name]
        if name not in self.locals:
            raise HclError(f"local.{name} is not declared")
        if name in self._evaluating:
            raise HclError(f"local.{name} refers to itself")
        self._evaluating.add(name)
        try:
            value = self.evaluate(self.locals[name])
        finally:
            self._evaluating.discard(name)
        self._local_values[name] = value
        return value

    def evaluate(self, tree: Tree, scope: Mapping[str, Value] | None = None) -> Value:
        return normalize(self._eval(tree, dict(scope or {})))

    def render_template(self, text: str, scope: Mapping[str, Value]) -> str:
        parts = template_parts(text)
        return "".join(
            p if isinstance(p, str) else to_string(self._eval(p, dict(scope))) for p in parts
        )

    # ---- tree walking ------------------------------------------------------------------------

    def _eval(self, tree: Tree, scope: dict[str, Value]) -> Value:
        handler = getattr(self, f"_eval_{tree.data}", None)
        if handler is None:
            raise HclError(f"unsupported expression: {tree.data}")
        return handler(tree, scope)

    def _eval_expr_term(self, tree: Tree, scope: dict[str, Value]) -> Value:
        return self._eval(subtrees(tree)[0], scope)

    def _eval_int_lit(self, tree: Tree, scope: dict[str, Value]) -> Value:
        return int(str(tree.children[0]))

    def _eval_float_lit(self, tree: Tree, scope: dict[str, Value]) -> Value:
        return normalize(float(str(tree.children[0])))

    def _eval_literal_value(self, tree: Tree, scope: dict[str, Value]) -> Value:
        return {"true": True, "false": False, "null": None}[str(tree.children[0])]

    def _eval_string(self, tree: Tree, scope: dict[str, Value]) -> Value:
        out: list[str] = []
        for part in subtrees(tree):
            for child in part.children:
                if isinstance(child, Token):
                    text = str(child)
                    out.append(text[1:] if child.type.startswith("ESCAPED_") else _unescape(text))
                elif child.data == "interpolation":
                    out.append(to_string(self._eval(subtrees(child)[0], scope)))
                else:
                    raise HclError("template directives in strings are not supported")
        return "".join(out)

    def _eval_heredoc_template(self, tree: Tree, scope: dict[str, Value]) -> Value:
        return self.render_template(heredoc_text(tree), scope)

    _eval_heredoc_template_trim = _eval_heredoc_template

    def _eval_tuple(self, tree: Tree, scope: dict[str, Value]) -> Value:
        return [self._eval(item, scope) for item in subtrees(tree)]

    def _eval_object(self, tree: Tree, scope: dict[str, Value]) -> Value:
        result: dict[str, Value] = {}
        for element in subtrees(tree):
            key_tree, value_tree = subtrees(element)
            key_expr = subtrees(key_tree)[0]
            bare = subtrees(key_expr)
            if key_expr.data in ("identifier", "keyword"):
                key = name_of(key_expr)
            elif key_expr.data == "expr_term" and bare and bare[0].data == "identifier":
                key = name_of(bare[0])
            else:
                key = to_string(self._eval(key_expr, scope))
            result[key] = self._eval(value_tree, scope)
        return result

    def _eval_identifier(self, tree: Tree, scope: dict[str, Value]) -> Value:
        name = name_of(tree)
        if name in scope:
            return scope[name]
        if name in self.roots:
            return self.roots[name]
        if name == "var":
            return self.variables
        if name == "module":
            return self.modules
        if name == "path":
            return {"module": str(self.directory)}
        raise HclError(f"cannot evaluate a reference to {name!r} here")

    def _eval_conditional(self, tree: Tree, scope: dict[str, Value]) -> Value:
        condition, yes, no = subtrees(tree)
        chosen = self._eval(condition, scope)
        if not isinstance(chosen, bool):
            raise HclError(f"a condition must be a bool, got {chosen!r}")
        return self._eval(yes if chosen else no, scope)

    def _eval_binary_op(self, tree: Tree, scope: dict[str, Value]) -> Value:
        left_tree, term = subtrees(tree)
        operator_tree, right_tree = subtrees(term)
        operator = str(operator_tree.children[0])
        left = self._eval(left_tree, scope)
        if operator in ("&&", "||"):
            right = self._eval(right_tree, scope)
            if not (isinstance(left, bool) and isinstance(right, bool)):
                raise HclError(f"{operator} needs bools, got {left!r} and {right!r}")
            return (left and right) if operator == "&&" else (left or right)
        return normalize(_BINARY[operator](left, self._eval(right_tree, scope)))

    def _eval_unary_op(self, tree: Tree, scope: dict[str, Value]) -> Value:
        operator = str(tree.children[0])
        value = self._eval(subtrees(tree)[0], scope)
        if operator == "!":
            if not isinstance(value, bool):
                raise HclError(f"! needs a bool, got {value!r}")
            return not value
        return -to_number(value)

    def _eval_function_call(self, tree: Tree, scope: dict[str, Value]) -> Value:
        name_tree, *rest = subtrees(tree)
        name = name_of(name_tree)
        arguments = subtrees(rest[0]) if rest else []
        if any(isinstance(c, Token) and c.type == "ELLIPSIS" for r in rest for c in r.children):
            raise HclError("argument expansion (...) is not supported")
        if name in ("can", "try"):
            return self._guarded(name, arguments, scope)
        if name == "templatefile":
            path, variables = (self._eval(a, scope) for a in arguments)
            return self.render_template(Path(path).read_text(), variables)
        function = FUNCTIONS.get(name)
        if function is None:
            raise HclError(f"function {name}() is not supported by these checks")
        return function(*(self._eval(a, scope) for a in arguments))

    def _guarded(self, name: str, arguments: list[Tree], scope: dict[str, Value]) -> Value:
        for argument in arguments:
            try:
                value = self._eval(argument, scope)
            except (HclError, KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
                continue
            return True if name == "can" else value
        if name == "can":
            return False
        raise HclError("no argument of try() could be evaluated")

    def _eval_for_tuple_expr(self, tree: Tree, scope: dict[str, Value]) -> Value:
        intro, body, *condition = subtrees(tree)
        return [
            self._eval(body, inner)
            for inner in self._iterations(intro, scope)
            if not condition or self._condition(condition[0], inner)
        ]

    def _eval_for_object_expr(self, tree: Tree, scope: dict[str, Value]) -> Value:
        if any(isinstance(c, Token) and c.type == "ELLIPSIS" for c in tree.children):
            raise HclError("grouping (...) in for expressions is not supported")
        intro, key_tree, value_tree, *condition = subtrees(tree)
        result: dict[str, Value] = {}
        for inner in self._iterations(intro, scope):
            if condition and not self._condition(condition[0], inner):
                continue
            key = to_string(self._eval(key_tree, inner))
            if key in result:
                raise HclError(f"duplicate key {key!r} in a for expression")
            result[key] = self._eval(value_tree, inner)
        return result

    def _iterations(self, intro: Tree, scope: dict[str, Value]) -> list[dict[str, Value]]:
        parts = subtrees(intro)
        names = [name_of(p) for p in parts[:-1]]
        collection = self._eval(parts[-1], scope)
        if isinstance(collection, dict):
            pairs: list[tuple[Value, Value]] = [(k, collection[k]) for k in sorted(collection)]
        elif isinstance(collection, list):
            pairs = list(enumerate(collection))
        else:
            raise HclError(f"cannot iterate over {collection!r}")
        if len(names) == 1:
            return [{**scope, names[0]: value} for _, value in pairs]
        return [{**scope, names[0]: key, names[1]: value} for key, value in pairs]

    def _condition(self, condition: Tree, scope: dict[str, Value]) -> bool:
        value = self._eval(subtrees(condition)[0], scope)
        if not isinstance(value, bool):
            raise HclError(f"a for expression's if needs a bool, got {value!r}")
        return value

    # ---- access chains -----------------------------------------------------------------------

    def _eval_get_attr_expr_term(self, tree: Tree, scope: dict[str, Value]) -> Value:
        base_tree, access = subtrees(tree)
        name = name_of(subtrees(access)[0])
        inner = subtrees(base_tree)
        if base_tree.data == "expr_term" and inner and inner[0].data == "identifier":
            root = name_of(inner[0])
            if root == "local" and root not in scope:
                return self.local(name)
        return _attribute(self._eval(base_tree, scope), name)

    def _eval_index_expr_term(self, tree: Tree, scope: dict[str, Value]) -> Value:
        base_tree, index = subtrees(tree)
        return _index(self._eval(base_tree, scope), self._index_key(index, scope))

    def _index_key(self, index: Tree, scope: dict[str, Value]) -> Value:
        if index.data == "short_index":
            return int(str(index.children[-1]))
        return self._eval(subtrees(index)[0], scope)

    def _eval_full_splat_expr_term(self, tree: Tree, scope: dict[str, Value]) -> Value:
        base_tree, splat = subtrees(tree)
        base = self._eval(base_tree, scope)
        items = [] if base is None else base if isinstance(base, list) else [base]
        return [self._apply_steps(item, subtrees(splat), scope) for item in items]

    _eval_attr_splat_expr_term = _eval_full_splat_expr_term

    def _apply_steps(self, value: Value, steps: list[Tree], scope: dict[str, Value]) -> Value:
        for step in steps:
            if step.data == "get_attr":
                value = _attribute(value, name_of(subtrees(step)[0]))
            else:
                value = _index(value, self._index_key(step, scope))
        return value


def _attribute(value: Value, name: str) -> Value:
    if not isinstance(value, dict):
        raise HclError(f"cannot read attribute {name!r} of {type(value).__name__}")
    if name not in value:
        raise HclError(f"no attribute {name!r} (has {sorted(value)})")
    return value[name]


def _index(value: Value, key: Value) -> Value:
    if isinstance(value, dict):
        if to_string(key) not in value:
            raise HclError(f"no key {key!r} (has {sorted(value)})")
        return value[to_string(key)]
    if isinstance(value, list):
        position = to_number(key)
        if not (isinstance(position, int) and 0 <= position < len(value)):
            raise HclError(f"index {key!r} out of range for {len(value)} elements")
        return value[position]
    raise HclError(f"cannot index {type(value).__name__}")


def literal(tree: Tree) -> Value:
    """A constant expression (a .tfvars value, a default)."""
    return Evaluator().evaluate(tree)


def expression(text: str, **roots: Value) -> Value:
    """Evaluates one expression written as text, e.g. in the evaluator's own tests."""
    return Evaluator(roots=roots).evaluate(parse_expression(text))
