"""ProcFS: every /proc and /sys read under one root, here a fixture tree."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from kvwatch.daemon.config import DiscoveryConfig
from kvwatch.daemon.discovery import Discovery
from kvwatch.daemon.engines.reach import Reach
from kvwatch.daemon.families.kv_files import specs_from_process
from kvwatch.daemon.host.procfs import ProcError, ProcessGone, ProcFS, parse_cgroup2_mount
from kvwatch.daemon.host.psi import PressureReader
from tests.support.procfs import FakeProc, make_proc

REPO = Path(__file__).resolve().parents[2]
MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
)
PSI = "some avg10=12.50 avg60=3.00 avg300=1.00 total=100\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=10\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_one_root_places_proc_and_sys() -> None:
    assert (ProcFS().proc, ProcFS().sys) == (Path("/proc"), Path("/sys"))
    host = ProcFS(Path("/"), "/host/proc")  # the host's procfs mounted into kvwatch's container
    assert (host.proc, host.sys) == (Path("/host/proc"), Path("/sys"))
    fixture = ProcFS(Path("/t"), Path("/host/proc"))
    assert (fixture.proc, fixture.sys) == (Path("/t/host/proc"), Path("/t/sys"))
    assert fixture.under_root("/sys/fs/cgroup") == Path("/t/sys/fs/cgroup")
    assert fixture.root_path(7) == Path("/t/host/proc/7/root")
    assert fixture.cwd_path(7) == Path("/t/host/proc/7/cwd")


def test_status_value_of_a_process_and_of_self(tmp_path: Path) -> None:
    make_proc(tmp_path / "proc", [FakeProc(10, "python3", ["python3"], tgid=9)])
    write(tmp_path / "proc" / "self" / "status", "Name:\tkvwatch\nCapEff:\t000001ffffffffff\n")
    fs = ProcFS(tmp_path)
    assert fs.status_value(10, "Tgid") == "9"
    assert fs.status_value("self", "CapEff") == "000001ffffffffff"
    assert fs.status_value("self", "CapBnd") is None
    with pytest.raises(ProcessGone):
        fs.status_value(11, "Tgid")


def test_netns_and_fib_trie(tmp_path: Path) -> None:
    fs = ProcFS(tmp_path)
    own = write(tmp_path / "proc" / "self" / "ns" / "net", "")
    (tmp_path / "proc" / "20" / "ns").mkdir(parents=True)
    os.link(own, tmp_path / "proc" / "20" / "ns" / "net")  # the same namespace: the same inode
    write(tmp_path / "proc" / "21" / "ns" / "net", "")
    assert fs.netns(20) == fs.netns("self") != fs.netns(21)
    with pytest.raises(ProcessGone):
        fs.netns(22)
    # read whole: a node's routing table can be longer than any fixed cap
    padding = "  +-- 192.168.0.0/16 2 0 2\n" * 60_000
    write(tmp_path / "proc" / "21" / "net" / "fib_trie", padding + "     |-- 10.1.2.3\n        /32 host LOCAL\n")
    reach = Reach(fs)
    assert reach.same_netns(20) and reach.address(20) == "127.0.0.1"
    assert not reach.same_netns(21) and reach.address(21) == "10.1.2.3"
    assert reach.same_netns(22)  # cannot tell: the host network is assumed


def test_cgroup2_mount_and_pressure(tmp_path: Path) -> None:
    fs = ProcFS(tmp_path)
    assert fs.cgroup2_mount() is None  # no mountinfo
    write(tmp_path / "proc" / "self" / "mountinfo", MOUNTINFO)
    assert fs.cgroup2_mount() == tmp_path / "sys" / "fs" / "cgroup"
    assert parse_cgroup2_mount(MOUNTINFO.splitlines()[0]) is None
    write(tmp_path / "proc" / "pressure" / "memory", PSI)
    write(tmp_path / "sys" / "fs" / "cgroup" / "kubepods" / "pod1" / "memory.pressure", PSI.replace("12.50", "40.00"))
    psi = PressureReader(fs)
    assert psi.node() == 12.5
    assert psi.cgroup("/kubepods/pod1") == 40.0
    assert psi.cgroup("/kubepods/gone") is None and psi.cgroup("") is None
    with pytest.raises(ProcError):
        fs.pressure("io")


def test_no_cgroup2_means_no_cgroup_pressure(tmp_path: Path) -> None:
    write(tmp_path / "proc" / "self" / "mountinfo", MOUNTINFO.splitlines()[0] + "\n")
    write(tmp_path / "sys" / "fs" / "cgroup" / "a" / "memory.pressure", PSI)
    psi = PressureReader(ProcFS(tmp_path))
    assert psi.cgroup2 is None and psi.cgroup("/a") is None and psi.node() is None


def test_sysfs_link_speed_and_btf(tmp_path: Path) -> None:
    fs = ProcFS(tmp_path)
    write(tmp_path / "sys" / "class" / "net" / "ib0" / "speed", "200000\n")
    write(tmp_path / "sys" / "class" / "net" / "bad0" / "speed", "fast\n")
    assert fs.link_speed_mbit("ib0") == 200000
    with pytest.raises(ProcError):
        fs.link_speed_mbit("bad0")
    with pytest.raises(ProcError):
        fs.link_speed_mbit("nope")
    assert fs.kernel_btf() is None
    btf = write(tmp_path / "sys" / "kernel" / "btf" / "vmlinux", "")
    assert fs.kernel_btf() == btf


def test_engine_files_read_inside_its_root(tmp_path: Path) -> None:
    env = {"LMCACHE_CONFIG_FILE": "/etc/lmcache.yaml"}
    root = make_proc(tmp_path / "proc", [FakeProc(40, "python", ["python", "-m", "vllm.entrypoints"], environ=env)])
    write(root / "40" / "root" / "etc" / "lmcache.yaml", "local_disk: file:///data/kv\n")
    fs = ProcFS(tmp_path)
    assert fs.read_in_root(40, "/etc/lmcache.yaml") == "local_disk: file:///data/kv\n"
    with pytest.raises(ProcessGone):
        fs.read_in_root(40, "/etc/missing.yaml")
    (d,) = Discovery(DiscoveryConfig(), fs).scan()
    (spec,) = specs_from_process(d, fs)
    assert spec.path == root / "40" / "root" / "data" / "kv" and spec.source == "lmcache"


def _string_literals(tree: ast.AST) -> list[ast.Constant]:
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]
