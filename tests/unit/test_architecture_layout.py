"""The import namespace matches the tree: ``kvwatch.daemon.x`` is ``daemon/x.py``, reached through
``src/kvwatch``'s relative links, so a bare checkout imports with ``src`` on the path, no install,
and the wheel (setuptools' package finder under ``src``) holds every package of the tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]
TOP = ("daemon", "probes", "exporters")


def test_src_links_are_relative_and_point_at_the_top_level() -> None:
    for name in TOP:
        link = REPO / "src" / "kvwatch" / name
        assert link.is_symlink(), f"src/kvwatch/{name} is not a link"
        target = link.readlink()
        assert not target.is_absolute(), f"src/kvwatch/{name} -> {target}: an absolute link breaks a copy"
        assert link.resolve() == (REPO / name).resolve()


def test_a_bare_checkout_imports_without_an_install(tmp_path: Path) -> None:
    """-S: no site directory, so no installed kvwatch (editable or not) can answer instead."""
    code = (
        "import kvwatch, kvwatch.daemon, kvwatch.probes, kvwatch.exporters, kvwatch.daemon.engines; "
        "print(kvwatch.__file__); print(kvwatch.daemon.engines.__file__)"
    )
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], check=False, cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split()
    assert Path(first) == REPO / "src" / "kvwatch" / "__init__.py"
    assert Path(second).resolve() == REPO / "daemon" / "engines" / "__init__.py"


def test_the_package_finder_sees_every_folder_of_code() -> None:
    found = set(find_packages(str(REPO / "src"), include=["kvwatch*"]))
    want = {"kvwatch"}
    for name in TOP:
        for f in (REPO / name).rglob("*.py"):
            rel = f.parent.relative_to(REPO)
            if "__pycache__" not in rel.parts:
                want.add(".".join(["kvwatch", *rel.parts]))
    assert want <= found, f"folders of code without an __init__.py (left out of the wheel): {sorted(want - found)}"
