"""The engine taps' node key (``taps.py``, its ``node_key``): a key file kvwatch refuses is
reported once, as a warning naming the path and why, never with the key's bytes, and counted;
tenants are still named, with a key of the run's own."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.logs import ErrorBook


class _NoScraper:
    def close(self) -> None:
        pass


def test_a_refused_key_file_is_reported_once_and_tenants_still_named(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    key_file = state / "tenant.key"
    damaged = b"\x5a" * 16
    key_file.write_bytes(damaged)
    key_file.chmod(0o600)
    errors = ErrorBook()
    taps = EngineTaps(EnginesConfig(tenant_key_file=key_file), ProcFS(tmp_path), errors, scraper=_NoScraper())  # type: ignore[arg-type]
    try:
        namer = taps.hub.namer
        assert namer is not None
        with capture_logs() as logs:
            names = {namer.name(salt, None) for salt in ("a", "b", "a")}
        assert len(names) == 2 and all(n.startswith("salt-") for n in names)
        assert errors.counts["tenant_key"] == 1
        (line,) = [e for e in logs if e.get("kind") == "tenant_key"]
        assert line["log_level"] == "warning" and str(key_file) in line["event"] and "16 bytes" in line["event"]
        assert damaged.hex() not in str(line) and "ZZZZ" not in str(line)
        assert key_file.read_bytes() == damaged  # left for the operator to restore
    finally:
        taps.close()
