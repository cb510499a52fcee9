from __future__ import annotations

from pathlib import Path

import msgspec

from kvwatch.daemon.config import DiscoveryConfig, EngineRule
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.discovery import Discovery, disagg_role
from kvwatch.daemon.host.cgroups import parse_cgroup
from kvwatch.daemon.host.procfs import ProcessGone, ProcFS
from tests.support.procfs import FakeProc, make_proc

POD = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_1111_2222_3333_444455556666.slice/cri-containerd-"
    + "a" * 64
    + ".scope\n"
)

PROCS = [
    FakeProc(
        100,
        "VLLM::EngineCor",
        ["VLLM::EngineCore"],
        cgroup=POD,
        environ={"HOSTNAME": "vllm-0", "SECRET_TOKEN": "x"},
    ),
    FakeProc(
        101,
        "python3",
        [
            "/usr/bin/python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
        ],
    ),
    FakeProc(102, "vllm", ["/usr/local/bin/vllm", "serve", "meta-llama/Llama-3-8B"]),
    FakeProc(103, "sglang::schedul", ["sglang::scheduler_TP0"]),
    FakeProc(104, "python", ["python", "-m", "sglang.launch_server", "--disaggregation-mode", "decode"]),
    FakeProc(105, "text-generation", ["text-generation-router", "--port", "80"]),
    FakeProc(106, "bash", ["bash", "-c", "echo vllm serve is not me"]),
    FakeProc(107, "vim", ["vim", "notes-about-vllm.txt"]),
    FakeProc(108, "tritonserver", ["tritonserver", "--model-repository=/m"]),
    FakeProc(109, "sleep", ["sleep", "100"]),
]


def disc(tmp_path: Path, procs: list[FakeProc] = PROCS, **cfg: object) -> Discovery:
    root = make_proc(tmp_path / "proc", procs)
    return Discovery(parse(DiscoveryConfig, {"proc_root": root, **cfg}), ProcFS(tmp_path))


def by_pid(d: Discovery) -> dict[int, object]:
    return {p.pid: p for p in d.scan()}


def test_default_rules(tmp_path: Path) -> None:
    found = by_pid(disc(tmp_path))
    assert set(found) == {100, 101, 102, 103, 104, 105, 108}
    engines = {pid: p.labels.engine for pid, p in found.items()}  # type: ignore[attr-defined]
    assert engines == {
        100: "vllm",
        101: "vllm",
        102: "vllm",
        103: "sglang",
        104: "sglang",
        105: "tgi",
        108: "triton",
    }


def test_labels_roles_components_and_pod(tmp_path: Path) -> None:
    found = by_pid(disc(tmp_path))
    core = found[100].labels  # type: ignore[attr-defined]
    assert core.component == "engine_core"
    assert core.container == "a" * 12
    assert core.pod == "vllm-0"  # HOSTNAME, only because a pod UID was found
    assert found[101].labels.role == "prefill"  # type: ignore[attr-defined]
    assert found[101].labels.component == "api_server"  # type: ignore[attr-defined]
    assert found[104].labels.role == "decode"  # type: ignore[attr-defined]
    assert found[105].labels.component == "router"  # type: ignore[attr-defined]
    # only the whitelisted environment keys are kept: never secrets
    assert "SECRET_TOKEN" not in found[100].environ  # type: ignore[attr-defined]


def test_manual_pids_and_custom_rules(tmp_path: Path) -> None:
    d = disc(tmp_path, pids=[109, 99999], rules=[{"engine": "custom", "comm": "^vim$"}])
    found = by_pid(d)
    assert found[109].source == "manual"  # type: ignore[attr-defined]
    assert found[107].labels.engine == "custom"  # type: ignore[attr-defined]
    assert d.stats.vanished == 0  # 99999 is simply not running


def test_rules_can_be_replaced(tmp_path: Path) -> None:
    d = disc(tmp_path, default_rules=False, rules=[msgspec.to_builtins(EngineRule(engine="only", comm="^sleep$"))])
    assert set(by_pid(d)) == {109}


def test_nvml_processes_are_watched_and_errors_counted(tmp_path: Path) -> None:
    root = make_proc(tmp_path / "proc", PROCS)
    cfg = DiscoveryConfig(proc_root=root)
    d = Discovery(cfg, ProcFS(tmp_path), nvml_pids=lambda: [107])
    found = by_pid(d)
    assert found[107].source == "nvml" and found[107].labels.engine == "unknown"  # type: ignore[attr-defined]

    def broken() -> list[int]:
        raise RuntimeError("NVML went away")

    d2 = Discovery(cfg, ProcFS(tmp_path), nvml_pids=broken)
    assert 107 not in by_pid(d2)
    assert d2.stats.errors == 1


def test_hostile_names_and_cmdlines(tmp_path: Path) -> None:
    procs = [
        FakeProc(200, "x) (y z", ["x) (y z"]),  # parentheses and spaces inside comm
        FakeProc(201, "VLLM::Worker\n1", ['VLLM::Worker\n1 "quoted" \\ back']),
        FakeProc(202, "evil", b"vllm\x00serve\x00\xff\xfe\x00" + b"A" * 100_000),
        FakeProc(203, "empty", b""),
    ]
    found = by_pid(disc(tmp_path, procs))
    assert 201 in found and found[201].labels.component == "worker"  # type: ignore[attr-defined]
    assert 202 in found  # matched despite invalid UTF-8; cmdline read is capped
    assert len(found[202].cmdline) <= 4096  # type: ignore[attr-defined]
    st = ProcFS(tmp_path).stat(200)
    assert st.comm == "x) (y z" and st.start_ticks == 1000


def test_vanishing_and_unreadable_processes(tmp_path: Path) -> None:
    root = make_proc(tmp_path / "proc", PROCS)
    (root / "102" / "cmdline").unlink()  # exited between listdir and read
    (root / "103" / "stat").write_text("garbage without parens")
    (root / "104" / "cgroup").unlink()
    (root / "104" / "cgroup").mkdir()  # unreadable entry (EISDIR)

    class Flaky(ProcFS):
        def cmdline(self, pid: int) -> tuple[str, ...]:
            if pid == 105:
                raise ProcessGone("vanished mid-scan")
            return super().cmdline(pid)

    d = Discovery(DiscoveryConfig(proc_root=root), Flaky(tmp_path))
    found = by_pid(d)
    assert set(found) == {100, 101, 108}
    assert d.stats.vanished >= 4


def test_recycled_pid_detected(tmp_path: Path) -> None:
    root = make_proc(tmp_path / "proc", [FakeProc(300, "VLLM::Worker", ["VLLM::Worker"], start=5)])
    fs = ProcFS(tmp_path)
    calls = {"n": 0}

    class Recycling(ProcFS):
        def stat(self, pid: int):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            st = super().stat(pid)
            if calls["n"] >= 2:
                (root / "300" / "stat").write_text((root / "300" / "stat").read_text().replace(" 5 ", " 6 "))
            return st

    d = Discovery(DiscoveryConfig(proc_root=root), Recycling(tmp_path))
    assert d.scan() == []
    assert fs.identity(300).start_ticks == 6


def test_disagg_role_parsing() -> None:
    assert disagg_role("""--kv-transfer-config '{"kv_role": "kv_consumer"}'""") == "decode"
    assert disagg_role("--kv-transfer-config kv_role=kv_both") == "both"
    assert disagg_role("--disaggregation-mode=prefill") == "prefill"
    assert disagg_role("vllm serve m") == ""


def test_cgroup_parsing_variants() -> None:
    docker_v1 = ["12:memory:/docker/" + "b" * 64, "1:name=systemd:/docker/" + "b" * 64]
    assert parse_cgroup(docker_v1).container_id == "b" * 12
    assert parse_cgroup(docker_v1).memory_path == "/docker/" + "b" * 64
    k8s_v1 = ["5:memory:/kubepods/burstable/pod01234567-89ab-cdef-0123-456789abcdef/" + "c" * 64]
    cg = parse_cgroup(k8s_v1)
    assert cg.pod_uid == "01234567-89ab-cdef-0123-456789abcdef" and cg.container_id == "c" * 12
    crio = ["0::/kubepods.slice/kubepods-pod01234567_89ab_cdef_0123_456789abcdef.slice/crio-" + "d" * 64 + ".scope"]
    cg = parse_cgroup(crio)
    assert cg.container_id == "d" * 12 and cg.pod_uid == "01234567-89ab-cdef-0123-456789abcdef"
    assert cg.unified_path.startswith("/kubepods.slice")
    host = ["0::/user.slice/user-0.slice/session-1.scope"]
    assert parse_cgroup(host).container_id == "" and parse_cgroup(host).pod_uid == ""
    assert parse_cgroup(["garbage", "", "1:2"]).path == ""


def test_console_scripts_through_their_interpreter(tmp_path: Path) -> None:
    """pip's console scripts run through their shebang: the kernel puts the interpreter first."""
    procs = [
        FakeProc(200, "vllm", ["/opt/venv/bin/python3", "/opt/venv/bin/vllm", "serve", "m", "--port", "8001"]),
        FakeProc(201, "python3", ["/usr/bin/python3.12", "-u", "/usr/local/bin/sglang", "serve", "--model-path", "m"]),
        FakeProc(202, "python3", ["python3", "/home/me/not-vllm.py", "serve"]),
        FakeProc(203, "python3", ["python3", "/home/me/vllm", "bench", "serve"]),
    ]
    found = by_pid(disc(tmp_path, procs))
    assert set(found) == {200, 201}
    assert found[200].labels.component == "api_server"  # type: ignore[attr-defined]
    assert found[201].labels.engine == "sglang"  # type: ignore[attr-defined]
