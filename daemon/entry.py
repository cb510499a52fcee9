"""The ``kvwatch`` command (and ``python -m kvwatch.daemon``), entered before anything else is
imported.

``kvwatch run`` renders nothing itself, but structlog imports rich's traceback renderer (and
pygments) whenever rich is installed, as it is for ``kvwatch top``: ~6 MiB resident for the
agent's whole life. So ``run`` marks rich unavailable first; structlog then formats an exception
as plain text, which the json log does anyway (docs/performance.md, the daemon's memory)."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:2] == ["run"]:
        sys.modules.setdefault("rich", None)  # type: ignore[arg-type]  # None: "cannot be imported"
    from kvwatch.daemon.cli import main as cli_main  # noqa: PLC0415 - after the line above

    return cli_main()
