"""``kvwatch run`` keeps rich (a renderer only ``kvwatch top`` uses) out of the agent's memory;
every other command still has it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
sys.argv = ["kvwatch", {command!r}, "--no-such-flag"]
from kvwatch.daemon import entry
try:
    entry.main()
except SystemExit:
    pass
print("structlog" in sys.modules, "rich.traceback" in sys.modules)
"""


def _loaded(command: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(command=command)], capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip()


def test_run_loads_structlog_without_rich() -> None:
    assert _loaded("run") == "True False"


def test_top_still_has_rich() -> None:
    assert _loaded("top") == "True True"
