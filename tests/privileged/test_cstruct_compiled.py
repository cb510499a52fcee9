"""Each ring-buffer record's C struct is checked against the ctypes class read from it when the program compiles.

The loaders pass every class's size as ``-DKVW_SIZEOF_<struct>`` and the programs assert
``sizeof`` against it (``KVW_MIRRORED`` in probes/common.h): with the classes as probes/cstruct.py reads them
every program loads, and a class laid out differently (one field more) fails the compile, naming the struct.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvwatch.probes import memory
from kvwatch.probes.bpf import Program, sizeof_flags
from kvwatch.probes.cuda import CudaProbes
from kvwatch.probes.errors import ProbeCompileError
from kvwatch.probes.transfer import TransferProbes

Family = tuple[Path, list[str], Mapping[str, type[ctypes.Structure]]]


def family(name: str) -> Family:
    """The family's program, the flags its loader compiles it with, and its records' ctypes classes."""
    if name == "memory":
        m = memory.MemoryProbes()
        hooks, _ = m.plan()
        return memory.SOURCE, m.cflags(hooks), m.mirrors
    p = CudaProbes() if name == "cuda" else TransferProbes()
    return p.source, p.cflags(), p.mirrors


FAMILIES = ("cuda", "transfer", "memory")


@pytest.mark.parametrize("name", FAMILIES)
def test_mirrors_as_they_are_compile_and_load(name: str) -> None:
    source, cflags, mirrors = family(name)
    assert mirrors
    assert set(sizeof_flags(mirrors)) <= set(cflags)
    Program(source, cflags).close()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_mirror_out_of_step_fails_the_compile_naming_the_struct(name: str, capfd: pytest.CaptureFixture[str]) -> None:
    source, cflags, mirrors = family(name)
    for struct, record in mirrors.items():
        grown = type("Grown", (ctypes.Structure,), {"_fields_": [*record._fields_, ("added", ctypes.c_uint64)]})
        wrong = [f for f in cflags if not f.startswith(f"-DKVW_SIZEOF_{struct}=")] + sizeof_flags({struct: grown})
        assert len(wrong) == len(cflags)
        capfd.readouterr()
        with pytest.raises(ProbeCompileError):
            Program(source, wrong)
        err = capfd.readouterr().err
        assert f"struct {struct} and its ctypes class in the loader differ in size" in err, err[-2000:]
