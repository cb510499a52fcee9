"""The import graph keeps the roles apart (docs/architecture.md): read from the source, every
import counted, those inside functions too.

* ``daemon/lab`` (simulated engines, workloads, stubs) is reached from product code only by
  the doctor's canaries and the CLI's ``demo`` command;
* exporters read snapshots and records: never the agent, the wiring, a probe family or a
  probe loader;
* the data between the layers (``daemon/model``) imports only itself and the probes' records;
* detectors are reached from outside only through their registry;
* probes import nothing from the daemon or the exporters;
* bcc is imported in ``probes/bpf.py`` alone;
* imports have no cycle, those inside functions included (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"daemon": "kvwatch.daemon", "probes": "kvwatch.probes", "exporters": "kvwatch.exporters"}
MODEL = "kvwatch.daemon.model"
RECORDS = {"kvwatch.daemon.model.engines", "kvwatch.daemon.model.findings", "kvwatch.probes.records"}
LAB = "kvwatch.daemon.lab"


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    top_level: bool
    line: int


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for f in (REPO / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = f
    return out


MODULES = modules()


def _resolve(name: str) -> str:
    """The module an imported name lives in (``from a.b import c`` is a.b.c when that is a module)."""
    return name if name in MODULES else name.rsplit(".", 1)[0]


def imports() -> Iterator[Import]:
    for source, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [_resolve(f"{node.module}.{a.name}") for a in node.names]
            for n in names:
                yield Import(source, n, id(node) in top, node.lineno)


ALL = list(imports())


def internal() -> list[Import]:
    return [i for i in ALL if i.target.startswith("kvwatch.")]


def test_the_graph_is_read() -> None:
    assert len(MODULES) > 60 and len(internal()) > 200
    assert any(i.source == "kvwatch.daemon.cli" and i.target == "kvwatch.daemon.lab.demo" for i in ALL)


def test_lab_is_reached_only_by_the_doctor_and_the_demo_command() -> None:
    allowed = {("kvwatch.daemon.cli", "kvwatch.daemon.lab.demo")}
    bad = [
        f"{i.source}:{i.line} -> {i.target}"
        for i in internal()
        if i.target.startswith(LAB)
        and not i.source.startswith((LAB, "kvwatch.daemon.doctor"))
        and (i.source, i.target) not in allowed
    ]
    assert bad == []


def test_exporters_read_snapshots_and_records_only() -> None:
    allowed = (
        "kvwatch.exporters",
        "kvwatch.daemon.model.snapshot",
        "kvwatch.daemon.model.transfers",  # the link's share, defined once for the detector and exporters
        "kvwatch.daemon.config",  # listen addresses, the Alertmanager section
        *RECORDS,
    )
    bad = [
        f"{i.source}:{i.line} -> {i.target}"
        for i in internal()
        if i.source.startswith("kvwatch.exporters") and not i.target.startswith(allowed)
    ]
    assert bad == []


def test_the_model_is_data_only() -> None:
    bad = [
        f"{i.source}:{i.line} -> {i.target}"
        for i in internal()
        if i.source.startswith(MODEL) and not i.target.startswith((MODEL, "kvwatch.probes.records"))
    ]
    assert bad == []
    third_party = [
        f"{i.source} -> {i.target}"
        for i in ALL
        if i.source.startswith(MODEL)
        and i.target.split(".")[0] not in ("__future__", "collections", "dataclasses", "enum", "typing", "kvwatch")
    ]
    assert third_party == []


def test_detectors_are_reached_through_their_registry_only() -> None:
    """What detectors read and report is in the model; nothing outside detectors/ depends on one
    detector's module or their shared machinery."""
    detectors = "kvwatch.daemon.detectors"
    bad = [
        f"{i.source}:{i.line} -> {i.target}"
        for i in internal()
        if i.target.startswith(detectors + ".")
        and not i.source.startswith(detectors)
        and i.target != detectors + ".registry"
    ]
    assert bad == []


def test_probes_know_nothing_of_the_daemon() -> None:
    bad = [
        f"{i.source}:{i.line} -> {i.target}"
        for i in internal()
        if i.source.startswith("kvwatch.probes") and not i.target.startswith("kvwatch.probes")
    ]
    assert bad == []


def test_bcc_in_one_module() -> None:
    users = {i.source for i in ALL if i.target == "bcc" or i.target.startswith("bcc.")}
    assert users == {"kvwatch.probes.bpf"}


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for i in internal():
        if i.target in MODULES and i.target != i.source:
            graph.setdefault(i.source, set()).add(i.target)
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path, n, m]
            if m not in state and (cycle := visit(m, [*path, n])):
                return cycle
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            assert visit(n, []) is None


def test_proc_and_sys_are_read_through_procfs_only() -> None:
    """A path literal under /proc or /sys in the daemon or the exporters (outside the lab's
    workloads) names a read that bypasses ``ProcFS`` and its one root. The probes keep their
    own: tracefs, and kvwatch's own /proc/self for its BPF programs' bookkeeping."""
    allowed = {"kvwatch.daemon.host.procfs", "kvwatch.daemon.config"}  # the root itself, and its default
    bad = []
    for name, path in MODULES.items():
        if name.startswith(("kvwatch.probes", LAB)) or name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if text.startswith(("/proc", "/sys")) and not any(c.isspace() for c in text):
                    bad.append(f"{name}:{node.lineno} {text!r}")
    assert bad == []


# --- the tests' own layout -------------------------------------------------------------------------
TESTS = REPO / "tests"
TIERS = ("unit", "integration", "privileged")
# What a unit test must not touch: sockets, threads, servers (integration/ and privileged/ do).
UNIT_FORBIDDEN = ("socket", "threading", "zmq", "http.server", "urllib.request", "kvwatch.daemon.engines.kv_events")


def suite_files() -> list[Path]:
    return sorted(f for tier in TIERS for f in (TESTS / tier).glob("test_*.py"))


def test_modules_import_only_support_and_tools() -> None:
    """Shared helpers live in ``tests/support`` (fixture generators in ``tests/tools``): a test
    module never imports another test module, so that moving or deleting one breaks no other."""
    bad = []
    for f in suite_files() + sorted(TESTS.glob("*/conftest.py")) + sorted((TESTS / "support").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n.startswith("tests.") and not n.startswith(("tests.support", "tests.tools")):
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno} {n}")
    assert bad == []


def test_unit_tests_open_no_sockets_and_start_no_threads() -> None:
    bad = []
    for f in sorted((TESTS / "unit").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{f.name}:{node.lineno} {n}" for n in names if n.startswith(UNIT_FORBIDDEN)]
    assert bad == []


def test_test_files_are_named_for_the_module_they_cover() -> None:
    """``test_<module>[_<aspect>].py``: <module> a module or package of kvwatch (``engines/taps.py``
    → ``test_taps.py``, ``test_taps_…``), so that the tests of a module are found by its name.
    The benchmarks' pure helpers are tested as ``test_bench_<module>.py`` (``bench/pairstats.py`` →
    ``test_bench_pairstats.py``)."""
    names = {"architecture", "deploy"}  # this file (the tree's rules) and deploy/
    names |= {f"bench_{f.stem}" for f in (REPO / "bench").glob("*.py")}
    for folder in PACKAGES:
        names.add(folder)
        for f in (REPO / folder).rglob("*"):
            if f.is_dir() and f.name != "__pycache__":
                names.add(f.name)
            elif f.suffix in (".py", ".c") and f.stem != "__init__":
                names.add(f.name.split(".")[0])
    bad = [
        str(f.relative_to(REPO))
        for f in suite_files()
        if not any(f.stem[5:] == n or f.stem[5:].startswith(n + "_") for n in names)
    ]
    assert bad == []


# --- references to the tree ----------------------------------------------------------------------
# A path the code or the docs name, under one of the tree's own folders (``engines/taps.py``,
# ``docs/metrics.md``): where it is looked for. Names elsewhere (an engine's source, a header)
# are not the tree's.
OWN = (
    "daemon",
    "probes",
    "exporters",
    "engines",
    "detectors",
    "families",
    "host",
    "lab",
    "model",
    "config",
    "doctor",
    "docs",
    "deploy",
    "bench",
    "tests",
    "stubs",
    "tools",
    "support",
    "fixtures",
)
BASES = ("", "daemon/", "tests/", "deploy/")


def test_named_paths_exist() -> None:
    """Docstrings, comments and docs that point at a file of the tree point at one that exists."""
    ref = re.compile(r"(?<![\w/.-])((?:" + "|".join(OWN) + r")/(?:[\w-]+/)*[\w-]+\.(?:py|c|h|md|yaml|toml|sh))\b")
    tracked = subprocess.run(
        ["git", "ls-files", "daemon", "probes", "exporters", "docs", "README.md", "deploy"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    bad, seen = [], 0
    for name in tracked:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".c", ".h", ".sh", ".yaml") or path.is_symlink() or not path.is_file():
            continue
        for m in ref.finditer(path.read_text(errors="replace")):
            seen += 1
            if not any((REPO / base / m.group(1)).exists() for base in BASES):
                bad.append(f"{name}: {m.group(1)}")
    assert seen > 200, "the scan found (almost) no reference at all"
    assert bad == []
