"""One rank of a two-GPU NCCL point-to-point exchange (torch.distributed send/recv), driven
on stdin by tests/gpu/validate_nccl.py.

    python3 tests/gpu/nccl_peer.py --rank R --port P [--backend torch|stub --lib libnccl.so.2]

Lines: "xfer N A M B" — rank 0 sends N tensors of A bytes (float16) to rank 1, then
rank 1 sends M tensors of B bytes to rank 0; each answers one JSON line with the bytes
it sent and received (what the application moved: the ground truth), its send/recv
calls and the seconds the exchange took (synchronised). "quit" ends. ``--backend stub`` calls a
(stub) libnccl's ncclSend/ncclRecv with the same counts, to check the orchestration
where there is no GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

NCCL_FLOAT16 = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", choices=["torch", "stub"], default="torch")
    ap.add_argument("--lib", default="")
    args = ap.parse_args()
    peer = 1 - args.rank
    if args.backend == "torch":
        import torch
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device docs)
        torch.cuda.set_device(args.rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
        warm = torch.ones(1024, dtype=torch.float16, device="cuda")
        if args.rank == 0:  # communicator set-up and a first exchange, before anyone watches
            dist.send(warm, peer)
            dist.recv(warm, peer)
        else:
            dist.recv(warm, peer)
            dist.send(warm, peer)
        torch.cuda.synchronize()

        def exchange(n: int, a: int, m: int, b: int) -> float:
            big = torch.full((a // 2,), 1.5, dtype=torch.float16, device="cuda")
            small = torch.full((b // 2,), 2.5, dtype=torch.float16, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                (dist.send if args.rank == 0 else dist.recv)(big, peer)
            for _ in range(m):
                (dist.recv if args.rank == 0 else dist.send)(small, peer)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

    else:
        nccl = ctypes.CDLL(args.lib)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name in ("ncclSend", "ncclRecv"):
            getattr(nccl, name).argtypes = (vp, sz, ctypes.c_int, ctypes.c_int, vp, vp)

        def exchange(n: int, a: int, m: int, b: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                (nccl.ncclSend if args.rank == 0 else nccl.ncclRecv)(None, a // 2, NCCL_FLOAT16, peer, None, None)
            for _ in range(m):
                (nccl.ncclRecv if args.rank == 0 else nccl.ncclSend)(None, b // 2, NCCL_FLOAT16, peer, None, None)
            return time.perf_counter() - t0

    info: dict[str, object] = {"ready": os.getpid()}
    if args.backend == "torch":
        info |= {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                 "gpu": torch.cuda.get_device_name(args.rank)}  # fmt: skip
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        w = line.split()
        if not w or w[0] == "quit":
            break
        n, a, m, b = (int(x) for x in w[1:5])
        seconds = exchange(n, a, m, b)
        first, second = n * (a // 2) * 2, m * (b // 2) * 2
        sent, recv = (first, second) if args.rank == 0 else (second, first)
        sends, recvs = (n, m) if args.rank == 0 else (m, n)
        print(
            json.dumps({"sent_bytes": sent, "recv_bytes": recv, "sends": sends, "recvs": recvs, "seconds": seconds}),
            flush=True,
        )
    if args.backend == "torch":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
