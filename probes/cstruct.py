"""ctypes classes read from the C structs of the BPF programs.

A ring-buffer record is declared once, as a C struct in the family's ``.bpf.c``; the loader
decodes it with the ``ctypes.Structure`` built here from that declaration, with the same
field names in the same order. The reader understands what the records use and nothing
more: members of one fixed-width integer type (``u8`` .. ``u64``, ``s8`` .. ``s64``, their
``__`` spellings, ``int``) or ``char``, alone or as a one-dimensional array whose length is an
integer literal or a name ``#define``d as one. Anything else (a pointer, a bit-field, a nested
struct, an attribute, ``unsigned long``) raises ``StructLayoutError`` naming the struct and
the member, rather than guessing a layout.

ctypes lays the fields out with the natural alignment of their types, as clang does for the
BPF target; each program still asserts the struct's size against the class's at compile time
(``KVW_MIRRORED`` in common.h, fed by ``bpf.sizeof_flags``), so a layout this reader got
wrong fails the compile, naming the struct.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping
from typing import Any

from kvwatch.probes.errors import ProbeError

_INTEGERS: dict[str, type[ctypes._SimpleCData[Any]]] = {
    "u8": ctypes.c_uint8,
    "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "s8": ctypes.c_int8,
    "s16": ctypes.c_int16,
    "s32": ctypes.c_int32,
    "s64": ctypes.c_int64,
}
TYPES: Mapping[str, type[ctypes._SimpleCData[Any]]] = {
    **_INTEGERS,
    **{f"__{name}": ctype for name, ctype in _INTEGERS.items()},
    "int": ctypes.c_int32,  # 32 bits on the BPF target and on every host bcc runs on
    "char": ctypes.c_char,  # arrays of it decode to bytes, cut at the first NUL
}

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_NUMBER = r"[1-9]\d*|0[xX][0-9a-fA-F]+|0"  # decimal or hexadecimal: no octal, no suffix in array lengths
_DEFINE = re.compile(rf"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+({_NUMBER})[uUlL]*[ \t]*$", re.MULTILINE)
_MEMBER = re.compile(r"([A-Za-z_]\w*)\s+([A-Za-z_]\w*)\s*(?:\[\s*([^\]]*?)\s*\])?")


class StructLayoutError(ProbeError):
    """A struct declaration the reader does not understand, or cannot find."""


def uncomment(text: str) -> str:
    """``text`` with its C comments replaced by a space each (string literals are not expected)."""
    return _COMMENT.sub(" ", text)


def integer_defines(text: str) -> dict[str, int | None]:
    """Each name ``#define``d as a plain integer in ``text``; None for one defined twice differently."""
    out: dict[str, int | None] = {}
    for name, value in _DEFINE.findall(uncomment(text)):
        number = int(value, 0)
        out[name] = number if out.get(name, number) == number else None
    return out


def struct_body(text: str, name: str) -> str:
    """The text between the braces of the one definition of ``struct name`` in ``text``."""
    code = uncomment(text)
    starts = [m.end() for m in re.finditer(rf"\bstruct\s+{re.escape(name)}\s*\{{", code)]
    if len(starts) != 1:
        raise StructLayoutError(f"struct {name}: {len(starts)} definitions found, expected exactly one")
    end = code.find("}", starts[0])
    if end < 0:
        raise StructLayoutError(f"struct {name}: no closing brace")
    body = code[starts[0] : end]
    if "{" in body:
        raise StructLayoutError(f"struct {name}: nested definitions are not supported")
    if not code[end + 1 :].lstrip().startswith(";"):
        raise StructLayoutError(f"struct {name}: only ';' may follow the closing brace (no attributes, no declarators)")
    return body


def _member(struct: str, declaration: str, defines: Mapping[str, int | None]) -> tuple[str, type[ctypes._CData]]:
    """One member's name and ctypes type, from its declaration (the text before its ';')."""
    words = " ".join(declaration.split())
    if not words:
        raise StructLayoutError(f"struct {struct}: an empty member declaration (';;')")
    if words.startswith(("struct ", "union ", "enum ")):
        label = words.rsplit(" ", 1)[-1]
        raise StructLayoutError(f"struct {struct}, field {label}: struct, union and enum members are not supported")
    m = _MEMBER.fullmatch(words)
    if m is None:
        declarator = re.split(r"[\[:(,=]|\b__attribute__\b", words, maxsplit=1)[0]
        label = ([*re.findall(r"[A-Za-z_]\w*", declarator)] or [words])[-1]
        raise StructLayoutError(f"struct {struct}, field {label}: cannot read declaration {words!r}")
    type_name, field, length = m.groups()
    ctype = TYPES.get(type_name)
    if ctype is None:
        raise StructLayoutError(f"struct {struct}, field {field}: type {type_name!r} is not understood")
    if length is None:
        return field, ctype
    count = int(length, 0) if re.fullmatch(_NUMBER, length) else defines.get(length)
    if count is None or count <= 0:
        raise StructLayoutError(
            f"struct {struct}, field {field}: array length {length!r} is neither a positive integer literal "
            "nor a name #defined once as one"
        )
    array: type[ctypes._CData] = ctype * count
    return field, array


def read_struct(text: str, name: str) -> type[ctypes.Structure]:
    """A ``ctypes.Structure`` subclass named ``name`` with the fields of ``struct name`` in ``text``.

    ``text`` is the program as the compiler sees it (``bpf.program_text``), so array lengths
    may use names defined in common.h. Raises ``StructLayoutError`` naming the struct, and the
    member where there is one, for anything outside the supported declarations."""
    defines = integer_defines(text)
    declarations = struct_body(text, name).split(";")
    if declarations[-1].strip():
        raise StructLayoutError(f"struct {name}: the last member is not closed by ';'")
    fields = [_member(name, d, defines) for d in declarations[:-1]]
    if not fields:
        raise StructLayoutError(f"struct {name}: no members")
    seen: set[str] = set()
    for field, _ in fields:
        if field in seen:
            raise StructLayoutError(f"struct {name}, field {field}: declared twice")
        seen.add(field)
    return type(name, (ctypes.Structure,), {"_fields_": tuple(fields), "__doc__": f"``struct {name}``, read from C."})


def read_structs(text: str, *names: str) -> dict[str, type[ctypes.Structure]]:
    """``read_struct`` for each name, by name (the shape ``bpf.sizeof_flags`` takes)."""
    return {name: read_struct(text, name) for name in names}
