"""CUDA allocation probes on the real kernel.

The real ``libcudart.so.12`` (PyPI nvidia-cuda-runtime-cu12) proves attachment by
path, argument and return-value capture and exact counts: without a GPU every
call returns error 35. The stub runtime + driver built by the test returns
success and drives the ledger, nesting and the failure paths.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.daemon.lab.stublib import build
from kvwatch.probes.cuda import (
    CUDA_APIS,
    AllocationFailed,
    CudaProbeOptions,
    CudaProbes,
    ProcessGoneDuringAttach,
)
from kvwatch.probes.records import HookState
from tests.support.kernel import Child

N = 23


def real_cudart() -> Path:
    import nvidia.cuda_runtime  # the PyPI runtime: a test dependency

    base = Path(next(iter(nvidia.cuda_runtime.__path__)))
    lib = base / "lib" / "libcudart.so.12"
    assert lib.exists(), lib
    return lib


@pytest.fixture
def probes() -> Iterator[CudaProbes]:
    p = CudaProbes()
    p.start()
    yield p
    p.close()
    assert p._prog is None


def counts(p: CudaProbes, pid: int, api: str) -> tuple[int, int, int, int]:
    c = p.sample().processes.get(pid)
    a = c.apis.get(api) if c else None
    return (a.ok, a.err, a.bytes, a.unknown) if a else (0, 0, 0, 0)


def test_real_cudart_attach_args_and_return_values(probes: CudaProbes) -> None:
    lib = real_cudart()
    with Child("cudacalls", "--lib", str(lib)) as w:
        w.expect("ready")
        att = probes.attach(w.pid)
        assert [lib_.path for lib_ in att.libraries.values()] == [str(lib)]
        states = {s.api: s.state for s in att.symbols}
        assert all(states[a.label] is HookState.ATTACHED for a in CUDA_APIS if a.lib == "cudart")
        w.step(f"call {N}", "done 0 35")
        probes.poll(50)
        assert counts(probes, w.pid, "cudaMalloc") == (
            0,
            N,
            0,
            0,
        )  # every call failed: none counted as allocation
        assert counts(probes, w.pid, "cudaFree") == (0, N, 0, 0)
        fails = [e for e in probes.take_events() if isinstance(e, AllocationFailed) and e.tgid == w.pid]
        assert len(fails) == N and {e.code for e in fails} == {35}
        assert sorted(e.size for e in fails) == [4096 * (i + 1) for i in range(N)]  # arguments captured
        assert probes.detach(w.pid) == 2 * sum(1 for a in CUDA_APIS if a.lib == "cudart")


@pytest.fixture
def all_probes() -> Iterator[CudaProbes]:
    p = CudaProbes(CudaProbeOptions(driver_api="all"))
    p.start()
    yield p
    p.close()


def test_auto_leaves_the_driver_beneath_the_runtime_alone(probes: CudaProbes, stub: Path) -> None:
    with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        att = probes.attach(w.pid)
        skipped = {s.api for s in att.symbols if s.state is HookState.DISABLED}
        assert skipped == {"cuMemAlloc", "cuMemAllocAsync", "cuMemFree", "cuMemFreeAsync"}
        w.step("emptycache 1000 0.02", "done")
        s = probes.sample().processes[w.pid]
        assert s.apis["cudaMalloc"].ok == s.apis["cudaFree"].ok > 0 and s.nested == 0


def test_stub_ledger_exact_and_no_double_counting(all_probes: CudaProbes, stub: Path) -> None:
    probes = all_probes
    with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        att = probes.attach(w.pid)
        assert att.attached == len(CUDA_APIS)
        w.step("emptycache 1000 0.05", "done")  # 50 steps x 6 segments: 25 x (3 x 2 MiB + 3 x 20 MiB) each
        s = probes.sample().processes[w.pid]
        steps = s.apis["cudaMalloc"].ok // 6
        assert s.apis["cudaMalloc"].ok == s.apis["cudaFree"].ok == 6 * steps
        assert s.apis["cudaMalloc"].bytes == steps * 3 * (2 + 20) * 2**20
        assert s.apis["cudaFree"].bytes == s.apis["cudaMalloc"].bytes
        assert s.outstanding()["device"] == 0
        assert "cuMemAlloc" not in s.apis and "cuMemFree" not in s.apis  # the driver beneath is not counted again
        assert s.nested == 2 * 6 * steps
        assert s.clustered_frees >= 5 * steps  # empty_cache: frees in bursts
        assert s.seg_2m == s.seg_20m == 3 * steps

        w.step("growth 1000 0.023", "done")
        s2 = probes.sample().processes[w.pid]
        grown = s2.apis["cudaMalloc"].ok - s.apis["cudaMalloc"].ok
        assert s2.outstanding()["device"] == grown * 20 * 2**20

        w.step("expandable 1000 0.02", "done")
        s3 = probes.sample().processes[w.pid]
        created = s3.apis["cuMemCreate"].ok
        assert created > 0 and s3.apis["cuMemRelease"].ok == created
        assert s3.apis["cuMemMap"].ok == s3.apis["cuMemUnmap"].ok == created
        assert s3.outstanding()["vmm"] == 0


def test_failures_and_oom_retry_path(probes: CudaProbes, stub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWSTUB_CAPACITY", str(200 * 2**20))  # ten 20 MiB segments fit
    with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        probes.attach(w.pid)
        w.step("oomretry 1000 0.1", "done")
        probes.poll(50)
        s = probes.sample().processes[w.pid]
        fails = [e for e in probes.take_events() if isinstance(e, AllocationFailed) and e.tgid == w.pid]
        assert s.apis["cudaMalloc"].err == len(fails) > 0
        assert {e.code for e in fails} == {2}
        assert s.frees_after_failure >= 10 * len(fails) - 1  # each failure: the whole cache freed at once


def test_two_runtimes_and_libraries_loaded_later(probes: CudaProbes, stub: Path) -> None:
    lib = real_cudart()
    with Child("cudacalls", "--lib", str(lib)) as w:
        w.expect("ready")
        att = probes.attach(w.pid)
        assert len(att.libraries) == 1
        w.step(f"load {stub / 'libcudart.so.12'}", "loaded")  # a second CUDA runtime, dlopen'ed later
        att = probes.attach(w.pid)  # the periodic rescan
        assert {Path(x.path).parent for x in att.libraries.values()} == {lib.parent, stub}
        assert len(att.libraries) == 3  # both runtimes and the stub driver they pulled in
        w.step("unload", "unloaded")  # a probed library unmapped: nothing breaks
        w.step(f"call {N}", "done 0 35")
        assert counts(probes, w.pid, "cudaMalloc")[1] == N


def test_wheel_bundled_runtime_under_a_mangled_name(probes: CudaProbes, stub: Path, tmp_path: Path) -> None:
    """auditwheel renames a bundled libcudart (libcudart-<hash>.so.N); a loader that looks for
    "libcudart" in the maps (vLLM's) can call that copy: it is probed like the canonical one.
    A name that only contains "libcudart" is not a runtime."""
    mangled = tmp_path / "somewheel.libs" / "libcudart-9335f6a2.so.12.4.127"
    mangled.parent.mkdir()
    shutil.copy(stub / "libcudart.so.12", mangled)
    stub_like = tmp_path / "libcudart_stub.so.12"
    shutil.copy(stub / "libcudart.so.12", stub_like)
    with Child("cudacalls", "--lib", str(mangled)) as w:
        w.expect("ready")
        w.step(f"map {stub_like}", "mapped")
        att = probes.attach(w.pid)
        assert str(mangled) in {x.path for x in att.libraries.values()}
        assert str(stub_like) not in {x.path for x in att.libraries.values()}
        w.step(f"call {N}", f"done {N} 0")
        assert counts(probes, w.pid, "cudaMalloc")[0] == N


def test_symbol_missing_in_an_old_runtime(probes: CudaProbes, tmp_path: Path) -> None:
    build(tmp_path, old_runtime=True)
    with Child("cudacalls", "--lib", str(tmp_path / "libcudart.so.12")) as w:
        w.expect("ready")
        att = probes.attach(w.pid)
        states = {(Path(s.library).name, s.api): s.state for s in att.symbols}
        assert states[("libcudart.so.12", "cudaMallocAsync")] is HookState.MISSING
        assert states[("libcudart.so.12", "cudaMalloc")] is HookState.ATTACHED
        w.step(f"call {N}", f"done {N} 0")
        assert counts(probes, w.pid, "cudaMalloc")[0] == N


def test_garbage_library_and_ucx_hooks(all_probes: CudaProbes, stub: Path, tmp_path: Path) -> None:
    probes = all_probes
    fake = tmp_path / "evil" / "libcudart.so.13"
    fake.parent.mkdir()
    fake.write_bytes(b"not an ELF file at all" * 100)
    ucm = tmp_path / "ucx" / "libucm.so.0"
    ucm.parent.mkdir()
    shutil.copy(stub / "libcuda.so.1", ucm)  # any file mapped under UCX's name
    with Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        w.step(f"map {fake}", "mapped")
        w.step(f"map {ucm}", "mapped")
        att = probes.attach(w.pid)
        by = {(Path(s.library).name, s.api): s for s in att.symbols}
        assert by[("libcudart.so.13", "cudaMalloc")].state is HookState.FAILED
        assert att.ucx
        assert by[("libcuda.so.1", "cuMemAlloc")].state is HookState.DISABLED  # UCX patches it
        assert by[("libcuda.so.1", "cuMemCreate")].state is HookState.ATTACHED  # UCX leaves it alone
        w.step(f"call {N}", f"done {N} 0")
        assert counts(probes, w.pid, "cudaMalloc")[0] == N  # the good library keeps working


def test_process_exiting_before_attach(probes: CudaProbes, stub: Path) -> None:
    w = Child("cudacalls", "--lib", str(stub / "libcudart.so.12"))
    w.expect("ready")
    pid = w.pid
    w.close()
    with pytest.raises(ProcessGoneDuringAttach):
        probes.attach(pid)
    assert pid not in probes.attachments


def test_detach_after_exit_releases_every_probe(probes: CudaProbes, stub: Path) -> None:
    base = probes.program.open_uprobes
    with Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        probes.attach(w.pid)
        assert probes.program.open_uprobes == base + 2 * (len(CUDA_APIS) - 4)  # auto: 4 driver calls left alone
        pid = w.pid
    assert not Path(f"/proc/{pid}").exists()  # reaped by the context's exit
    probes.detach(pid)
    assert probes.program.open_uprobes == base
    assert pid not in probes.sample().processes


def test_unwatched_process_pays_nothing(probes: CudaProbes, stub: Path) -> None:
    with (
        Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as watched,
        Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as other,
    ):
        watched.expect("ready")
        other.expect("ready")
        probes.attach(watched.pid)
        other.step(f"call {N}", f"done {N} 0")
        hits = probes.sample().hits["cudaMalloc"]
        assert other.pid not in probes.sample().processes
        assert hits == 0  # pid= filter: the other process never even trapped
        watched.step(f"call {N}", f"done {N} 0")
        assert probes.sample().hits["cudaMalloc"] == N


def test_copies_counted_by_direction_once(probes: CudaProbes, stub: Path) -> None:
    """cudaMemcpyAsync calls the driver's copy beneath it (as the real runtime does): each copy
    is counted once, at the runtime, by its direction argument, with its byte count."""
    with Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        probes.attach(w.pid)
        w.step(f"copy 2 {N} {3 << 20}", f"done {N} 0")  # device -> host: KV blocks offloaded
        w.step(f"copy 1 {N + 6} {1 << 20}", f"done {N + 6} 0")  # host -> device: reloaded
        w.step("copy 3 5 4096", "done 5 0")  # device -> device
        probes.poll(50)
        c = probes.sample().processes[w.pid]
        assert counts(probes, w.pid, "cudaMemcpyAsync:d2h") == (N, 0, N * (3 << 20), 0)
        assert counts(probes, w.pid, "cudaMemcpyAsync:h2d") == (N + 6, 0, (N + 6) << 20, 0)
        assert counts(probes, w.pid, "cudaMemcpyAsync:d2d") == (5, 0, 5 * 4096, 0)
        assert (c.copy_bytes("d2h"), c.copy_bytes("h2d")) == (N * (3 << 20), (N + 6) << 20)
        # the driver copies beneath were entered (probed) but not counted again
        assert counts(probes, w.pid, "cuMemcpyDtoHAsync:d2h") == (0, 0, 0, 0)
        assert c.nested >= 2 * N + 6


def batch_bytes(entries: int, size: int) -> int:
    """What one batch of the workload moves: block i is size + i bytes."""
    return entries * size + entries * (entries - 1) // 2


def test_batched_copies_summed_and_directed(probes: CudaProbes, stub: Path) -> None:
    """vLLM's KV offload path: one cuMemcpyBatchAsync per transfer, no direction argument, the
    location hints unset. Bytes are the sum of the sizes array (every size different, across
    several 64-entry chunks); the direction is found from the pinned host buffer the process
    allocated; the runtime's batch calls the driver's beneath and counts once."""
    with Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        probes.attach(w.pid)
        w.step(f"batch driver d2h {N} 1001 32768", f"done {N} 0")  # stores: GPU -> pinned CPU
        w.step("batch driver h2d 7 130 32768", "done 7 0")  # loads back
        w.step("batch driver_v2 hint-h2d 5 3 4096", "done 5 0")  # only the hints tell
        w.step("batch runtime d2h 11 64 1024", "done 11 0")  # exactly one chunk
        probes.poll(50)
        assert counts(probes, w.pid, "cuMemcpyBatchAsync:d2h") == (N, 0, N * batch_bytes(1001, 32768), 0)
        assert counts(probes, w.pid, "cuMemcpyBatchAsync:h2d") == (7, 0, 7 * batch_bytes(130, 32768), 0)
        assert counts(probes, w.pid, "cuMemcpyBatchAsync_v2:h2d") == (5, 0, 5 * batch_bytes(3, 4096), 0)
        assert counts(probes, w.pid, "cudaMemcpyBatchAsync:d2h") == (11, 0, 11 * batch_bytes(64, 1024), 0)
        assert counts(probes, w.pid, "cuMemcpyBatchAsync_v2:d2h") == (0, 0, 0, 0)  # beneath the runtime's
        c = probes.sample().processes[w.pid]
        assert c.copy_bytes("default") == 0
        assert probes.sample().lost["batch_truncated"] == probes.sample().lost["batch_unreadable"] == 0


def test_batched_copy_beyond_the_read_limit_is_counted_lost(probes: CudaProbes, stub: Path) -> None:
    with Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        probes.attach(w.pid)
        w.step("batch driver d2h 3 70000 16", "done 3 0")
        probes.poll(50)
        ok, _, nbytes, _ = counts(probes, w.pid, "cuMemcpyBatchAsync:d2h")
        assert ok == 3 and nbytes == 3 * batch_bytes(65536, 16)  # the first 65,536 entries of each
        assert probes.sample().lost["batch_truncated"] == 3


def test_real_cudart_copies_fail_without_a_gpu(probes: CudaProbes) -> None:
    with Child("cudacalls", "--lib", str(real_cudart())) as w:
        w.expect("ready")
        probes.attach(w.pid)
        w.send(f"copy 2 {N} 4096")
        rc = w.reply().split()
        assert rc[:2] == ["done", "0"] and rc[2] != "0"  # every call failed (no device)
        probes.poll(50)
        ok, err, nbytes, _ = counts(probes, w.pid, "cudaMemcpyAsync:d2h")
        assert (ok, err, nbytes) == (0, N, 0)
