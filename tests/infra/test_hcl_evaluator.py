"""The evaluator the deployment checks stand on: Terraform's semantics on the subset in use."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.infra.hcl_eval import expression
from tests.infra.hcl_functions import FunctionError
from tests.infra.hcl_tree import HclError, parse_expression
from tests.infra.hcl_types import apply_type

CASES: list[tuple[str, Any]] = [
    ("1 + 2 * 3", 7),
    ("5 / 2", 2.5),
    ("4 / 2", 2),
    ("-1.5", -1.5),
    ("7 % 4", 3),
    ('"a${1 + 1}b"', "a2b"),
    ('"$${not_interpolated}"', "${not_interpolated}"),
    ('"tab\\tquote\\"backslash\\\\"', 'tab\tquote"backslash\\'),
    ('"\\u00e9t\\u00e9"', "été"),
    ("true && !false", True),
    ("1 == 1.0", True),
    ('"1" == 1', False),
    ('true ? "yes" : "no"', "yes"),
    ("null", None),
    ("[for x in [1, 2, 3] : x * 2 if x > 1]", [4, 6]),
    ("[for k, v in { b = 1, a = 2 } : k]", ["a", "b"]),
    ("{ for k, v in { b = 1, a = 2 } : v => k }", {"2": "a", "1": "b"}),
    ('[for i, x in ["p", "q"] : "${x}${i}"]', ["p0", "q1"]),
    ('{ "quoted" = 1, bare = 2, ("com${"puted"}") = 3 }', {"quoted": 1, "bare": 2, "computed": 3}),
    ("flatten([[1], [2, [3]], []])", [1, 2, 3]),
    ('jsonencode({ b = 1, a = [true, null, 1.5, "x"] })', '{"a":[true,null,1.5,"x"],"b":1}'),
    ('can(regex("^a", "b"))', False),
    ('can(regex("^a", "abc"))', True),
    ('regex("^([a-z]+)-([0-9]+)$", "site-12")', ["site", "12"]),
    ('try(regex("^a", "b"), "fallback")', "fallback"),
    ('cidrhost("10.50.0.0/16", 2)', "10.50.0.2"),
    ('cidrsubnet("10.50.0.0/16", 4, 1)', "10.50.16.0/20"),
    ('coalesce(null, "", "x")', "x"),
    ("merge({ a = 1 }, { a = 2, b = 3 })", {"a": 2, "b": 3}),
    ('lookup({ a = 1 }, "b", 9)', 9),
    ("range(3)", [0, 1, 2]),
    ("range(1, 7, 2)", [1, 3, 5]),
    ('replace("a-b_c", "/[^a-z]/", "")', "abc"),
    ('replace("a.b", ".", "-")', "a-b"),
    ('format("%s=%d %q", "n", 2, "x")', 'n=2 "x"'),
    ("keys({ z = 1, a = 2 })", ["a", "z"]),
    ("values({ z = 1, a = 2 })", [2, 1]),
    ('sort(["b", "a"])', ["a", "b"]),
    ('distinct(["a", "b", "a"])', ["a", "b"]),
    ("sum([1, 2.5])", 3.5),
    ('startswith("europe-west4-a", "europe-west4")', True),
    ('substr("abcdef", 1, 3)', "bcd"),
    ('trimsuffix("1.2.3.4/32", "/32")', "1.2.3.4"),
    ("alltrue([true, true])", True),
    ("alltrue([])", True),
    ('contains(["a"], "a")', True),
    ('length("abc")', 3),
    ('sha1("fedllm")', "7e6273bd540fe8ea614a3c549f776da7a1c84151"),
    ("floor(2.7) == 2", True),
    ('"${2.0}"', "2"),
    ("<<-EOT\n    a ${1 + 1}\n      b\n    EOT\n", "a 2\n  b\n"),
]


@pytest.mark.parametrize(("text", "expected"), CASES, ids=[c[0][:40] for c in CASES])
def test_expressions_evaluate_as_in_terraform(text: str, expected: Any) -> None:
    assert expression(text) == expected


def test_references_resolve_from_the_roots_given() -> None:
    assert expression("x[*].b", x=[{"b": 1}, {"b": 2}]) == [1, 2]
    assert expression("x.a[1]", x={"a": [5, 6]}) == 6
    assert (
        expression(
            'each.value.count == 2 ? "many" : each.key', each={"key": "k", "value": {"count": 1}}
        )
        == "k"
    )


ERRORS = [
    "local.missing",
    "no_such_function(1)",
    'regex("^a", "b")',
    "!1",
    "1 && true",
    "{ for k in [1, 1] : k => k }",
    '"${null}"',
    "[1, 2][5]",
    "{ a = 1 }.b",
]


@pytest.mark.parametrize("text", ERRORS)
def test_what_terraform_refuses_is_refused(text: str) -> None:
    with pytest.raises((HclError, FunctionError)):
        expression(text)


SITE_TYPE = parse_expression(
    "map(object({ cloud = string, count = optional(number, 1), tags = optional(map(string), {}) }))"
)


def test_types_fill_optional_defaults_and_convert_primitives() -> None:
    value = {"a": {"cloud": "aws"}, "b": {"cloud": "gcp", "count": 3, "tags": {"n": 5, "ok": True}}}
    assert apply_type(SITE_TYPE, value) == {
        "a": {"cloud": "aws", "count": 1, "tags": {}},
        "b": {"cloud": "gcp", "count": 3, "tags": {"n": "5", "ok": "true"}},
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"a": {"cloud": "aws", "cuont": 2}}, "unknown attributes ['cuont']"),
        ({"a": {"count": 2}}, "missing required attribute 'cloud'"),
        ({"a": {"cloud": "aws", "count": "many"}}, "could not convert"),
        ({"a": "aws"}, "expected an object"),
    ],
)
def test_types_refuse_what_terraform_would(value: Any, message: str) -> None:
    with pytest.raises((HclError, ValueError), match=re.escape(message)):
        apply_type(SITE_TYPE, value)
