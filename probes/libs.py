"""Which library files a process mapped, and where their symbols are.

Probes attach to the exact file the process mapped (``/proc/PID/maps``,
opened through ``/proc/PID/root`` so a container's copy is the one probed),
matched by exact soname pattern — never a substring (``libcudart_stub.so``
exists). Symbols are read once per file (dev, inode, size, mtime) from the
dynamic symbol table; the default version (``@@``) wins over older ones, which
bcc's own lookup gets wrong for libibverbs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerSymSection
from elftools.elf.sections import SymbolTableSection

# Exact file-name patterns (the real file behind the soname link may carry a full version). A
# wheel that bundles the CUDA runtime carries it renamed by auditwheel (libcudart-1a2b3c4d.so.13);
# vLLM's own loader takes such a copy when it is mapped first, so it is probed as well.
CUDART = re.compile(r"^libcudart(-[0-9a-f]{8,})?\.so\.\d+(\.\d+)*$")
LIBCUDA = re.compile(r"^libcuda\.so\.1(\.\d+)*$|^libcuda\.so\.\d{3}(\.\d+)+$")
LIBUCM = re.compile(r"^libucm(-[0-9a-f]+)?\.so(\.\d+)*$")


class LibraryError(Exception):
    """A library could not be read (vanished, not ELF, stripped of its dynamic symbols)."""


@dataclass(frozen=True, slots=True)
class MappedLibrary:
    pid: int
    path: str  # as the process sees it
    dev: str  # "fe:00" as in maps
    inode: int

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def host_path(self, proc_root: Path = Path("/proc")) -> str:
        """The same file, opened from our mount namespace through the process's root."""
        return f"{proc_root}/{self.pid}/root{self.path}"


def parse_maps(text: str, pid: int) -> list[MappedLibrary]:
    """Files mapped at offset 0 (one entry per file), in map order."""
    seen: set[tuple[str, int]] = set()
    out: list[MappedLibrary] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        if int(parts[2], 16) != 0:
            continue
        path = parts[5].removesuffix(" (deleted)")
        inode = int(parts[4])
        key = (parts[3], inode)
        if inode == 0 or key in seen:
            continue
        seen.add(key)
        out.append(MappedLibrary(pid, path, parts[3], inode))
    return out


def read_maps(pid: int, proc_root: Path = Path("/proc")) -> list[MappedLibrary]:
    """``ProcessLookupError``/``FileNotFoundError`` when the process is gone."""
    with open(proc_root / str(pid) / "maps") as f:
        return parse_maps(f.read(), pid)


def matching(libs: Iterable[MappedLibrary], pattern: re.Pattern[str]) -> list[MappedLibrary]:
    return [lib for lib in libs if pattern.match(lib.name)]


ENDBR64 = bytes.fromhex("f30f1efa")


@dataclass(frozen=True, slots=True)
class SymbolTable:
    """Defined functions of a shared object: name -> ELF virtual address (st_value)."""

    functions: dict[str, int]
    soname: str
    entry_bytes: dict[str, bytes]  # the first 4 bytes of each function

    def address(self, name: str) -> int | None:
        return self.functions.get(name)

    def probe_address(self, name: str) -> int | None:
        """Where to put the uprobe: past a leading ``endbr64``.

        uprobes emulate some first instructions (push, jmp, nop) and single-step the
        rest out of line; ``endbr64``, which CET builds put first in every function, is
        single-stepped, at ~16 us per hit in a VM against ~0.4 us emulated. Skipping it
        changes nothing a probe reads: arguments and the return address are untouched.
        """
        addr = self.functions.get(name)
        if addr is None:
            return None
        return addr + 4 if self.entry_bytes.get(name) == ENDBR64 else addr


def read_symbols(path: str) -> SymbolTable:
    """Dynamic FUNC symbols, preferring the default version (``name@@VER``) over hidden old ones."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            dynsym = elf.get_section_by_name(".dynsym")
            if not isinstance(dynsym, SymbolTableSection):
                raise LibraryError(f"{path}: no dynamic symbol table")
            versym = elf.get_section_by_name(".gnu.version")
            chosen: dict[str, tuple[int, bool, bool]] = {}  # name -> (address, hidden, ifunc)
            for i, sym in enumerate(dynsym.iter_symbols()):
                kind = sym["st_info"]["type"]
                if kind not in ("STT_FUNC", "STT_LOOS", "STT_GNU_IFUNC") or sym["st_shndx"] == "SHN_UNDEF":
                    continue
                ndx = versym.get_symbol(i).entry["ndx"] if isinstance(versym, GNUVerSymSection) else 0
                hidden = isinstance(ndx, int) and bool(ndx & 0x8000)  # name@VER, not name@@VER
                if sym.name not in chosen or (chosen[sym.name][1] and not hidden):
                    chosen[sym.name] = (int(sym["st_value"]), hidden, kind != "STT_FUNC")
            # an IFUNC's address is its resolver, not the code that runs: never probe it
            functions = {name: addr for name, (addr, _h, ifunc) in chosen.items() if not ifunc}
            loads = [seg for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"]
            entry: dict[str, bytes] = {}
            for name, addr in functions.items():
                for seg in loads:
                    if seg["p_vaddr"] <= addr < seg["p_vaddr"] + seg["p_filesz"]:
                        f.seek(addr - seg["p_vaddr"] + seg["p_offset"])
                        entry[name] = f.read(4)
                        break
            soname = ""
            dyn = elf.get_section_by_name(".dynamic")
            if isinstance(dyn, DynamicSection):
                for tag in dyn.iter_tags():
                    if tag.entry.d_tag == "DT_SONAME":
                        soname = str(getattr(tag, "soname", ""))
            return SymbolTable(functions, soname, entry)
    except (OSError, ELFError, ValueError) as err:
        raise LibraryError(f"{path}: {err}") from err


class SymbolCache:
    """Symbol tables by file identity, so a library shared by many processes is read once."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, int, int, int], SymbolTable] = {}

    def get(self, path: str) -> SymbolTable:
        import os  # noqa: PLC0415 - tiny

        try:
            st = os.stat(path)  # noqa: PTH116 - a /proc/PID/root path string
        except OSError as err:
            raise LibraryError(f"{path}: {err}") from err
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = read_symbols(path)
        return table
