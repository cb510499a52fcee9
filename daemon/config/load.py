"""Configuration: a TOML file, ``KVWATCH_*`` environment, then flags, validated at once.

Precedence (last wins): built-in defaults < TOML file < environment < flags.
Every key can be set from each source:

* TOML: ``[discovery] interval_seconds = 5``
* environment: ``KVWATCH_DISCOVERY__INTERVAL_SECONDS=5`` (``__`` between levels)
* flags: the named ones (``--listen``, ``--pid``, ``--kv-dir``, ``--log-format``) or
  ``--set discovery.interval_seconds=5`` for any key.

Values from the environment and ``--set`` are parsed as TOML values when they
parse (``5``, ``true``, ``["a", "b"]``), as plain strings otherwise.

Unknown keys and bad values are all reported together, each naming the key and
where it came from.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwatch.daemon.config import DEFAULT_CONFIG_PATH, ENV_PREFIX, Config
from pydantic import ValidationError


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    key: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message} (from {self.source})"


class ConfigError(Exception):
    """Every problem found in the configuration, reported at once."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")


def _scalar(text: str) -> Any:
    """A value from the environment or --set: a TOML value if it parses, else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict[str, Any], dotted: str, value: Any, sources: dict[str, str], src: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value
    sources[".".join(parts)] = src


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _record_sources(tree: Mapping[str, Any], prefix: str, src: str, sources: dict[str, str]) -> None:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        sources[key] = src
        if isinstance(v, Mapping):
            _record_sources(v, key + ".", src, sources)


def env_overrides(environ: Mapping[str, str], sources: dict[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "KVWATCH_CONFIG":
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_path(tree, dotted, _scalar(raw), sources, f"environment {name}")
    return tree


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    sets: list[str] | None = None,
    default_path: Path | None = DEFAULT_CONFIG_PATH,
) -> Config:
    """Build the configuration. ``path=None`` reads the default file if it exists.

    ``overrides`` maps dotted keys to values from named flags; ``sets`` are
    ``--set key=value`` strings.
    """
    environ = os.environ if environ is None else environ
    sources: dict[str, str] = {}
    problems: list[ConfigProblem] = []
    tree: dict[str, Any] = {}

    explicit = path is not None or "KVWATCH_CONFIG" in environ
    file = path or (Path(environ["KVWATCH_CONFIG"]) if "KVWATCH_CONFIG" in environ else default_path)
    if file is not None and (file.exists() or explicit):
        try:
            tree = tomllib.loads(file.read_text())
            _record_sources(tree, "", f"file {file}", sources)
        except FileNotFoundError:
            problems.append(ConfigProblem("(file)", "no such file", str(file)))
        except (OSError, UnicodeDecodeError) as err:
            problems.append(ConfigProblem("(file)", f"cannot read: {err}", str(file)))
        except tomllib.TOMLDecodeError as err:
            problems.append(ConfigProblem("(file)", f"not valid TOML: {err}", str(file)))

    tree = _merge(tree, env_overrides(environ, sources))

    flag_tree: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        _set_path(flag_tree, dotted, value, sources, f"flag for {dotted}")
    for item in sets or []:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            problems.append(ConfigProblem(item, "expected KEY=VALUE", "flag --set"))
            continue
        _set_path(flag_tree, key.strip(), _scalar(raw), sources, f"flag --set {key.strip()}")
    tree = _merge(tree, flag_tree)

    try:
        config = Config.model_validate(tree)
    except ValidationError as err:
        for e in err.errors():
            loc = [str(p) for p in e["loc"]]
            key = ".".join(loc) or "(root)"
            src = _source_of(loc, sources)
            msg = e["msg"]
            if e["type"] == "extra_forbidden":
                msg = "unknown key"
            elif "input" in e and not isinstance(e["input"], dict | list):
                msg = f"{msg} (got {e['input']!r})"
            problems.append(ConfigProblem(key, msg, src))
        raise ConfigError(problems) from None
    if problems:
        raise ConfigError(problems)
    return config


def _source_of(loc: list[str], sources: Mapping[str, str]) -> str:
    for n in range(len(loc), 0, -1):
        key = ".".join(loc[:n])
        if key in sources:
            return sources[key]
    return "defaults"
