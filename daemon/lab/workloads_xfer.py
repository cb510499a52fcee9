"""Transfer-library workloads for `python -m kvwatch.daemon.lab.workloads xferstub` (the stub NIXL/UCX/verbs/NCCL)."""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

from kvwatch.daemon.lab.workload_common import say


class _TransferStub:
    """ctypes front to the stub NIXL / UCX / verbs / NCCL libraries."""

    POST = "_ZNK9nixlAgent11postXferReqEP12nixlXferReqHPK21nixlAgentOptionalArgs"
    STATUS = "_ZNK9nixlAgent13getXferStatusEP12nixlXferReqH"
    RELEASE = "_ZNK9nixlAgent14releaseXferReqEP12nixlXferReqH"

    def __init__(self, lib_dir: Path) -> None:
        self.nixl = ctypes.CDLL(str(lib_dir / "libnixl.so"))
        self.ucp = ctypes.CDLL(str(lib_dir / "libucp.so.0"))
        self.verbs = ctypes.CDLL(str(lib_dir / "libibverbs.so.1"))
        self.nccl = ctypes.CDLL(str(lib_dir / "libnccl.so.2"))
        u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        self.nixl.kvwstub_next_post.argtypes = (u64, ctypes.c_int, u64, ctypes.c_int, ctypes.c_int)
        self.nixl.kvwstub_set_status.argtypes = (ctypes.c_size_t, ctypes.c_int)
        for name in (self.POST, self.STATUS, self.RELEASE):
            getattr(self.nixl, name).argtypes = (vp, vp, vp)
        self.ucp.ucp_put_nbx.argtypes = (vp, vp, sz, u64, vp, vp)
        self.ucp.ucp_put_nbx.restype = vp
        self.ucp.ucp_get_nbx.argtypes = (vp, vp, sz, u64, vp, vp)
        self.ucp.ucp_get_nbx.restype = vp
        self.verbs.ibv_reg_mr_iova2.argtypes = (vp, vp, sz, u64, ctypes.c_uint)
        self.verbs.ibv_reg_mr_iova2.restype = vp
        self.verbs.ibv_reg_dmabuf_mr.argtypes = (vp, u64, sz, u64, ctypes.c_int, ctypes.c_int)
        self.verbs.ibv_reg_dmabuf_mr.restype = vp
        self.verbs.ibv_dereg_mr.argtypes = (vp,)
        for name in ("ncclSend", "ncclRecv"):
            getattr(self.nccl, name).argtypes = (vp, sz, ctypes.c_int, ctypes.c_int, vp, vp)
        self.nccl.ncclAllGather.argtypes = (vp, vp, sz, ctypes.c_int, vp, vp)
        self.mrs: list[int] = []

    def post(self, handle: int, nbytes: int, rc: int, *, ep: int, read: bool = False, chunks: int = 1) -> int:
        self.nixl.kvwstub_next_post(nbytes, rc, ep, int(read), chunks)
        return int(getattr(self.nixl, self.POST)(self, handle, None))

    def status(self, handle: int, rc: int | None = None) -> int:
        if rc is not None:
            self.nixl.kvwstub_set_status(handle, rc)
        return int(getattr(self.nixl, self.STATUS)(self, handle, None))

    def release(self, handle: int) -> int:
        return int(getattr(self.nixl, self.RELEASE)(self, handle, None))

    @property
    def _as_parameter_(self) -> int:  # the fake `this` of nixlAgent calls
        return 0x1000


def _reg(x: _TransferStub, a: list[str]) -> object:
    return x.verbs.ibv_reg_mr_iova2(None, None, int(a[0]), 0, 0)


def _regdma(x: _TransferStub, a: list[str]) -> object:
    return x.verbs.ibv_reg_dmabuf_mr(None, 0, int(a[0]), 0, -1, 0)


def _nccl(x: _TransferStub, a: list[str]) -> object:
    if a[0] == "allgather":
        return x.nccl.ncclAllGather(None, None, int(a[1]), int(a[2]), None, None)
    fn = x.nccl.ncclSend if a[0] == "send" else x.nccl.ncclRecv
    return fn(None, int(a[1]), int(a[2]), 0, None, None)


def _xfer(x: _TransferStub, a: list[str]) -> object:
    x.post(int(a[0]), int(a[1]), 1, ep=7)
    time.sleep(int(a[2]) / 1000)
    return x.status(int(a[0]), 0)


def _register(x: _TransferStub, mr: object) -> int:
    if mr:
        x.mrs.append(int(mr))  # type: ignore[call-overload]
    return int(bool(mr))


COMMANDS = {
    "post": lambda x, a: x.post(int(a[0]), int(a[1]), int(a[2]), ep=int(a[3]), read=len(a) > 4 and a[4] == "read"),
    "status": lambda x, a: x.status(int(a[0]), int(a[1])),
    "release": lambda x, a: x.release(int(a[0])),
    "put": lambda x, a: x.ucp.ucp_put_nbx(int(a[1]), None, int(a[0]), 0, None, None) or 0,
    "get": lambda x, a: x.ucp.ucp_get_nbx(int(a[1]), None, int(a[0]), 0, None, None) or 0,
    "reg": lambda x, a: _register(x, _reg(x, a)),
    "regdma": lambda x, a: _register(x, _regdma(x, a)),
    "dereg": lambda x, a: x.verbs.ibv_dereg_mr(x.mrs.pop()) if x.mrs else -1,
    "regfail": lambda x, a: x.verbs.kvwstub_reg_fail(int(a[0])),
    "ucpfail": lambda x, a: x.ucp.kvwstub_ucp_fail(int(a[0])),
    "ncclrc": lambda x, a: x.nccl.kvwstub_nccl_rc(int(a[0])),
    "nccl": _nccl,
    "xfer": _xfer,
}


def cmd_xferstub(args: argparse.Namespace) -> None:
    """Drive the stub transfer libraries, one command per line, each answered "ok RESULT":
    post HANDLE BYTES RC EP [read] | status HANDLE RC | release HANDLE | put COUNT EP | get COUNT EP
    | reg LEN | regdma LEN | dereg | regfail 0/1 | ucpfail 0/1 | nccl send|recv|allgather COUNT DTYPE
    | ncclrc RC | xfer HANDLE BYTES MS (posted, done MS milliseconds later) | quit"""
    x = _TransferStub(Path(args.lib_dir))
    say("ready")
    while True:
        w = sys.stdin.readline().split()
        if not w or w[0] == "quit":
            return
        say(f"ok {COMMANDS[w[0]](x, w[1:])}")


def cmd_ncclcalls(args: argparse.Namespace) -> None:
    """Calls into a real libnccl.so.2 with no communicator: each returns ncclInvalidArgument (4)
    at once, which is enough to prove the probes see every call and its arguments.
    Lines: "call N COUNT DTYPE" (N x ncclSend, ncclRecv, ncclAllGather) | quit."""
    nccl = ctypes.CDLL(args.lib)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name in ("ncclSend", "ncclRecv"):
        getattr(nccl, name).argtypes = (vp, sz, ctypes.c_int, ctypes.c_int, vp, vp)
    nccl.ncclAllGather.argtypes = (vp, vp, sz, ctypes.c_int, vp, vp)
    say("ready")
    while True:
        w = sys.stdin.readline().split()
        if not w or w[0] == "quit":
            return
        n, count, dtype = int(w[1]), int(w[2]), int(w[3])
        rcs = set()
        for _ in range(n):
            rcs.add(nccl.ncclSend(None, count, dtype, 0, None, None))
            rcs.add(nccl.ncclRecv(None, count, dtype, 0, None, None))
            rcs.add(nccl.ncclAllGather(None, None, count, dtype, None, None))
        say(f"ok {','.join(map(str, sorted(rcs)))}")
