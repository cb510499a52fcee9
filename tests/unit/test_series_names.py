"""The per-process series contract (daemon/series_names.py), read from the source: every name is
written by the module the catalogue says and read only by the modules it lists; every name
written is read somewhere; no module spells a series name as a string of its own; exporters read
no series at all (the snapshot's typed fields instead)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from kvwatch.daemon import series_names as sn

REPO = Path(__file__).resolve().parents[2]
CONSTANTS = {k: v for k, v in vars(sn).items() if k.isupper() and isinstance(v, str) and v in sn.CATALOGUE}


def _modules() -> dict[str, Path]:
    out = {}
    for root, prefix in ((REPO / "daemon", ""), (REPO / "exporters", "exporters.")):
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("").parts
            if rel[0] == "lab" or f.name == "series_names.py":
                continue
            out[prefix + ".".join(p for p in rel if p != "__init__")] = f
    return out


MODULES = _modules()


def _references() -> dict[str, set[str]]:
    """Per constant, the modules that use it (``sn.NAME``)."""
    refs: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sn":
                refs[node.attr].add(mod)
    return refs


REFS = _references()


def test_the_catalogue_is_read() -> None:
    assert len(CONSTANTS) == len(sn.CATALOGUE) > 20  # shrinking as sources become typed histories
    assert {"engines.taps", "families.memory", "publish", "detectors.eviction_burst"} <= set().union(*REFS.values())


def test_each_name_is_written_by_its_writer_and_read_by_its_readers_only() -> None:
    bad = []
    for const, name in CONSTANTS.items():
        e = sn.CATALOGUE[name]
        users = REFS.get(const, set())
        if e.writer not in users:
            bad.append(f"{const}: its writer {e.writer} does not use it")
        for m in sorted(users - {e.writer, *e.readers}):
            bad.append(f"{const}: {m} uses it, not in its readers {e.readers}")
        if not e.readers or not (users & set(e.readers)):
            bad.append(f"{const}: written by {e.writer}, read by none of {e.readers}")
    assert bad == []


def test_no_series_name_spelt_out() -> None:
    names = set(sn.CATALOGUE)
    prefixes = tuple(n for n in names if n.endswith(":"))
    bad = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                v = node.value
                if v in names or (v.startswith(prefixes) and v not in prefixes):
                    bad.append(f"{mod}:{node.lineno} {v!r}")
    assert bad == []


def test_exporters_read_the_snapshot_not_series() -> None:
    assert [m for users in REFS.values() for m in users if m.startswith("exporters.")] == []
