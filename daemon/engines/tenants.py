"""Tenants of a shared KV pool, told from the KV event stream, and their names.

vLLM hashes a request's ``cache_salt`` (the per-tenant prefix-cache isolation key its OpenAI
server takes per request) into the request's first block, where the salt is the last string of
the block's ``extra_keys``, and an adapter's name into every block of a LoRA request
(``lora_name``). A block stored after a parent belongs to its parent's tenant: the salt is in
the parent's hash, hence in every hash after it. So a block's tenant is read once, at its store,
and kept with the block (``hashmem.py`` tags); its removal, regret or loss is charged to it.

Names, first match: a ``[[engines.tenants]]`` rule for the salt (or its SHA-256), one for the
adapter, then ``salt-`` and 8 hex of HMAC-SHA256(node key, salt), then ``lora:`` and the adapter's
name. Requests with neither are ``default``; blocks whose tenant the stream cannot tell (a parent
stored before kvwatch listened, or forgotten) are ``unknown``. A salt is a tenant's secret: it
never leaves this module, only names do. The node key is generated once and kept on disk
(``engines.tenant_key_file``), so that a salt keeps its name across restarts.

Cardinality: a stream interns at most MAX_TENANTS names (the rest count as ``other``); an engine
process has one ``TenantFold``: its first ``tenant_top_k`` tenants by activity keep their own
name for as long as it runs, and the rest are counted under ``other``, which only ever grows. The
detectors' tenant history and the exported rows are both folded by it (``tenant_view.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from kvwatch.daemon.config import TenantRule

DEFAULT, UNKNOWN, OTHER = 0, 1, 2
RESERVED = ("default", "unknown", "other")
MAX_TENANTS = 256  # names interned per stream
MAX_LORA_CHARS = 40
KEY_BYTES = 32


def load_key(path: Path) -> tuple[bytes, str]:
    """The node's naming key from ``path``, created there when missing; else a key for this run
    only, and why (names then change at the next restart).

    kvwatch runs as root, so the key's path is treated as hostile. The key is read only from a
    regular file of exactly KEY_BYTES that kvwatch's user owns and no one else may read or write,
    in a directory (and ancestors) no one else can change; a symbolic link is never followed and
    a FIFO or device never opened, so nothing here blocks. Anything else is refused and left as
    it is, never replaced: a key of the wrong length may be the damaged key the operator wants
    back, and a new one would rename every tenant for good. A new key is written 0600 to a fresh
    file of a random name (created exclusively, never a planted one), synced, then linked into
    place only if no key appeared meanwhile. No message carries the key's bytes."""
    try:
        dir_fd = _open_safe_dir(path.parent)
    except _Refused as why:
        return os.urandom(KEY_BYTES), f"refused {path}: {why}"
    except OSError as err:
        return os.urandom(KEY_BYTES), f"cannot create {path.parent}: {err.strerror}"
    try:
        key = _read_key(path.name, dir_fd) or _create_key(path.name, dir_fd)
    except _Refused as why:
        return os.urandom(KEY_BYTES), f"refused {path}: {why}"
    except OSError as err:
        return os.urandom(KEY_BYTES), f"cannot write {path}: {err.strerror}"
    finally:
        os.close(dir_fd)
    return key, ""


class _Refused(Exception):
    """A key file or directory kvwatch must not trust; the message says what to do about it."""


def _open_safe_dir(directory: Path) -> int:
    """A descriptor of the key's directory, made 0700 when missing: its real path's every part
    owned by kvwatch's user or root and writable by no one else (a sticky directory, like /tmp,
    excepted: others cannot rename or remove what is not theirs there)."""
    missing = []
    for part in (directory, *directory.parents):
        if os.path.lexists(part):
            break
        missing.append(part)
    for part in reversed(missing):  # each part made 0700 (Path.mkdir makes parents 0777 less the umask)
        with contextlib.suppress(FileExistsError):
            part.mkdir(mode=0o700)
    real = Path(os.path.realpath(directory))
    for part in (real, *real.parents):
        st = os.lstat(part)
        if st.st_uid not in (0, os.geteuid()):
            raise _Refused(f"{part} is owned by uid {st.st_uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _Refused(f"{part} is writable by others (mode {oct(stat.S_IMODE(st.st_mode))})")
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    checked = os.lstat(real)
    if (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):  # swapped since the check
        os.close(fd)
        raise _Refused(f"{real} changed while it was checked")
    return fd


def _read_key(name: str, dir_fd: int) -> bytes | None:
    """The key in ``name``, or None when there is none."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _Refused("it is a symbolic link; remove it for a new key")
    if not stat.S_ISREG(st.st_mode):
        raise _Refused("it is not a regular file; remove it for a new key")
    try:  # O_NONBLOCK: should a FIFO be swapped in after the check, opening it does not wait
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("it is not a regular file; remove it for a new key")
        if st.st_uid != os.geteuid():
            raise _Refused(f"it is owned by uid {st.st_uid}, not kvwatch's {os.geteuid()}")
        if st.st_mode & 0o077:
            raise _Refused(
                f"others may read or write it (mode {oct(stat.S_IMODE(st.st_mode))}): it may be known; "
                "remove it for a new key, or chmod 600 it to keep it"
            )
        data = os.read(fd, KEY_BYTES + 1) if st.st_size == KEY_BYTES else b""
        if len(data) != KEY_BYTES:
            raise _Refused(f"it has {st.st_size} bytes, not {KEY_BYTES}; restore the key, or remove it for a new one")
        return data
    finally:
        os.close(fd)


def _create_key(name: str, dir_fd: int) -> bytes:
    key = os.urandom(KEY_BYTES)
    tmp = f".{name}.{secrets.token_hex(8)}.new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask left
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:  # a link never replaces: a key another kvwatch made meanwhile is kept (and read)
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            theirs = _read_key(name, dir_fd)
            if theirs is None:
                raise
            return theirs
        os.fsync(dir_fd)
        return key
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)


def _sha256(salt: str) -> str:
    return hashlib.sha256(salt.encode()).hexdigest()


class TenantNamer:
    """``key``: the node key, or how to get it (read, or made, at the first unnamed salt)."""

    def __init__(self, rules: Iterable[TenantRule], key: bytes | Callable[[], bytes]) -> None:
        self._key_source = key
        self._key: bytes | None = key if isinstance(key, bytes) else None
        self._salts: dict[str, str] = {}  # SHA-256 hex of a salt -> name
        self._loras: dict[str, str] = {}
        for r in rules:
            if r.lora is not None:
                self._loras[r.lora] = r.name
            else:
                self._salts[r.salt_sha256 or _sha256(r.salt or "")] = r.name

    def name(self, salt: str | None, lora: str | None) -> str:
        if salt is not None:
            named = self._salts.get(_sha256(salt))
            if named is not None:
                return named
        if lora is not None and lora in self._loras:
            return self._loras[lora]
        if salt is not None:
            if self._key is None:
                self._key = self._key_source() if callable(self._key_source) else self._key_source
            return "salt-" + hmac.new(self._key, salt.encode(), hashlib.sha256).hexdigest()[:8]
        if lora is not None:
            ok = lora.isprintable() and len(lora) <= MAX_LORA_CHARS
            return "lora:" + (lora if ok else hashlib.sha256(lora.encode()).hexdigest()[:8])
        return RESERVED[DEFAULT]


def _seen_key(salt: str | None, lora: str | None) -> bytes:
    """A fixed-size key for a (salt, adapter) pair: SHA-256 of both, each length-prefixed (None
    apart from ""), so that no two pairs share one. A salt is chosen by an API client and may be
    as long as a message: it is never kept, only this."""
    h = hashlib.sha256()
    for part in (salt, lora):
        if part is None:
            h.update(b"\xff")
        else:
            raw = part.encode("utf-8", "surrogatepass")
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
    return h.digest()


class TenantBook:
    """One stream's tenants: each name interned to a small tag (``RESERVED`` first). The pairs
    already named are remembered by digest (at most 4 x MAX_TENANTS of 32 bytes each)."""

    def __init__(self, namer: TenantNamer) -> None:
        self.namer = namer
        self.names: list[str] = list(RESERVED)
        self._tags = {n: i for i, n in enumerate(RESERVED)}
        self._seen: dict[bytes, int] = {}
        self.active = False  # a salt or an adapter seen: blocks are charged to tenants from now on
        self.overflow = 0  # distinct tenants past MAX_TENANTS, counted as other

    def tag(self, salt: str | None, lora: str | None) -> int:
        key = _seen_key(salt, lora)
        t = self._seen.get(key)
        if t is not None:
            return t
        self.active = True
        name = self.namer.name(salt, lora)
        t = self._tags.get(name)
        if t is None:
            if len(self.names) >= MAX_TENANTS:
                self.overflow += 1
                t = OTHER
            else:
                t = self._tags[name] = len(self.names)
                self.names.append(name)
        if len(self._seen) < 4 * MAX_TENANTS:
            self._seen[key] = t
        return t


K = TypeVar("K")


class TenantFold:
    """One engine process's tenants folded to at most ``top_k`` own labels plus the reserved ones.

    A tenant keeps its label from its first fold while the engine runs, and a tenant folded into
    ``other`` stays there: every series is monotonic, and the labels always sum to the engine's
    totals. Free labels go to the most active tenants (``activity``) at the fold that first sees
    them. Whatever is folded by the same fold (the detectors' tenant history, the exported rows) carries
    the same labels."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.labels: set[str] = set()  # tenants with their own label
        self.folded: set[str] = set()  # tenants counted under other (names only, bounded by the books)

    def fold(
        self,
        counters: Mapping[str, Mapping[K, float]],
        gauges: Mapping[str, Mapping[K, float]],
        activity: Mapping[str, float],
    ) -> dict[str, dict[K, float]]:
        """``counters`` and ``gauges`` by tenant name; the same keyed by label."""
        self._label(activity)
        out: dict[str, dict[K, float]] = {}
        for values in (counters, gauges):
            for name, by in values.items():
                own = name in RESERVED[:OTHER] or name in self.labels
                if not own and name not in RESERVED:
                    self.folded.add(name)
                into = out.setdefault(name if own else RESERVED[OTHER], {})
                for k, v in by.items():
                    into[k] = into.get(k, 0.0) + v
        return out

    def _label(self, activity: Mapping[str, float]) -> None:
        """Free labels to the most active tenants never folded (a tenant once counted under
        other stays there: its series would start in the middle of its life)."""
        free = self.top_k - len(self.labels)
        if free > 0:
            fresh = [n for n in activity if n not in self.labels and n not in RESERVED and n not in self.folded]
            self.labels.update(sorted(fresh, key=lambda n: (-activity[n], n))[:free])
