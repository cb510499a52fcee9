"""The node key behind tenant names (``engines.tenant_key_file``, ``tenants.py:load_key``) against a
hostile file system, with real files: kvwatch runs as root, so whatever is planted at the key's
path must be neither followed, nor blocked on, nor trusted, nor destroyed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.daemon.engines.tenants import KEY_BYTES, load_key


def _state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state


def test_a_symlink_planted_at_the_temporary_file_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    key_path = _state(tmp_path) / "tenant.key"
    (key_path.parent / "tenant.key.new").symlink_to(victim)
    key, problem = load_key(key_path)
    assert problem == "" and len(key) == KEY_BYTES
    assert victim.read_bytes() == b"precious"  # not truncated, not written
    st = key_path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and key_path.read_bytes() == key
    assert load_key(key_path) == (key, "")


def test_a_stale_world_readable_temporary_file_does_not_expose_the_key(tmp_path: Path) -> None:
    key_path = _state(tmp_path) / "tenant.key"
    stale = key_path.parent / "tenant.key.new"
    stale.write_bytes(b"x")
    stale.chmod(0o644)
    key, problem = load_key(key_path)
    assert problem == "" and stat.S_IMODE(key_path.stat().st_mode) == 0o600 and key_path.read_bytes() == key
    assert [p.name for p in key_path.parent.iterdir() if p.read_bytes() == key] == ["tenant.key"]


@pytest.mark.parametrize("size", [0, 16, 33, 4096])
def test_a_key_of_the_wrong_length_is_refused_not_replaced(tmp_path: Path, size: int) -> None:
    key_path = _state(tmp_path) / "tenant.key"
    old = bytes(range(256)) * 16
    key_path.write_bytes(old[:size])
    key_path.chmod(0o600)
    inode = key_path.stat().st_ino
    key, problem = load_key(key_path)
    assert len(key) == KEY_BYTES and f"{size} bytes" in problem and str(key_path) in problem
    assert key_path.read_bytes() == old[:size] and key_path.stat().st_ino == inode  # left for the operator
    assert old[:size].hex() not in problem or size == 0
    key2, _ = load_key(key_path)
    assert key2 != key  # a key of this run's own, never one derived from the refused file


def test_a_fifo_at_the_key_path_returns_at_once(tmp_path: Path) -> None:
    """Opening a FIFO for reading blocks until a writer comes: load_key must never open one.
    In a child process, so that a blocked open is a failed test rather than a hung run."""
    key_path = _state(tmp_path) / "tenant.key"
    os.mkfifo(key_path, 0o600)
    code = (
        "import sys; from pathlib import Path; from kvwatch.daemon.engines.tenants import load_key\n"
        "key, problem = load_key(Path(sys.argv[1])); print(len(key)); print(problem)"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(key_path)], check=True, capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        pytest.fail("load_key blocked on a FIFO at the key path")
    size, problem = done.stdout.splitlines()[:2]
    assert size == str(KEY_BYTES) and "not a regular file" in problem
    assert stat.S_ISFIFO(key_path.lstat().st_mode)  # refused, left as it is


def test_a_symlink_at_the_key_path_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "known.key"
    planted.write_bytes(b"k" * KEY_BYTES)  # a key someone else knows
    planted.chmod(0o600)
    key_path = _state(tmp_path) / "tenant.key"
    key_path.symlink_to(planted)
    key, problem = load_key(key_path)
    assert key != b"k" * KEY_BYTES and "symbolic link" in problem
    assert key_path.is_symlink() and planted.read_bytes() == b"k" * KEY_BYTES


def test_a_key_others_can_read_or_that_others_own_is_refused(tmp_path: Path) -> None:
    key_path = _state(tmp_path) / "tenant.key"
    key_path.write_bytes(b"k" * KEY_BYTES)
    key_path.chmod(0o644)
    key, problem = load_key(key_path)
    assert key != b"k" * KEY_BYTES and "0o644" in problem and "others" in problem
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o644  # the operator's to fix (or remove)
    if os.geteuid() == 0:
        key_path.chmod(0o600)
        os.chown(key_path, 65534, 65534)
        key, problem = load_key(key_path)
        assert key != b"k" * KEY_BYTES and "owned by uid 65534" in problem


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """Others able to rename files in the key's directory could swap the key under kvwatch."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit
    key, problem = load_key(shared / "tenant.key")
    assert len(key) == KEY_BYTES and "writable by others" in problem and str(shared) in problem
    assert list(shared.iterdir()) == []
    shared.chmod(0o1777)  # sticky, like /tmp: others cannot rename or remove kvwatch's files
    key, problem = load_key(shared / "tenant.key")
    assert problem == "" and (shared / "tenant.key").read_bytes() == key


def test_the_key_is_private_whatever_the_umask(tmp_path: Path) -> None:
    key_path = tmp_path / "made" / "deeper" / "tenant.key"
    old = os.umask(0)
    try:
        key, problem = load_key(key_path)
    finally:
        os.umask(old)
    assert problem == "" and stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_path.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in key_path.parent.iterdir()) == ["tenant.key"]  # no temporary file left
