"""Which KV event streams and /metrics endpoints kvwatch taps, from engines' own command lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.config import Config, DiscoveryConfig, EnginesConfig
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.discovery import Discovery
from kvwatch.daemon.engines.cmdline import plan_from_cmdline
from kvwatch.daemon.engines.kinds.vllm import data_parallel_ranks
from kvwatch.daemon.engines.planning import flag_values
from kvwatch.daemon.engines.reach import Reach, local_ipv4
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.engines.tenant_view import TenantFolds
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.engines import MediumTotals, StreamSpec, StreamStats
from kvwatch.daemon.tracker import Tracked
from tests.support.procfs import FakeProc, make_proc

FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.244.1.0/24 2 0 2
        +-- 10.244.1.0/28 2 0 2
           |-- 10.244.1.0
              /24 link UNICAST
           |-- 10.244.1.7
              /32 host LOCAL
        |-- 10.244.1.255
           /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
"""
KV = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
VLLM = ["/opt/venv/bin/python3", "/opt/venv/bin/vllm", "serve", "meta-llama/Llama-3-8B"]


def tracked(
    tmp_path: Path, argv: list[str], *, pid: int = 300, netns_file: bool = False, comm: str = "vllm"
) -> tuple[Tracked, Reach]:
    root = make_proc(tmp_path / "proc", [FakeProc(pid, comm, argv)])
    if netns_file:  # a network namespace that is not ours, with a pod address
        (root / str(pid) / "ns").mkdir()
        (root / str(pid) / "ns" / "net").write_text("")
        (root / str(pid) / "net").mkdir()
        (root / str(pid) / "net" / "fib_trie").write_text(FIB_TRIE)
    fs = ProcFS(tmp_path)
    (proc,) = Discovery(DiscoveryConfig(proc_root=root), fs).scan()
    return Tracked(proc, 0.0), Reach(fs)


def plan(tmp_path: Path, argv: list[str], cfg: EnginesConfig | None = None, **kw: Any) -> Any:
    t, reach = tracked(tmp_path, argv, **kw)
    return plan_from_cmdline(t, argv, cfg or EnginesConfig(), reach)


def test_vllm_json_config_and_port(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--port", "8001", "--kv-events-config", json.dumps(KV)])
    (s,) = p.streams
    assert (s.endpoint, s.replay, s.topic, s.dp_rank) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "", 0)
    assert p.metrics_url == "http://127.0.0.1:8001/metrics" and p.notes == ()


def test_vllm_defaults_and_dotted_flags(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--kv-events-config.enable_kv_cache_events=true", "--kv-events-config.topic", "kv"])
    (s,) = p.streams
    assert (s.endpoint, s.replay, s.topic) == ("tcp://127.0.0.1:5557", None, "kv")  # vLLM's default endpoint
    assert p.metrics_url == "http://127.0.0.1:8000/metrics"


@pytest.mark.parametrize(
    ("kv", "streams"),
    [
        ({"enable_kv_cache_events": False, "publisher": "zmq"}, 0),
        ({"enable_kv_cache_events": True, "publisher": "null"}, 0),
        ({"enable_kv_cache_events": True}, 1),  # publisher None resolves to zmq
    ],
)
def test_vllm_publisher_resolution(tmp_path: Path, kv: dict[str, Any], streams: int) -> None:
    assert len(plan(tmp_path, [*VLLM, "--kv-events-config", json.dumps(kv)]).streams) == streams


def test_vllm_endpoint_it_connects_to_is_a_note(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--kv-events-config", json.dumps({**KV, "endpoint": "tcp://10.0.0.9:7000"})])
    assert p.streams == ()
    assert any("connects out" in n for n in p.notes)


def test_bad_json_is_a_note(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--kv-events-config", "{not json"])
    assert p.streams == () and "not JSON" in p.notes[0]


@pytest.mark.parametrize(
    ("flags", "ranks"),
    [
        ([], [0]),
        (["--data-parallel-size", "4"], [0, 1, 2, 3]),
        (["-dp", "4", "-dpl", "2", "-dpr", "2"], [2, 3]),
        (
            ["--data-parallel-size=8", "--data-parallel-size-local=4", "--data-parallel-start-rank=4", "--headless"],
            [4, 5, 6, 7],
        ),
        (["--data-parallel-size", "4", "--data-parallel-rank", "3"], [3]),
    ],
)
def test_data_parallel_ranks(flags: list[str], ranks: list[int]) -> None:
    assert data_parallel_ranks(flag_values(flags)) == ranks


def test_dp_ranks_on_consecutive_ports(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "-dp", "2", "--kv-events-config", json.dumps(KV)])
    assert [(s.endpoint, s.replay, s.dp_rank) for s in p.streams] == [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 0),
        ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5559", 1),
    ]


def test_other_network_namespace_uses_its_address(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--kv-events-config", json.dumps(KV)], netns_file=True)
    assert p.streams[0].endpoint == "tcp://10.244.1.7:5557"
    assert p.metrics_url == "http://10.244.1.7:8000/metrics"
    q = plan(tmp_path / "b", [*VLLM, "--host", "127.0.0.1"], netns_file=True)
    assert q.metrics_url is None and "another network namespace" in q.notes[0]


def test_ipc_endpoint_through_proc_root(tmp_path: Path) -> None:
    p = plan(tmp_path, [*VLLM, "--kv-events-config", json.dumps({**KV, "endpoint": "ipc:///tmp/kv.sock"})], pid=301)
    assert p.streams[0].endpoint == f"ipc://{tmp_path / 'proc'}/301/root/tmp/kv.sock"


def test_sglang_metrics_only_when_enabled(tmp_path: Path) -> None:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--port", "30001"]
    assert plan(tmp_path / "a", argv, comm="python") is None
    p = plan(tmp_path / "b", [*argv, "--enable-metrics"], comm="python")
    assert p.metrics_url == "http://127.0.0.1:30001/metrics" and p.streams == ()


def test_engine_children_are_not_tapped(tmp_path: Path) -> None:
    assert plan(tmp_path, ["VLLM::EngineCore"], comm="VLLM::EngineCor") is None


def test_local_ipv4_skips_loopback() -> None:
    assert local_ipv4(FIB_TRIE) == "10.244.1.7"
    assert (
        local_ipv4(FIB_TRIE.split("+-- 10.244", maxsplit=1)[0] + "+-- 127.0.0.0/8\n |-- 127.0.0.1\n /32 host LOCAL\n")
        is None
    )


class _Recorder:
    def __init__(self) -> None:
        self.streams: list[Any] = []
        self.targets: list[Any] = []

    def set_streams(self, s: Any) -> None:
        self.streams = list(s)

    def set_targets(self, t: Any) -> None:
        self.targets = list(t)

    def stats(self) -> dict[Any, Any]:
        return {}

    def states(self) -> dict[Any, Any]:
        return {}


def test_one_owner_per_endpoint_and_config_wins(tmp_path: Path) -> None:
    argv = [*VLLM, "--kv-events-config", json.dumps(KV)]
    root = make_proc(
        tmp_path / "proc",
        [
            FakeProc(400, "vllm", argv, start=1000),
            FakeProc(401, "vllm", argv, ppid=400, start=2000),
            FakeProc(402, "vllm", [*VLLM, "--port", "9000"], start=3000),
        ],
    )
    procs = {p.pid: p for p in Discovery(DiscoveryConfig(proc_root=root), ProcFS(tmp_path)).scan()}
    t = [
        Tracked(procs[400], 1.0),
        Tracked(procs[401], 2.0),
        Tracked(procs[402], 3.0),
    ]
    cfg = parse(
        Config,
        {
            "engines": {
                "endpoints": [
                    {
                        "pid": 402,
                        "kv_events": "tcp://10.0.0.5:6000",
                        "kv_events_replay": "tcp://10.0.0.5:6100",
                        "data_parallel_ranks": 2,
                    }
                ]
            }
        },
    ).engines
    hub, scraper = _Recorder(), _Recorder()
    taps = EngineTaps(cfg, ProcFS(tmp_path), ErrorBook(), hub=hub, scraper=scraper)  # type: ignore[arg-type]
    taps.sync(t)
    owners = {s.endpoint: s.owner for s in hub.streams}
    assert owners == {
        "tcp://127.0.0.1:5557": str(procs[400].identity),  # the parent, not the forked child
        "tcp://10.0.0.5:6000": str(procs[402].identity),
        "tcp://10.0.0.5:6001": str(procs[402].identity),
    }
    assert {s.replay for s in hub.streams if s.owner == str(procs[402].identity)} == {
        "tcp://10.0.0.5:6100",
        "tcp://10.0.0.5:6101",
    }
    assert [x.url for x in scraper.targets] == ["http://127.0.0.1:8000/metrics"]  # 402's hand-given taps have no url
    taps.sync(t[1:])  # the parent exits: its stream goes
    assert {s.endpoint: s.owner for s in hub.streams}["tcp://127.0.0.1:5557"] == str(procs[401].identity)


def test_endpoint_config_errors_all_named() -> None:
    from kvwatch.daemon.config.load import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            environ={},
            default_path=None,
            sets=[
                'engines.endpoints=[{kv_events = "tcp://x:1"}, {pid = 5, kv_events = "http://x"}, {pid = 6}]',
                "engines.scrape_interval_seconds=0",
            ],
        )
    text = str(err.value)
    assert "engines.endpoints.0" in text and "exactly one of pid or cmdline" in text
    assert "engines.endpoints.1" in text and "tcp://HOST:PORT" in text
    assert "engines.endpoints.2" in text and "kv_events, metrics_url or both" in text
    assert "engines.scrape_interval_seconds" in text


def test_wrapper_carrying_kv_events_config_is_tapped(tmp_path: Path) -> None:
    """A script that launches vLLM with vLLM's own argument parser, watched by hand (--pid): no
    engine rule knows it, its command line still says where the stream is. /metrics only with
    a --port (the wrapper may serve no HTTP at all)."""
    argv = ["/usr/bin/python3", "/srv/launch_llm.py", "--model", "m", "--kv-events-config", json.dumps(KV)]
    root = make_proc(tmp_path / "proc", [FakeProc(77, "python3", argv)])
    fs = ProcFS(tmp_path)
    (proc,) = Discovery(DiscoveryConfig(proc_root=root, pids=[77]), fs).scan()
    assert proc.labels.engine == "unknown"
    p = plan_from_cmdline(Tracked(proc, 0.0), argv, EnginesConfig(), Reach(fs))
    assert p is not None and [s.endpoint for s in p.streams] == ["tcp://127.0.0.1:5557"]
    assert p.metrics_url is None
    with_port = [*argv, "--port", "8100"]
    p2 = plan_from_cmdline(Tracked(proc, 0.0), with_port, EnginesConfig(), Reach(fs))
    assert p2 is not None and p2.metrics_url == "http://127.0.0.1:8100/metrics"
    bare = ["/usr/bin/python3", "/srv/launch_llm.py", "--model", "m"]
    assert plan_from_cmdline(Tracked(proc, 0.0), bare, EnginesConfig(), Reach(fs)) is None


def test_endpoints_name_processes_to_watch(tmp_path: Path) -> None:
    """[[engines.endpoints]] for a process no engine rule matches: it is watched (by pid, or by
    its command-line pattern with the endpoint's engine label) and gets those taps."""
    root = make_proc(
        tmp_path / "proc",
        [
            FakeProc(81, "python3", ["/usr/bin/python3", "/srv/my_server.py"]),
            FakeProc(82, "server", ["/opt/bin/kvserver", "--listen", "0.0.0.0"]),
            FakeProc(83, "bash", ["bash"]),
        ],
    )
    cfg = parse(
        Config,
        {
            "engines": {
                "endpoints": [
                    {"cmdline": r"my_server\.py", "kv_events": "tcp://127.0.0.1:6000", "engine": "vllm"},
                    {"pid": 82, "metrics_url": "http://127.0.0.1:9100/metrics"},
                ]
            }
        },
    )
    disc = Discovery(DiscoveryConfig(proc_root=root), ProcFS(tmp_path), endpoints=cfg.engines.endpoints)
    found = {p.pid: p for p in disc.scan()}
    assert set(found) == {81, 82}
    assert (found[81].labels.engine, found[81].source) == ("vllm", "rule")
    assert (found[82].labels.engine, found[82].source) == ("unknown", "manual")
    hub, scraper = _Recorder(), _Recorder()
    taps = EngineTaps(cfg.engines, ProcFS(tmp_path), ErrorBook(), hub=hub, scraper=scraper)  # type: ignore[arg-type]
    taps.sync([Tracked(found[81], 1.0), Tracked(found[82], 1.0)])
    assert [s.endpoint for s in hub.streams] == ["tcp://127.0.0.1:6000"]
    assert [t.url for t in scraper.targets] == ["http://127.0.0.1:9100/metrics"]


class _Sleeping(_Recorder):
    """A scraper whose last sample of every target says the engine sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self.at = 0.0

    def states(self) -> dict[Any, Any]:
        from kvwatch.daemon.model.engines import EngineSample, TargetState

        return {t: TargetState(t, 1, {}, EngineSample(at=self.at, sleeping=True)) for t in self.targets}


def test_an_engines_other_processes_learn_its_sleep(tmp_path: Path) -> None:
    """The API server reports sleep mode; its engine core (a child) holds the GPU memory whose
    release and remap the allocator detector must not take for churn."""
    argv = [*VLLM, "--kv-events-config", json.dumps(KV)]
    root = make_proc(
        tmp_path / "proc",
        [
            FakeProc(500, "vllm", argv, start=1000),
            FakeProc(501, "VLLM::EngineCor", ["VLLM::EngineCore"], ppid=500, start=2000),
            FakeProc(502, "VLLM::EngineCor", ["VLLM::EngineCore"], ppid=1, start=3000),  # another engine's
        ],
    )
    fs = ProcFS(tmp_path)
    procs = {p.pid: p for p in Discovery(DiscoveryConfig(proc_root=root), fs).scan()}
    t = {pid: Tracked(procs[pid], float(pid)) for pid in procs}
    scraper = _Sleeping()
    taps = EngineTaps(EnginesConfig(), fs, ErrorBook(), hub=_Recorder(), scraper=scraper, clock=lambda: 1.0)  # type: ignore[arg-type]
    taps.sync(t.values())
    scraper.at = 1.0
    taps.sample(t.values(), 1.0)
    assert t[500].engine_state.sleeping and t[501].engine_state.sleeping
    assert t[500].engine_state.tapped and t[501].engine_state.tapped
    assert t[500].engine_state.scrape is not None and t[501].engine_state.scrape is None  # the scrape is the owner's
    assert not t[502].engine_state.sleeping and not t[502].engine_state.tapped


def test_tenant_pool_is_the_folds_labels_and_adds_up() -> None:
    """A pool with more tenants than engines.tenant_top_k: the busiest keep their series, the rest
    are other's, and the stores still add up to the pool's, over data-parallel ranks."""
    tenants = {f"salt-{i:08x}": MediumTotals(stored=i + 1, removed=i) for i in range(40)}

    def rank(r: int) -> StreamStats:
        return StreamStats(
            spec=StreamSpec(f"tcp://127.0.0.1:{r + 1}"), connected=True, batches=1, events=1, media={}, cleared=0,
            gaps=0, missed=0, replayed=0, lost=0, decode_errors={}, restarts=0, replay_requests=0, last_seq=0,
            last_batch_ts=0.0, last_message_at=0.0, tracked_blocks=0, tenants={"GPU": tenants},
        )  # fmt: skip

    streams = [rank(0), rank(1)]
    pool = TenantFolds(EnginesConfig().tenant_top_k).pool("7@1", streams)
    stored = {k: v.stored for k, v in pool.items()}
    assert len(stored) == EnginesConfig().tenant_top_k + 1 and sum(stored.values()) == 2 * sum(range(1, 41))
    assert "salt-00000027" in stored and "salt-00000000" not in stored
    assert stored["other"] == 2 * sum(range(1, 33))
    assert sum(v.removed for v in pool.values()) == 2 * sum(range(40))
