"""tracefs: where it is, which tracepoints exist, what probe entries are registered.

No bcc here: ``kvwatch doctor`` and the tests read tracefs without loading BPF.
"""

from __future__ import annotations

from pathlib import Path

CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


def tracefs_root(candidates: tuple[Path, ...] = CANDIDATES) -> Path | None:
    for c in candidates:
        if (c / "events").is_dir():
            return c
    return None


def tracepoint_exists(tracepoint: str, root: Path | None = None) -> bool:
    """``tracepoint`` is "category:event"."""
    base = root if root is not None else tracefs_root()
    if base is None:
        return False
    category, _, event = tracepoint.partition(":")
    return (base / "events" / category / event / "id").is_file()


def probe_events(kind: str = "uprobe_events", root: Path | None = None) -> list[str]:
    """Lines of tracefs ``uprobe_events`` / ``kprobe_events`` (empty if absent)."""
    base = root if root is not None else tracefs_root()
    if base is None:
        return []
    try:
        text = (base / kind).read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()]


def bcc_probe_events_of(pid: int, root: Path | None = None) -> list[str]:
    """Entries bcc registered on behalf of process ``pid`` (bcc suffixes them ``_bcc_<pid>``)."""
    suffix = f"_bcc_{pid}"
    out = []
    for kind in ("uprobe_events", "kprobe_events"):
        out += [line for line in probe_events(kind, root) if line.split()[0].endswith(suffix)]
    return out
