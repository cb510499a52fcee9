"""Configuration: a TOML file, ``KVWATCH_*`` environment, then flags, validated at once.

Precedence (last wins): built-in defaults < TOML file < environment < flags.
Every key can be set from each source:

* TOML: ``[discovery] interval_seconds = 5``
* environment: ``KVWATCH_DISCOVERY__INTERVAL_SECONDS=5`` (``__`` between levels)
* flags: the named ones (``--listen``, ``--pid``, ``--kv-dir``, ``--log-format``) or
  ``--set discovery.interval_seconds=5`` for any key.

Values from the environment and ``--set`` are parsed as TOML values when they
parse (``5``, ``true``, ``["a", "b"]``), as plain strings otherwise.

Unknown keys and bad values are all reported together, each on one line naming the key and
where it came from. A problem repeats the value it refuses, except under the keys in
``UNECHOED_KEYS`` (cache salts, addresses); credentials in an address (user:password@) are
masked in every message, and control characters are escaped, so no key or value can break a
problem over two lines.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvwatch.daemon.config import DEFAULT_CONFIG_PATH, ENV_PREFIX, Config
from kvwatch.daemon.config.base import ConfigError, ConfigProblem, parse

__all__ = ["ConfigError", "ConfigProblem", "env_overrides", "load_config"]

MAX_FILE_BYTES = 1 << 20  # a configuration file is read up to this (the example is 12 KiB)


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


def _present(file: Path) -> bool:
    try:
        return file.exists()
    except OSError:  # e.g. a directory on its path kvwatch may not search: reading it says why
        return True


def _is_key(dotted: str) -> bool:
    return all(dotted.split("."))


def env_overrides(
    environ: Mapping[str, str], sources: dict[str, str], problems: list[ConfigProblem] | None = None
) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "KVWATCH_CONFIG":
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        if not _is_key(dotted):
            if problems is not None:
                problems.append(ConfigProblem("(environment)", "expected KVWATCH_SECTION__KEY", f"environment {name}"))
            continue
        _set_path(tree, dotted, _scalar(raw), sources, f"environment {name}")
    return tree


def _extend(tree: dict[str, Any], dotted: str, items: list[Any], source: str, sources: dict[str, str]) -> None:
    """Append ``items`` to the list at ``dotted`` (a bad value there is left to the validator)."""
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            return
        node = child
    current = node.get(leaf, [])
    if not isinstance(current, list):
        return
    node[leaf] = [*current, *items]
    for i in range(len(current), len(current) + len(items)):
        sources[f"{dotted}.{i}"] = source


def _read_file(file: Path, sources: dict[str, str], problems: list[ConfigProblem]) -> dict[str, Any]:
    """The TOML file's tree (empty, with the problem recorded, when it cannot be had)."""
    try:
        with file.open("rb") as f:
            text = f.read(MAX_FILE_BYTES + 1)
        if len(text) > MAX_FILE_BYTES:
            problems.append(ConfigProblem("(file)", f"larger than {MAX_FILE_BYTES >> 20} MiB", str(file)))
            return {}
        tree = tomllib.loads(text.decode())
    except FileNotFoundError:
        problems.append(ConfigProblem("(file)", "no such file", str(file)))
        return {}
    except (OSError, UnicodeDecodeError) as err:
        problems.append(ConfigProblem("(file)", f"cannot read: {err}", str(file)))
        return {}
    except tomllib.TOMLDecodeError as err:
        problems.append(ConfigProblem("(file)", f"not valid TOML: {err}", str(file)))
        return {}
    _record_sources(tree, "", f"file {file}", sources)
    return tree


def _flag_tree(
    overrides: Mapping[str, Any], sets: list[str], sources: dict[str, str], problems: list[ConfigProblem]
) -> dict[str, Any]:
    """What the named flags and ``--set`` give, as a tree."""
    flag_tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        _set_path(flag_tree, dotted, value, sources, f"flag for {dotted}")
    for n, item in enumerate(sets, 1):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not _is_key(key):  # named by position: the argument may be a mistyped secret
            problems.append(ConfigProblem(f"--set #{n}", "expected KEY=VALUE, KEY as section.key", "flag --set"))
            continue
        _set_path(flag_tree, key, _scalar(raw), sources, f"flag --set {key}")
    return flag_tree


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    sets: list[str] | None = None,
    extend: Mapping[str, tuple[list[Any], str]] | None = None,
    default_path: Path | None = DEFAULT_CONFIG_PATH,
) -> Config:
    """Build the configuration. ``path=None`` reads the default file if it exists.

    ``overrides`` maps dotted keys to values from named flags; ``sets`` are
    ``--set key=value`` strings; ``extend`` maps dotted keys of lists to items a repeatable
    flag adds to what the other sources give, and the flag's name.
    """
    environ = os.environ if environ is None else environ
    sources: dict[str, str] = {}
    problems: list[ConfigProblem] = []
    tree: dict[str, Any] = {}

    explicit = path is not None or "KVWATCH_CONFIG" in environ
    file = path or (Path(environ["KVWATCH_CONFIG"]) if "KVWATCH_CONFIG" in environ else default_path)
    if file is not None and (explicit or _present(file)):
        tree = _read_file(file, sources, problems)

    tree = _merge(tree, env_overrides(environ, sources, problems))

    flag_tree = _flag_tree(overrides or {}, sets or [], sources, problems)
    tree = _merge(tree, flag_tree)
    for dotted, (items, flag) in (extend or {}).items():
        _extend(tree, dotted, items, f"flag {flag}", sources)

    try:
        config = parse(Config, tree, sources)
    except ConfigError as err:
        raise ConfigError(problems + err.problems) from None
    if problems:
        raise ConfigError(problems)
    return config
