"""kvwatch's own version, as installed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvwatch_version() -> str:
    try:
        return version("kvwatch")
    except PackageNotFoundError:
        return "0+unknown"
