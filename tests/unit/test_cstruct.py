"""Ring-buffer records are declared once, in C; probes/cstruct.py reads their ctypes classes.

The classes the loaders decode with are compared with the C compiler's own layout: gcc
compiles the same struct declarations (the text of the .bpf.c files, the names they use
from common.h) and prints ``offsetof``, ``sizeof`` and signedness for every member, which must match
the classes' fields, in order. Declarations the reader does not understand raise an error
naming the struct and the member.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvwatch.probes import cuda, memory, transfer
from kvwatch.probes.bpf import PROBES_DIR, program_text, sizeof_flags
from kvwatch.probes.cstruct import StructLayoutError, read_struct, read_structs
from kvwatch.probes.cuda import CudaProbes
from kvwatch.probes.memory import MemoryProbes
from kvwatch.probes.transfer import TransferProbes

# (field, offset, size, kind), in declaration order; kind: 0 unsigned, 1 signed, 2 char (of the
# element, for an array). The struct's own size comes last, as ("", 0, size, 0).
Layout = list[tuple[str, int, int, int]]

LOADERS: dict[str, tuple[Path, Mapping[str, type[ctypes.Structure]]]] = {
    "cuda": (cuda.SOURCE, CudaProbes.mirrors),
    "memory": (memory.SOURCE, MemoryProbes.mirrors),
    "transfer": (transfer.SOURCE, TransferProbes.mirrors),
}

# Every supported member type, with padding before, between and after members.
EVERY_TYPE = """
#define EVERY_LEN 3
#define EVERY_HEX 0x5
struct every_t {
    u8 a;            /* a comment; with { braces } */
    __u64 b;         // and a line comment;
    s16 c[EVERY_LEN];
    __s8 d;
    int e;
    char f[EVERY_HEX];
    __u16 g;
    s64 h;
    __u32 i[2];
    u16 j;
    __s16 k;
    s32 l;
    __s64 m;
    u32 n;
    __u8 o[7];
    s8 p;
    __s32 q;
    u64 r;
};
"""

TYPEDEFS = "\n".join(
    f"typedef {'u' if sign == 'u' else ''}int{bits}_t {prefix}{sign}{bits};"
    for bits in (8, 16, 32, 64)
    for sign in ("u", "s")
    for prefix in ("", "__")
)


def struct_text(text: str, name: str) -> str:
    """The declaration of ``struct name`` as written (the test's own reading, not cstruct's)."""
    m = re.search(rf"^struct {name} \{{.*?^\}};", text, re.DOTALL | re.MULTILINE)
    assert m, name
    return m.group(0)


def members(declaration: str) -> list[tuple[str, bool]]:
    """(name, is an array) of each member of a declaration of plain members (``type name;``, ``type name[len];``)."""
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", declaration.split("{", 1)[1].rsplit("}", 1)[0], flags=re.DOTALL)
    out = []
    for member in body.split(";")[:-1]:
        m = re.fullmatch(r"\s*\w+\s+(\w+)\s*(\[[^\]]*\])?\s*", member)
        assert m, member
        out.append((m.group(1), m.group(2) is not None))
    return out


def used_defines(text: str, declaration: str) -> list[str]:
    """The one-line, object-like #define lines of ``text`` for names ``declaration`` uses, each after an
    #undef (programs define some names alike with other values)."""
    used = set(re.findall(r"\w+", declaration))
    out = []
    for line in text.splitlines():
        m = re.match(r"#define (\w+)\s", line)
        if m and m.group(1) in used and not line.endswith("\\"):
            out += [f"#undef {m.group(1)}", line]
    return out


def gcc_layouts(sources: Mapping[str, str], tmp: Path) -> dict[str, Layout]:
    """Per struct name, gcc's ``Layout``: offsetof, sizeof and the kind of each member, then the struct's size."""
    structs: list[str] = []
    prints: list[str] = []
    for name, text in sources.items():
        declaration = struct_text(text, name)
        structs += [*used_defines(text, declaration), declaration]
        for f, array in members(declaration):
            member = f"((struct {name} *)0)->{f}"
            element = f"{member}[0]" if array else member
            kind = f"_Generic({element}, char: 2, default: (__typeof__({element}))-1 < 0)"
            prints.append(
                f'printf("{name} {f} %zu %zu %d\\n", offsetof(struct {name}, {f}), sizeof({member}), {kind});'
            )
        prints.append(f'printf("{name} - 0 %zu 0\\n", sizeof(struct {name}));')
    body = "\n    ".join(prints)
    program = "\n".join(
        [
            "#include <stddef.h>",
            "#include <stdint.h>",
            "#include <stdio.h>",
            TYPEDEFS,
            *structs,
            f"int main(void) {{\n    {body}\n    return 0;\n}}",
        ]
    )
    return run_c(program, tmp)


def run_c(program: str, tmp: Path) -> dict[str, Layout]:
    """Compile and run ``program``; its lines ``struct field offset size kind`` by struct."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text(program)
    build = subprocess.run([gcc, "-Wall", "-Werror", "-o", exe, src], check=False, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr + program
    out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    layouts: dict[str, Layout] = {}
    for line in out.splitlines():
        struct, field, offset, size, kind = line.split()
        layouts.setdefault(struct, []).append(("" if field == "-" else field, int(offset), int(size), int(kind)))
    return layouts


def kind(ctype: Any) -> int:
    """0 unsigned, 1 signed, 2 char, of a ctypes scalar or of an array's element."""
    element = ctype._type_ if issubclass(ctype, ctypes.Array) else ctype
    return 2 if element is ctypes.c_char else int(element(-1).value < 0)


def ctypes_layout(record: type[ctypes.Structure]) -> Layout:
    fields = [(f, getattr(record, f).offset, getattr(record, f).size, kind(t)) for f, t, *_ in record._fields_]
    return [*fields, ("", 0, ctypes.sizeof(record), 0)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Layout]:
    """gcc's layout of the loaders' structs and of ``every_t``, compiled once for the module."""
    sources = {name: program_text(source) for source, mirrors in LOADERS.values() for name in mirrors}
    return gcc_layouts({**sources, "every_t": EVERY_TYPE}, tmp_path_factory.mktemp("layout"))


def test_each_loader_decodes_its_programs_ring_buffer_struct() -> None:
    assert {family: list(mirrors) for family, (_, mirrors) in LOADERS.items()} == {
        "cuda": ["cuda_event_t"],
        "memory": ["kvw_event_t"],
        "transfer": ["xfer_event_t"],
    }
    for source, mirrors in LOADERS.values():
        assert source.parent == PROBES_DIR
        for name, record in mirrors.items():
            assert record.__name__ == name
            assert f"KVW_MIRRORED({name});" in source.read_text()


@pytest.mark.parametrize("family", sorted(LOADERS))
def test_loader_classes_have_the_c_fields_in_order_at_gccs_offsets(family: str, compiled: dict[str, Layout]) -> None:
    _, mirrors = LOADERS[family]
    for name, record in mirrors.items():
        assert compiled[name][:-1], name  # gcc saw members
        assert ctypes_layout(record) == compiled[name]
        assert sizeof_flags({name: record}) == [f"-DKVW_SIZEOF_{name}={compiled[name][-1][2]}"]


def test_every_supported_type_is_laid_out_as_gcc_does(compiled: dict[str, Layout]) -> None:
    record = read_struct(EVERY_TYPE, "every_t")
    assert [f for f, *_ in record._fields_] == list("abcdefghijklmnopqr")
    assert ctypes_layout(record) == compiled["every_t"]


def test_char_arrays_decode_to_bytes_and_integers_keep_their_sign() -> None:
    record = read_struct(EVERY_TYPE, "every_t")
    r = record(q=-5, n=7, f=b"ab")
    assert (r.q, r.n, r.f) == (-5, 7, b"ab")
    r.c[1] = -2
    assert list(r.c) == [0, -2, 0]


def test_memory_event_names_its_arrays_from_common_h() -> None:
    record = read_structs(program_text(memory.SOURCE), "kvw_event_t")["kvw_event_t"]
    assert record.comm.size == 16  # KVW_COMM_LEN, defined in common.h
    assert record.name.size == 64


UNREADABLE = [
    ("u32 a; unsigned long b;", "field b"),
    ("u32 a; long b;", "field b: type 'long'"),
    ("u64 *p;", "field p"),
    ("u32 flags : 3;", "field flags"),
    ("struct inner_t in;", "field in"),
    ("union { u32 x; } u;", "nested definitions"),
    ("char names[4][16];", "field names"),
    ("char comm[UNDEFINED_LEN];", "field comm: array length 'UNDEFINED_LEN'"),
    ("char comm[TWICE];", "field comm: array length 'TWICE'"),
    ("char comm[ONCE * 2];", "field comm"),
    ("char comm[0];", "field comm"),
    ("u32 a, b;", "cannot read declaration 'u32 a, b'"),
    ("const u32 a;", "field a"),
    ("u64 a __attribute__((aligned(16)));", "field a: cannot read declaration"),
    ("u32 a;; u32 b;", "empty member declaration"),
    ("u32 a; u64 a;", "field a: declared twice"),
    ("", "no members"),
    ("u32 a", "not closed"),
]


@pytest.mark.parametrize(("body", "message"), UNREADABLE)
def test_an_unreadable_member_raises_naming_struct_and_field(body: str, message: str) -> None:
    text = f"#define ONCE 4\n#define TWICE 1\n#define TWICE 2\nstruct bad_t {{\n    {body}\n}};\n"
    with pytest.raises(StructLayoutError, match=r"^struct bad_t\b") as err:
        read_struct(text, "bad_t")
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("struct other_t { u32 a; };", "0 definitions"),
        ("struct bad_t { u32 a; };\nstruct bad_t { u32 a; };", "2 definitions"),
        ("struct bad_t { u32 a; } __attribute__((packed));", "only ';' may follow"),
        ("struct bad_t { u32 a; } one;", "only ';' may follow"),
        ("struct bad_t { u32 a;", "no closing brace"),
    ],
)
def test_an_unreadable_struct_raises_naming_it(text: str, message: str) -> None:
    with pytest.raises(StructLayoutError, match=r"^struct bad_t\b") as err:
        read_struct(text, "bad_t")
    assert message in str(err.value)


def test_a_pointer_to_the_struct_is_not_a_definition() -> None:
    text = "struct ev_t *reserve(void);\nstruct ev_t {\n    u32 a;\n};\nstatic struct ev_t *e;\n"
    assert [f for f, *_ in read_struct(text, "ev_t")._fields_] == ["a"]
