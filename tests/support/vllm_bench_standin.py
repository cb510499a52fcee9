"""A stand-in for ``vllm serve`` with the process tree of vLLM 0.26.0, for the dry run of
bench/bench_engine_cost.py on a machine without a GPU:

* the API server: the simulated vLLM (``kvwatch.daemon.lab.engine_sim``: ``/v1/completions``,
  ``/metrics``, ``/health``, the KV event stream), run as a console script named ``vllm`` so that
  kvwatch's discovery finds it as it finds pip's vllm, with vLLM's own flags;
* its child, titled ``VLLM::EngineCore``, which does each request's engine work: ``--standin-cuda-pairs``
  cudaMalloc+cudaFree pairs through the stub CUDA runtime (kvwatch's CUDA uprobes trap every call,
  so with kvwatch on the child's CPU time grows as the real engine core's does) and
  ``--standin-work`` iterations of plain arithmetic. One request at a time, as one engine loop.

    script = install(WORKDIR)                      # WORKDIR/bin/vllm, this interpreter
    [str(script), "serve", MODEL, *vllm_flags]     # then /health, /v1/completions, SIGTERM to stop
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TITLE = b"VLLM::EngineCore"  # the kernel keeps 15 bytes of it: discovery's ^VLLM:: rule matches
PR_SET_NAME = 15


def install(workdir: Path) -> Path:
    """The console script ``WORKDIR/bin/vllm`` running ``serve`` below with this interpreter."""
    script = workdir / "bin" / "vllm"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from tests.support.vllm_bench_standin import serve\n\nserve(sys.argv[1:])\n"
    )
    script.chmod(0o755)
    return script


class EngineCore:
    """The child process and the pipe to it: ``work()`` runs one request's engine work there."""

    def __init__(self, stub_dir: Path, pairs: int, work: int) -> None:
        argv = [sys.executable, __file__, "core", str(stub_dir), str(pairs), str(work)]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        assert self.p.stdout is not None
        if self.p.stdout.readline() != b"ready\n":
            raise RuntimeError("the stand-in engine core did not start")

    def work(self) -> None:
        assert self.p.stdin is not None and self.p.stdout is not None
        with self.lock:
            self.p.stdin.write(b"r\n")
            self.p.stdin.flush()
            self.p.stdout.readline()

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait(10)


def core(stub_dir: str, pairs: int, work: int) -> None:
    """The child: loads the stub runtime, then one request per line on stdin."""
    ctypes.CDLL(None).prctl(PR_SET_NAME, TITLE, 0, 0, 0)
    rt = ctypes.CDLL(str(Path(stub_dir) / "libcudart.so.12"))
    rt.cudaMalloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
    rt.cudaFree.argtypes = (ctypes.c_void_p,)
    ptr = ctypes.c_void_p()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for _ in sys.stdin:
        for _ in range(pairs):
            rt.cudaMalloc(ctypes.byref(ptr), 4096)
            rt.cudaFree(ptr)
        sum(range(work))
        sys.stdout.write("d\n")
        sys.stdout.flush()


def serve(argv: list[str]) -> None:
    """The API server: engine_sim_cli's stand-in for ``vllm serve`` (its flags, served until
    SIGTERM), each completion also run through the engine core child."""
    from kvwatch.daemon.lab import engine_sim_cli
    from kvwatch.daemon.lab.engine_sim import SimulatedVllm
    from kvwatch.daemon.lab.stublib import build

    ap = argparse.ArgumentParser()
    ap.add_argument("--standin-cuda-pairs", type=int, default=100)
    ap.add_argument("--standin-work", type=int, default=20_000)
    ap.add_argument("--standin-stub-dir", type=Path, default=Path("/tmp/kvw-bench-standin-stub"))
    own, rest = ap.parse_known_args(argv)
    build(own.standin_stub_dir)
    engine = EngineCore(own.standin_stub_dir, own.standin_cuda_pairs, own.standin_work)

    class WithEngineCore(SimulatedVllm):
        def complete(self, *a: Any, **kw: Any) -> dict[str, Any] | None:
            out: dict[str, Any] | None = super().complete(*a, **kw)
            engine.work()
            return out

    # the one construction engine_sim_cli.main makes
    engine_sim_cli.SimulatedVllm = WithEngineCore  # type: ignore[attr-defined]
    try:
        engine_sim_cli.main([*rest, "--serve-until-signal"])
    finally:
        engine.close()


if __name__ == "__main__" and sys.argv[1:2] == ["core"]:
    core(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
