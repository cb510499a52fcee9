"""What every section of the configuration shares, and how a tree of plain values becomes one.

A section is a frozen msgspec Struct that refuses unknown keys. Its fields carry their bounds as
``msgspec.Meta`` and any further rule of their own as ``Check``; a rule between fields is the
section's ``__post_init__`` (a ``ValueError`` saying what is wrong).

``parse`` walks the tree section by section and field by field, so that every problem is found
in one pass, each naming its key: msgspec alone stops at the first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Annotated, Any, TypeVar, get_args, get_origin

import msgspec
from msgspec import Meta

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]

# Keys whose values a configuration problem never repeats: a tenant's cache salt, or its SHA-256
# where an operator may put the salt itself by mistake (anywhere under engines.tenants), and
# addresses, which may carry credentials (user:password@host).
UNECHOED_KEYS = frozenset(
    {"tenants", "salt", "salt_sha256", "url", "metrics_url", "kv_events", "kv_events_replay", "runbook_base_url"}
)
_USERINFO = re.compile(r"[^\s/@'\"]+@")  # user:password@ in an address
_AT = re.compile(r" - at `\$(.*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


class Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A table of the configuration: every key optional unless it has no default. Each subclass
    says ``frozen=True`` again: msgspec inherits it, but mypy's reading of the class does not."""


@dataclass(frozen=True, slots=True)
class Check:
    """A field's own rule past its type and bounds: ``rule(value)`` raises ValueError saying why."""

    rule: Callable[[Any], object]


def _one_line(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    key: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"{_one_line(self.key)}: {_one_line(self.message)} (from {_one_line(self.source)})"


class ConfigError(Exception):
    """Every problem found in the configuration, reported at once."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")


T = TypeVar("T")
_BAD: Any = object()  # a value that did not validate (its problem already said)


def parse(cls: type[T], tree: Any, sources: Mapping[str, str] | None = None) -> T:
    """``tree`` as a ``cls``, or ConfigError with every problem, each with the source of its key."""
    walk = _Walk(sources or {})
    out = walk.value(cls, tree, ())
    if walk.problems:
        raise ConfigError(walk.problems)
    return out  # type: ignore[no-any-return]


def _decode(kind: type, value: Any) -> Any:
    if kind is Path and isinstance(value, str | PurePath):
        return Path(value)
    raise TypeError(f"expected {kind.__name__}")


def _parts(kind: Any) -> tuple[Any, tuple[Any, ...], list[Check]]:
    """The type under Annotated, the msgspec bounds on it, and its own checks."""
    if get_origin(kind) is Annotated:
        base, *extra = get_args(kind)
        return base, tuple(m for m in extra if isinstance(m, Meta)), [c for c in extra if isinstance(c, Check)]
    return kind, (), []


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


class _Walk:
    def __init__(self, sources: Mapping[str, str]) -> None:
        self.sources = sources
        self.problems: list[ConfigProblem] = []

    def say(self, loc: tuple[str, ...], message: str) -> None:
        for n in range(len(loc), 0, -1):
            source = self.sources.get(".".join(loc[:n]))
            if source is not None:
                break
        else:
            source = "defaults"
        key = ".".join(loc) or "(root)"
        self.problems.append(ConfigProblem(key, _USERINFO.sub("***@", message), source))

    def value(self, kind: Any, raw: Any, loc: tuple[str, ...]) -> Any:
        base, bounds, checks = _parts(kind)
        if _is_section(base):
            out = self.section(base, raw, loc)
        elif get_origin(base) is list and _is_section(_parts(get_args(base)[0])[0]):
            out = self.sections(base, bounds, raw, loc)
        else:
            out = self.leaf(kind, raw, loc)
        for check in checks if out is not _BAD else ():
            try:
                check.rule(out)
            except ValueError as err:
                self.say(loc, str(err))
                return _BAD
        return out

    def section(self, cls: type[msgspec.Struct], raw: Any, loc: tuple[str, ...]) -> Any:
        if not isinstance(raw, Mapping):
            self.say(loc, f"expected a table, got {type(raw).__name__}")
            return _BAD
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        good = True
        for key in raw:
            if key not in fields:
                self.say((*loc, str(key)), "unknown key")
                good = False
        values = {}
        for name, field in fields.items():
            if name not in raw:
                if field.required:
                    self.say((*loc, name), "required key missing")
                    good = False
                continue
            values[name] = self.value(field.type, raw[name], (*loc, name))
            good = good and values[name] is not _BAD
        if not good:
            return _BAD
        try:
            return cls(**values)  # runs the section's own rule between fields (__post_init__)
        except (ValueError, TypeError) as err:
            self.say(loc, str(err))
            return _BAD

    def sections(self, kind: Any, bounds: tuple[Any, ...], raw: Any, loc: tuple[str, ...]) -> Any:
        items = self.leaf(Annotated[(list[Any], *bounds)] if bounds else list[Any], raw, loc)
        if items is _BAD:
            return _BAD
        out = [self.value(get_args(kind)[0], item, (*loc, str(i))) for i, item in enumerate(items)]
        return _BAD if any(v is _BAD for v in out) else out

    def leaf(self, kind: Any, raw: Any, loc: tuple[str, ...]) -> Any:
        try:
            return msgspec.convert(raw, kind, strict=False, dec_hook=_decode)
        except msgspec.ValidationError as err:
            message = str(err)
            where = _AT.search(message)
            steps = [a or b for a, b in _STEP.findall(where.group(1))] if where else []
            at, got = (*loc, *steps), raw
            for step in steps:
                got = got[int(step)] if isinstance(got, list) else got.get(step) if isinstance(got, dict) else None
            message = _AT.sub("", message)
            if not isinstance(got, dict | list) and not UNECHOED_KEYS.intersection(at):
                shown = repr(got)
                message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
            self.say(at, message)
            return _BAD
