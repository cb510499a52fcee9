"""bench/'s modules for the unit tests: bench/ is a folder of scripts, not a package, and its
modules import each other by bare name (as when run), so bench/ goes on the import path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    return importlib.import_module(name)
