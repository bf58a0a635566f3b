"""The one validation path of every config section: `ConfigError`, `StrictSection` and `build_section`.

A section is a frozen `StrictSection` dataclass whose `SECTION` is its dotted YAML path. Keyword construction
(`ClippedPGLossConfig(**data)`) and `build_section(cls, data)` (a parsed YAML mapping) run the same checks, once:
every missing or unknown key and every wrongly typed value of the section and the sections it holds, then each
well-typed section's own `conflicts()` (its ranges and cross-field rules). Every problem names `<section>.<key>`,
and all of them come in one `ConfigError`, so a user fixes a config in one round trip. A field with a default
(`ratio_clip_max: float = 0.2`) takes it when its key is absent; a field without one is required.
`to_mapping()` is the inverse of `build_section`: every key, defaults included, as plain data.

This is the bottom of the config layer: it imports nothing of the project and never imports torch, so every
module that defines a section (the run config, the loss's config) can import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar, Union

SectionT = TypeVar("SectionT", bound="StrictSection")


class ConfigError(ValueError):
    """A configuration is incomplete, malformed or self-contradictory. The message names every offending key."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def join_key(path: str, key: str) -> str:
    """`path.key`, or `key` at the root (whose path is empty)."""
    return f"{path}.{key}" if path else key


class _Report:
    """The problems found so far, in tree order; `malformed` counts the missing, unknown and mistyped keys."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.malformed = 0

    def add_malformed(self, problem: str) -> None:
        self.problems.append(problem)
        self.malformed += 1


class StrictSection:
    """Base of the config sections: `@dataclass(frozen=True, init=False)` subclasses with a `SECTION` path.

    A field without a default is a required keyword, one with a default (`dataclasses.field(default=...)` or
    `default_factory=...`) takes it when absent; values are type-checked and converted (a YAML int becomes a
    float, a plain mapping becomes the nested section, a list becomes a tuple). `conflicts()` runs only once every field
    of the section is well typed; a nested section's conflicts do not stop its parent's, so range problems and
    cross-field conflicts of the whole tree are reported together.
    """

    SECTION: ClassVar[str]

    def __init__(self, **values: Any) -> None:
        report = _Report()
        self._fill(values, report)
        if report.problems:
            raise ConfigError(report.problems)

    @classmethod
    def from_mapping(cls: type[SectionT], data: Mapping[str, Any]) -> SectionT:
        """Builds the section from a plain mapping, e.g. one parsed from YAML (same as `build_section`)."""
        return build_section(cls, data)

    def key(self, name: str) -> str:
        """The dotted YAML path of field `name`, as problems name it."""
        return join_key(self.SECTION, name)

    def conflicts(self) -> list[str]:
        """Out-of-range values and contradictory fields, one line each naming the keys involved; none by default."""
        return []

    def to_mapping(self) -> dict[str, Any]:
        """Every key of the section and the sections it holds, defaults included, as plain YAML-ready data (a
        tuple becomes a list); `build_section(type(self), section.to_mapping())` rebuilds an equal section."""
        return {name: _plain(getattr(self, name)) for name in _field_types(type(self))}

    def _fill(self, values: Mapping[str, Any], report: _Report) -> bool:
        """Assigns every field from `values`; false when a key is missing or unknown or a value is mistyped.

        Either way the section's own rules run: with malformed keys, on the well-typed fields, the malformed ones
        standing in at their defaults (a problem that names a malformed key is left out: it is reported already), so
        that a range problem is reported together with a misspelt key. A section whose malformed field has no
        default skips its rules until the field is fixed."""
        fields = _field_types(type(self))
        malformed_before = report.malformed
        for key in values:
            if key not in fields:
                near = difflib.get_close_matches(str(key), fields, n=1)
                hint = f"; did you mean {near[0]}?" if near else ""
                report.add_malformed(f"{self.key(str(key))}: unknown key{hint} (allowed: {', '.join(fields)})")
        defaults = _field_defaults(type(self))
        bad = []
        for name, field_type in fields.items():
            if name not in values:
                if name in defaults:
                    object.__setattr__(self, name, defaults[name]())
                else:
                    report.add_malformed(f"{self.key(name)}: missing key")
                    bad.append(name)
                continue
            before = report.malformed
            object.__setattr__(self, name, _convert(field_type, values[name], self.key(name), report))
            if report.malformed > before:
                bad.append(name)
        if report.malformed == malformed_before:
            report.problems.extend(self.conflicts())
            return True
        if all(name in defaults for name in bad):
            for name in bad:
                object.__setattr__(self, name, defaults[name]())
            named = [re.compile(re.escape(self.key(name)) + r"(?![\w.])") for name in bad]
            report.problems.extend(problem for problem in self.conflicts()
                                   if not any(key.search(problem) for key in named))
        return False


def build_section(cls: type[SectionT], data: Any) -> SectionT:
    """Section `cls` built from a mapping; one ConfigError lists every problem, each named by its dotted key."""
    report = _Report()
    section = _build_section(cls, data, report)
    if report.problems:
        raise ConfigError(report.problems)
    return section


@functools.cache
def _field_types(cls: type[StrictSection]) -> dict[str, Any]:
    """Each field's resolved type, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}  # type: ignore[arg-type]


@functools.cache
def _field_defaults(cls: type[StrictSection]) -> dict[str, Any]:
    """A maker of each defaulted field's default value, by name (a `default_factory` is called per section)."""
    makers = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.default is not dataclasses.MISSING:
            makers[field.name] = functools.partial(lambda value: value, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            makers[field.name] = field.default_factory
    return makers


def _plain(value: Any) -> Any:
    """A field's value as plain data: sections as mappings, tuples as lists."""
    if isinstance(value, StrictSection):
        return value.to_mapping()
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _build_section(cls: type[SectionT], data: Any, report: _Report) -> SectionT | None:
    if isinstance(data, cls):  # already built, so already checked
        return data
    if not isinstance(data, Mapping):
        report.add_malformed(f"{cls.SECTION or '<root>'}: expected a mapping for section {cls.__name__}, got {data!r}")
        return None
    section = cls.__new__(cls)
    return section if section._fill(data, report) else None


def _convert(tp: Any, data: Any, path: str, report: _Report) -> Any:
    """`data` checked against type `tp` and converted to it; problems go to `report`, named by `path`."""
    if isinstance(tp, type) and issubclass(tp, StrictSection):
        return _build_section(tp, data, report)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            trial = _Report()
            value = _convert(option, data, path, trial)
            if not trial.problems:
                return value
        report.add_malformed(f"{path}: expected {_describe(tp)}, got {data!r}")
        return None
    if origin is Literal:
        choices = typing.get_args(tp)
        if data not in choices:
            report.add_malformed(f"{path}: must be one of {', '.join(map(repr, choices))}, got {data!r}")
        return data
    if origin in (dict, Mapping):
        if not isinstance(data, Mapping):
            report.add_malformed(f"{path}: expected a mapping, got {data!r}")
            return data
        return dict(data)
    if origin in (tuple, list):
        if not isinstance(data, (list, tuple)):
            report.add_malformed(f"{path}: expected a list, got {data!r}")
            return data
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_convert(item_tp, item, f"{path}[{i}]", report) for i, item in enumerate(data))
    return _convert_scalar(tp, data, path, report)


def _convert_scalar(tp: Any, data: Any, path: str, report: _Report) -> Any:
    if tp is Any:
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            report.add_malformed(f"{path}: expected a number, got {data!r}")
            return data
        if not math.isfinite(data):  # no key means "unbounded" by inf; a NaN passes every comparison
            report.add_malformed(f"{path}: must be a finite number, got {data!r}")
            return data
        return float(data)
    expected = {int: "an integer", bool: "true or false", str: "a string"}
    if tp not in expected:
        raise TypeError(f"unsupported config field type {tp!r} at {path}")
    well_typed = isinstance(data, bool) if tp is bool else isinstance(data, tp) and not isinstance(data, bool)
    if not well_typed:
        report.add_malformed(f"{path}: expected {expected[tp]}, got {data!r}")
    return data


def _describe(tp: Any) -> str:
    """Human words for a type: `'a' | 'b' | null`, `a number or null`."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(repr, typing.get_args(tp)))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    names = {type(None): "null", float: "a number", int: "an integer", bool: "true or false", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", repr(tp)))
