"""``probes/bpf.py``'s uprobes on the real kernel: attached as uprobe_multi links where the
kernel has them (6.6+, as every kernel these tests run on), as perf events when asked, each
way trapping every call of the probed function, entry and return, and none once detached."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from kvwatch.probes.bpf import PERF_EVENT, UPROBE_MULTI, Program, percpu_array_sums
from kvwatch.probes.canary import CANARY_SOURCE
from kvwatch.probes.libs import SymbolCache

N = 23  # prime: no batching or sampling divides it
SYMBOL = "kvw_probe_me"


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library linked at 0x200000, so that its code's ELF addresses are not its file offsets:
    a probe placed at the address where the kernel wants the offset would never be hit."""
    d = tmp_path_factory.mktemp("uprobe_multi")
    src = d / "probe_me.c"
    src.write_text(f"int {SYMBOL}(int x) {{ return x * 3 + 1; }}\n")
    out = d / "libkvwprobeme.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "no C compiler"
    flags = ["-shared", "-fPIC", "-O2", "-fcf-protection=full", "-Wl,-Ttext-segment=0x200000"]
    subprocess.run([cc, *flags, "-o", str(out), str(src)], check=True)
    return out


def file_offset(path: Path, addr: int) -> int:
    with path.open("rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= addr < seg["p_vaddr"] + seg["p_memsz"]:
                return int(addr - seg["p_vaddr"] + seg["p_offset"])
    raise AssertionError(f"{addr:#x} in no PT_LOAD segment of {path}")


def program(*, uprobe_multi: bool) -> Iterator[Program]:
    prog = Program(CANARY_SOURCE, ["-DKVW_NR_HITS=2", "-DKVW_NR_LOST=1"], uprobe_multi=uprobe_multi)
    try:
        yield prog
    finally:
        prog.close()


@pytest.fixture
def links() -> Iterator[Program]:
    yield from program(uprobe_multi=True)


@pytest.fixture
def perf_events() -> Iterator[Program]:
    yield from program(uprobe_multi=False)


def counted(prog: Program, lib: Path) -> tuple[str, dict[str, int]]:
    """Attach the entry and return probes to ``lib``'s function in this process, call it N times,
    detach; the attach mode and the program's counts of entries and returns."""
    addr = SymbolCache().get(str(lib)).probe_address(SYMBOL)
    assert addr is not None
    assert file_offset(lib, addr) != addr  # the test means something only if they differ
    fn = getattr(ctypes.CDLL(str(lib)), SYMBOL)
    events = [
        prog.attach_uprobe("t", str(lib), f"kvw_canary_{p}", pid=os.getpid(), addr=addr, retprobe=r)
        for p, r in (("return", True), ("enter", False))
    ]
    assert all(events) and len(set(events)) == 2
    assert prog.open_uprobes == 2
    assert [fn(i) for i in range(N)] == [3 * i + 1 for i in range(N)]
    assert all(prog.detach_uprobe_event(ev) for ev in events)
    prog.wait_releases(30)
    assert prog.pending_releases() == 0 and prog.open_uprobes == 0
    fn(N)  # detached: not counted
    assert not prog.detach_uprobe_event(events[0])  # once only
    return prog.uprobe_mode, percpu_array_sums(prog.table("hits"), ["entries", "returns"])


def test_uprobe_multi_links_count_every_call(links: Program, lib: Path) -> None:
    assert links.uprobe_mode == ""  # decided by the first attach
    mode, hits = counted(links, lib)
    assert mode == UPROBE_MULTI, links.uprobe_mode_reason
    assert hits == {"entries": N, "returns": N}


def test_perf_event_fallback_counts_every_call(perf_events: Program, lib: Path) -> None:
    mode, hits = counted(perf_events, lib)
    assert mode == PERF_EVENT
    assert hits == {"entries": N, "returns": N}


def test_link_offset_is_bccs_resolution(lib: Path) -> None:
    """The offset a link is made with, from bcc's resolution of the ELF address, is the one
    the PT_LOAD segment gives (the event name carries it)."""
    addr = SymbolCache().get(str(lib)).probe_address(SYMBOL)
    assert addr is not None
    for prog in program(uprobe_multi=True):
        event = prog.attach_uprobe("t", str(lib), "kvw_canary_enter", pid=os.getpid(), addr=addr)
        assert event.endswith(f"_{os.getpid()}_{file_offset(lib, addr):#x}")
