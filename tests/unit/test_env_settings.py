"""The shared environment reader (fedllm_contract/env_settings.py), on settings classes of its
own."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from fedllm_contract.env_settings import (
    SettingsError,
    build,
    convert,
    read_env,
    setting,
    variable,
    variables,
)


@dataclass(frozen=True, slots=True)
class Limits:
    ENV_PREFIX: ClassVar[str] = "TEST_LIMIT_"

    items: int = setting(10, help="most items")
    flag: bool = setting(False, env="FLAG_ON", help="a flag named otherwise")

    def __post_init__(self) -> None:
        if self.items < 1:
            raise SettingsError(f"{variable(type(self), 'items')} must be >= 1")


@dataclass(frozen=True, slots=True)
class Top:
    ENV_PREFIX: ClassVar[str] = "TEST_"

    file: Path = setting(help="required")
    mode: Literal["a", "b"] = setting("a", help="a literal")
    ratio: float = setting(0.5, help="a float")
    cert: Path | None = setting(None, help="optional path")
    limits: Limits = field(default_factory=Limits)


@pytest.mark.parametrize(
    ("hint", "raw", "value"),
    [
        (int, "42", 42),
        (float, "2.5", 2.5),
        (bool, "yes", True),
        (bool, "OFF", False),
        (str, "x y", "x y"),
        (Path, "/a/b", Path("/a/b")),
        (Path | None, "/a", Path("/a")),
        (Literal["a", "b"], "c", "c"),  # choices are __post_init__'s to check, naming the variable
    ],
)
def test_values_convert_by_annotation(hint: Any, raw: str, value: object) -> None:
    assert convert("V", hint, raw) == value


@pytest.mark.parametrize(
    ("hint", "raw", "message"),
    [
        (int, "4.5", "V must be an integer, got '4.5'"),
        (float, "fast", "V must be a number, got 'fast'"),
        (bool, "maybe", "V must be true or false, got 'maybe'"),
    ],
)
def test_values_that_do_not_convert_name_the_variable(hint: Any, raw: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        convert("V", hint, raw)


def test_an_annotation_without_a_conversion_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="V: no conversion"):
        convert("V", list[int], "1,2")


def test_groups_read_under_their_prefix_and_unset_or_empty_keeps_the_default() -> None:
    env = {
        "TEST_FILE": "f.json",
        "TEST_RATIO": "",
        "TEST_LIMIT_ITEMS": "3",
        "TEST_LIMIT_FLAG_ON": "1",
    }
    values = read_env(Top, env)
    assert values == {"file": Path("f.json"), "limits": {"items": 3, "flag": True}}
    top = build(Top, values)
    assert (top.ratio, top.cert, top.limits) == (0.5, None, Limits(items=3, flag=True))
    assert read_env(Top, {}) == {}  # a group with nothing set is left out
    assert build(Top, {"file": Path("f")}).limits == Limits()


def test_a_groups_own_checks_name_its_variable() -> None:
    with pytest.raises(SettingsError, match="TEST_LIMIT_ITEMS must be >= 1"):
        build(Top, read_env(Top, {"TEST_FILE": "f", "TEST_LIMIT_ITEMS": "0"}))


def test_variables_list_every_leaf_in_field_order_with_its_default_and_help() -> None:
    listed = [(v.name, v.path, v.default, v.help) for v in variables(Top)]
    assert listed == [
        ("TEST_FILE", ("file",), "(required)", "required"),
        ("TEST_MODE", ("mode",), "`a`", "a literal"),
        ("TEST_RATIO", ("ratio",), "`0.5`", "a float"),
        ("TEST_CERT", ("cert",), "(none)", "optional path"),
        ("TEST_LIMIT_ITEMS", ("limits", "items"), "`10`", "most items"),
        ("TEST_LIMIT_FLAG_ON", ("limits", "flag"), "`false`", "a flag named otherwise"),
    ]
    with pytest.raises(AttributeError, match="no setting 'nothing'"):
        variable(Top, "nothing")
