"""The agent in-process on the real kernel, with a tracepoint this 'kernel' lacks."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.config.load import load_config
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.wiring import assemble, memory_options
from kvwatch.probes.memory import HOOKS, MemoryProbes
from kvwatch.probes.tracefs import tracefs_root
from tests.support.kernel import Child

N_PAGES = 2311


def fake_tracefs_without(tmp: Path, missing: str) -> Path:
    real = tracefs_root()
    assert real is not None
    fake = tmp / "tracing"
    for h in HOOKS:
        cat, ev = h.tracepoint.split(":")
        if h.name == missing:
            continue
        (fake / "events" / cat).mkdir(parents=True, exist_ok=True)
        (fake / "events" / cat / ev).symlink_to(real / "events" / cat / ev)
    return fake


def test_missing_tracepoint_reported_and_rest_keeps_working(tmp_path: Path) -> None:
    config = load_config(environ={}, default_path=None, sets=['discovery.nvml="off"'])
    memory = MemoryProbes(memory_options(config), tracefs_root=fake_tracefs_without(tmp_path, "oom_victim"))
    agent = assemble(config, memory=memory, procfs=ProcFS(proc=config.discovery.proc_root))
    agent.start()
    try:
        snap = agent.snapshot
        assert not snap.ready
        assert any("oom_victim: missing" in r for r in snap.not_ready_reasons)
        probes = {p.name: p.state for p in snap.probes}
        assert probes["oom_victim"] == "missing" and probes["page_free"] == "attached"
        assert any(a.alert == "KVWatchProbeDown" and a.labels["probe"] == "oom_victim" for a in snap.alerts)
        # the rest works: a hand-watched process's page frees are counted
        with Child("pages", str(N_PAGES)) as w:
            info = agent.procfs.info(w.pid)
            agent.tracker.add(agent.discovery.describe(info, "unknown", "manual"))
            w.step("go", "done")
            w.step("go", "done")
            snap = agent.tick()
            (view,) = [p for p in snap.processes if p.pid == w.pid]
            assert view.memory.page_free_pages >= 2 * N_PAGES
        assert snap.errors.get("tick_sample", 0) == 0
    finally:
        agent.close()
