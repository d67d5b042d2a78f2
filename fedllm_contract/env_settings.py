"""Settings read from environment variables: the one reader the gateway and the site engine share.

A settings class is a frozen dataclass with an `ENV_PREFIX` class variable. Each field is read
from `ENV_PREFIX + NAME`, NAME being the field's name upper-cased unless `setting(env=...)` names
it; a field whose type is itself such a dataclass is a group, read the same way under its own
prefix. A variable that is unset or empty leaves the field's default; a set one is converted by
the field's annotation (str, int, float, bool, Path, a Literal of strings, or any of these or
None) and refused loudly, naming the variable, when it does not convert. Checks on the values
themselves belong to each class's `__post_init__`, so a directly built instance is held to them
too. A flat class may also be given command-line flags (`add_flags`): one per field, named,
typed and explained by the field as its variable is.
"""

from __future__ import annotations

import argparse
import re
import types
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import (
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class EnvSettings(Protocol):
    """A settings dataclass: its fields are read from variables named `ENV_PREFIX` + NAME."""

    ENV_PREFIX: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]


S = TypeVar("S", bound=EnvSettings)


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the variable."""


def setting(
    default: Any = MISSING,
    *,
    help: str,
    env: str | None = None,
    shown_default: str | None = None,
    flag: str | None = None,
) -> Any:
    """A field read from a variable. `help` says what it does, in Markdown (the README's
    settings table is generated from it); `env` names the variable after the class's prefix
    when the field's own name would not; `shown_default` describes a default that the reader's
    caller derives; `flag` names its command-line flag when `--field-name` would not."""
    metadata = {"help": help, "env": env, "shown_default": shown_default, "flag": flag}
    return field(default=default, metadata=metadata)


def variable(cls: type[EnvSettings], name: str) -> str:
    """The environment variable that field `name` of settings class `cls` is read from."""
    for item in fields(cls):
        if item.name == name:
            return f"{cls.ENV_PREFIX}{(item.metadata.get('env') or name).upper()}"
    raise AttributeError(f"{cls.__name__} has no setting {name!r}")


@dataclass(frozen=True, slots=True)
class Variable:
    """One environment variable a settings class reads, as the documentation shows it."""

    name: str
    path: tuple[str, ...]  # attribute path from the top class: ("batches", "max_items")
    default: str  # Markdown
    help: str  # Markdown


def require_positive(settings: EnvSettings, *names: str) -> None:
    """SettingsError naming the variable of the first of `names` that is not > 0."""
    for name in names:
        if getattr(settings, name) <= 0:
            raise SettingsError(f"{variable(type(settings), name)} must be > 0")


def require_at_least(settings: EnvSettings, least: int, *names: str) -> None:
    """SettingsError naming the variable of the first of `names` below `least`."""
    for name in names:
        if getattr(settings, name) < least:
            raise SettingsError(f"{variable(type(settings), name)} must be >= {least}")


def variables(cls: type[EnvSettings]) -> Iterator[Variable]:
    """Every variable `cls` and its groups read, in field order."""
    yield from _variables(cls, ())


def _variables(cls: type[EnvSettings], path: tuple[str, ...]) -> Iterator[Variable]:
    hints = get_type_hints(cls)
    for item in fields(cls):
        hint = hints[item.name]
        if _is_group(hint):
            yield from _variables(hint, (*path, item.name))
            continue
        shown = item.metadata.get("shown_default") or _shown(item.default)
        help_text = item.metadata.get("help", "")
        yield Variable(variable(cls, item.name), (*path, item.name), shown, help_text)


def add_flags(parser: argparse.ArgumentParser, cls: type[EnvSettings]) -> None:
    """A flag for each field of `cls` (a class without groups) that overrides its variable:
    `--field-name` unless `setting(flag=...)` names it, typed by the field's annotation (a
    bool as `--name` and `--no-name`, a Literal's choices), helped by its Markdown made plain,
    with the variable and the default. A flag not given parses to None, which leaves the
    variable's value (`read_env` + the given flags, then `build`)."""
    hints = get_type_hints(cls)
    for item, var in zip(fields(cls), variables(cls), strict=True):
        hint = _without_none(hints[item.name])
        if _is_group(hint):
            raise TypeError(f"{cls.__name__}.{item.name}: a group has no flags")
        shown = plain(var.default).replace("%", "%%")
        helped = f"{plain(var.help).replace('%', '%%')} ({var.name}; default {shown})"
        options: dict[str, Any] = {"dest": item.name, "default": None, "help": helped}
        if hint is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif get_origin(hint) is Literal:
            options["choices"] = get_args(hint)
        elif hint in (int, float, Path):
            options["type"] = hint
        elif hint is not str:
            raise TypeError(f"{cls.__name__}.{item.name}: no flag for {hint!r}")
        parser.add_argument(flag_names(cls, item.name)[0], **options)


def plain(markdown: str) -> str:
    """A help text's Markdown as a terminal shows it: links as their text, no code marks."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "")


def flag_names(cls: type[EnvSettings], name: str) -> tuple[str, ...]:
    """The flags `add_flags` gives field `name` of `cls`: a bool's two, any other's one."""
    item = next(item for item in fields(cls) if item.name == name)
    flag = item.metadata.get("flag") or "--" + name.replace("_", "-")
    if _without_none(get_type_hints(cls)[name]) is bool:
        return flag, f"--no-{flag[2:]}"
    return (flag,)


def read_env(cls: type[EnvSettings], environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields of `cls` whose variables are set, converted; groups as nested dicts (a group
    with nothing set is left out). Pass the result, adjusted, to `build`."""
    values: dict[str, Any] = {}
    hints = get_type_hints(cls)
    for item in fields(cls):
        hint = hints[item.name]
        if _is_group(hint):
            group = read_env(hint, environ)
            if group:
                values[item.name] = group
            continue
        name = variable(cls, item.name)
        raw = environ.get(name)
        if raw is not None and raw != "":
            values[item.name] = convert(name, hint, raw)
    return values


def build(cls: type[S], values: Mapping[str, Any]) -> S:
    """An instance of `cls` from `values` as `read_env` gives them: each group from its nested
    dict, every field not given from its default. Each class's `__post_init__` checks it."""
    hints = get_type_hints(cls)
    given = dict(values)
    for item in fields(cls):
        hint = hints[item.name]
        if _is_group(hint) and isinstance(given.get(item.name, {}), Mapping):
            given[item.name] = build(hint, given.get(item.name, {}))
    return cls(**given)


def convert(name: str, hint: Any, raw: str) -> Any:
    """`raw`, the value of variable `name`, as the type `hint` says."""
    hint = _without_none(hint)
    if hint is bool:
        if raw.lower() in TRUE_WORDS:
            return True
        if raw.lower() in FALSE_WORDS:
            return False
        raise SettingsError(f"{name} must be true or false, got {raw!r}")
    if hint is int:
        try:
            return int(raw)
        except ValueError as exc:
            raise SettingsError(f"{name} must be an integer, got {raw!r}") from exc
    if hint is float:
        try:
            return float(raw)
        except ValueError as exc:
            raise SettingsError(f"{name} must be a number, got {raw!r}") from exc
    if hint is Path:
        return Path(raw)
    if hint is str or get_origin(hint) is Literal:  # a Literal's choices: __post_init__ checks
        return raw
    raise TypeError(f"{name}: no conversion from an environment variable to {hint!r}")


def _without_none(hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        others = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(others) == 1:
            return others[0]
    return hint


def _is_group(hint: Any) -> bool:
    return isinstance(hint, type) and is_dataclass(hint) and hasattr(hint, "ENV_PREFIX")


def _shown(default: Any) -> str:
    """The default as Markdown: the value as one would set it, in code font."""
    if default is MISSING:
        return "(required)"
    if default is None:
        return "(none)"
    if isinstance(default, bool):
        return "`true`" if default else "`false`"
    if isinstance(default, float):
        return f"`{default:g}`"
    return f"`{default}`"
