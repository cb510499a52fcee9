"""Which endpoints a watched process's command line may send kvwatch to (issue 35, item 8, and
the KV event side of the same rule): only what belongs to the process itself. Its /metrics on
loopback when it shares kvwatch's network namespace, or on an address local to its own network
namespace (its pod IP, or the node's own address); never a metadata address, another host or a
name to resolve. KV event streams: at most 256 data-parallel ranks, ports within 1..65535, an
ipc path inside the engine's own root. Each refusal is a note of the plan and counted."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.config import DiscoveryConfig, EnginesConfig
from kvwatch.daemon.discovery import Discovery
from kvwatch.daemon.engines.cmdline import plan_from_cmdline
from kvwatch.daemon.engines.planning import MAX_DATA_PARALLEL_RANKS
from kvwatch.daemon.engines.reach import Reach, local_addresses
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.model.engines import EnginePlan, EngineView
from kvwatch.daemon.tracker import Tracked
from kvwatch.exporters.prom_engines import engine_families
from tests.support.procfs import FakeProc, make_proc
from tests.support.snapshots import snap

VLLM = ["/opt/venv/bin/python3", "/opt/venv/bin/vllm", "serve", "m"]
KV = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}


def fib_trie(*local: str) -> str:
    """A namespace's routing table with these local addresses (and loopback)."""
    rows = "".join(f"           |-- {a}\n              /32 host LOCAL\n" for a in local)
    return f"Main:\n  +-- 0.0.0.0/0 3 0 5\n{rows}           |-- 127.0.0.1\n              /32 host LOCAL\n"


IF_INET6 = "fd000000000000000000000000000007 02 40 00 80 eth0\n00000000000000000000000000000001 01 80 10 80 lo\n"


def plan(tmp_path: Path, argv: list[str], *, pod: bool = False, local: tuple[str, ...] = ()) -> EnginePlan:
    """The plan of a vLLM API server with ``argv``; ``pod``: in a network namespace of its own;
    ``local``: the addresses of its namespace (none: its routing table cannot be read)."""
    root = make_proc(tmp_path / "proc", [FakeProc(300, "vllm", argv)])
    if pod:
        (root / "300" / "ns").mkdir()
        (root / "300" / "ns" / "net").write_text("")
    if local:
        (root / "300" / "net").mkdir()
        (root / "300" / "net" / "fib_trie").write_text(fib_trie(*local))
        (root / "300" / "net" / "if_inet6").write_text(IF_INET6)
    fs = ProcFS(tmp_path)
    (proc,) = Discovery(DiscoveryConfig(proc_root=root), fs).scan()
    p = plan_from_cmdline(Tracked(proc, 0.0), argv, EnginesConfig(), Reach(fs))
    assert p is not None
    return p


def test_a_metadata_address_on_the_command_line_is_refused(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--host", "169.254.169.254", "--port", "80"], local=("192.168.5.10",))
    assert p.metrics_url is None and p.refused == {"metrics_host": 1}
    assert any("169.254.169.254" in n and "not an address of the engine" in n for n in p.notes)


@pytest.mark.parametrize("host", ["metadata.google.internal", "evil.example@169.254.169.254", "10.0.0.1/x"])
def test_a_name_is_refused_never_resolved(tmp_path: Path, host: str) -> None:
    p = plan(tmp_path, [*VLLM, "--host", host], local=("192.168.5.10",))
    assert p.metrics_url is None and p.refused == {"metrics_host": 1}
    assert not any(host in n for n in p.notes)  # a name is not repeated (an address is)


def test_an_address_of_its_own_namespace_is_allowed_another_is_not(tmp_path: Path) -> None:
    """A pod with two addresses: either is its own (the second too, not only the first the
    routing table lists); a neighbour's address is not."""
    own = plan(
        tmp_path / "a", [*VLLM, "--host", "10.244.2.9", "--port", "8001"], pod=True, local=("10.244.1.7", "10.244.2.9")
    )
    assert own.metrics_url == "http://10.244.2.9:8001/metrics" and own.refused == {}
    v6 = plan(tmp_path / "b", [*VLLM, "--host", "fd00::7"], pod=True, local=("10.244.1.7",))
    assert v6.metrics_url == "http://[fd00::7]:8000/metrics"
    other = plan(tmp_path / "c", [*VLLM, "--host", "10.244.1.99"], pod=True, local=("10.244.1.7", "10.244.2.9"))
    assert other.metrics_url is None and other.refused == {"metrics_host": 1}
    wildcard = plan(tmp_path / "d", [*VLLM, "--host", "0.0.0.0"], pod=True, local=("10.244.1.7",))
    assert wildcard.metrics_url == "http://10.244.1.7:8000/metrics"


def test_in_kvwatchs_namespace_its_loopback_and_the_nodes_addresses_are_its_own(tmp_path: Path) -> None:
    assert plan(tmp_path / "a", [*VLLM, "--host", "192.168.5.10"], local=("192.168.5.10",)).metrics_url == (
        "http://192.168.5.10:8000/metrics"
    )
    assert plan(tmp_path / "b", [*VLLM, "--host", "127.0.0.2"]).metrics_url == "http://127.0.0.2:8000/metrics"
    assert plan(tmp_path / "c", [*VLLM, "--host", "localhost"]).metrics_url == "http://127.0.0.1:8000/metrics"
    refused = plan(tmp_path / "d", [*VLLM, "--host", "192.168.5.11"], local=("192.168.5.10",))
    assert refused.metrics_url is None and refused.refused == {"metrics_host": 1}
    unreadable = plan(tmp_path / "e", [*VLLM, "--host", "192.168.5.10"])  # no routing table to check against
    assert unreadable.metrics_url is None and unreadable.refused == {"metrics_host": 1}


def test_the_real_proc_of_this_process() -> None:
    """kvwatch's own /proc: this test process shares its namespace; its routing table is real."""
    fs = ProcFS()
    reach = Reach(fs)
    pid = os.getpid()
    assert reach.http_host("127.0.0.1", pid)[0] == "127.0.0.1"
    assert reach.http_host("::1", pid)[0] == "::1"
    addr, note, refused = reach.http_host("169.254.169.254", pid)
    assert (addr, refused) == (None, True) and note
    for own in local_addresses(fs.fib_trie(pid)):
        assert reach.http_host(own, pid)[0] == own


@pytest.mark.parametrize("port", ["0", "70000", "-1", "80x"])
def test_a_metrics_port_out_of_range_is_refused(tmp_path: Path, port: str) -> None:
    p = plan(tmp_path, [*VLLM, "--port", port])
    assert p.metrics_url is None and p.refused == {"metrics_port": 1}


def test_data_parallel_ranks_are_bounded(tmp_path: Path) -> None:
    """``[[engines.endpoints]]`` caps its data_parallel_ranks at 256: a command line gets the same
    bound, the excess noted and counted, whatever it asks for (a list of 10^12 ranks was built)."""
    kv = ["--kv-events-config", json.dumps(KV)]
    p = plan(tmp_path / "a", [*VLLM, *kv, "--data-parallel-size", "100000"])
    assert len(p.streams) == MAX_DATA_PARALLEL_RANKS == 256
    assert p.refused == {"kv_event_streams": 100_000 - 256}
    assert any("100000 data-parallel ranks" in n for n in p.notes)
    huge = plan(tmp_path / "b", [*VLLM, *kv, "-dp", "1" + "0" * 12, "-dpl", "1" + "0" * 40, "-dpr", "-5"])
    assert len(huge.streams) == 256 and huge.streams[0].dp_rank == 0


def test_kv_event_ports_stay_within_range(tmp_path: Path) -> None:
    kv = {**KV, "endpoint": "tcp://*:65534", "replay_endpoint": "tcp://*:65535"}
    p = plan(tmp_path / "a", [*VLLM, "--kv-events-config", json.dumps(kv), "-dp", "3"])
    assert [(s.endpoint, s.replay) for s in p.streams] == [
        ("tcp://127.0.0.1:65534", "tcp://127.0.0.1:65535"),
        ("tcp://127.0.0.1:65535", None),  # its replay endpoint would be port 65536
    ]
    assert p.refused == {"kv_event_endpoint": 2}  # rank 1's replay endpoint, rank 2's stream
    bad = plan(tmp_path / "b", [*VLLM, "--kv-events-config", json.dumps({**KV, "endpoint": "tcp://*:55x"})])
    assert bad.streams == () and bad.refused == {"kv_event_endpoint": 1}


@pytest.mark.parametrize("path", ["ipc:///../../run/other/kv.sock", "ipc://../kv.sock", "ipc:///tmp/../../x"])
def test_an_ipc_path_leaving_the_engines_root_is_refused(tmp_path: Path, path: str) -> None:
    p = plan(tmp_path, [*VLLM, "--kv-events-config", json.dumps({**KV, "endpoint": path})])
    assert p.streams == () and p.refused == {"kv_event_endpoint": 1}


def test_refusals_are_exported_per_engine(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--host", "169.254.169.254", "--kv-events-config", json.dumps(KV), "-dp", "300"])
    s = snap(10.0, 1, 1)
    view = EngineView(p, (), None, None, None)
    fams = {f.name: f for f in engine_families(_with_engine(s, view))}
    got = {x.labels["reason"]: x.value for x in fams["kvwatch_engine_taps_refused"].samples}
    assert got == {"metrics_host": 1, "kv_event_streams": 44}


def _with_engine(s: Any, view: EngineView) -> Any:
    return replace(s, processes=(replace(s.processes[0], engine=view),))
