"""What a routing profile is made of, as configuration: named parts with parameters. Frozen
values, read once (the built-in profiles in gateway/routing/catalogue.py, or an operator's in the
federation file's `routing_profiles`), validated when the profile is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ParamValue = float | int | str | bool


@dataclass(frozen=True, slots=True)
class PartSettings:
    """A filter, scorer or picker by its registered name, with its parameters; `weight` is a
    scorer's weight in the profile's sum (filters and pickers have none)."""

    name: str
    params: tuple[tuple[str, ParamValue], ...] = ()
    weight: float = 1.0

    @classmethod
    def of(cls, name: str, weight: float = 1.0, **params: ParamValue) -> PartSettings:
        return cls(name, tuple(sorted(params.items())), weight)

    @property
    def param_map(self) -> dict[str, ParamValue]:
        return dict(self.params)


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    name: str
    filters: tuple[PartSettings, ...]
    scorers: tuple[PartSettings, ...] = ()
    picker: PartSettings = field(default_factory=lambda: PartSettings("max_score"))


class Params:
    """A part's parameters with typed reads; a missing one takes its default, a wrong type or an
    unknown name is a ValueError naming the part (`done()` checks for names never read)."""

    def __init__(self, part: str, values: Mapping[str, ParamValue]) -> None:
        self._part = part
        self._values = dict(values)
        self._read: set[str] = set()

    def number(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        self._read.add(key)
        value = self._values.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{self._part}: {key} must be a number, got {value!r}")
        if value < minimum:
            raise ValueError(f"{self._part}: {key} must be >= {minimum:g}, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int | None, *, minimum: int = 0) -> int | None:
        self._read.add(key)
        value = self._values.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self._part}: {key} must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{self._part}: {key} must be >= {minimum}, got {value!r}")
        return value

    def choice(self, key: str, default: str, options: tuple[str, ...]) -> str:
        self._read.add(key)
        value = self._values.get(key, default)
        if value not in options:
            raise ValueError(f"{self._part}: {key} must be one of {options}, got {value!r}")
        return str(value)

    def done(self) -> None:
        unknown = sorted(set(self._values) - self._read)
        if unknown:
            raise ValueError(f"{self._part}: unknown parameters {unknown}")
