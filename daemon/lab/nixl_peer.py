"""Two NIXL agents moving DRAM buffers over UCX, with the application's own numbers.

    python -m kvwatch.daemon.lab.nixl_peer target    --meta FILE --size BYTES
    python -m kvwatch.daemon.lab.nixl_peer initiator --meta FILE --size BYTES [--handles K]

The target registers a buffer and publishes its agent metadata and descriptors
in FILE; the initiator loads them and WRITEs its buffer into the target's. The
initiator reads commands on stdin and answers one line each, ``@kvw {json}`` (NIXL
logs to stdout too; ``NixlPeer`` reads past its lines):

* ``burst N``        N transfers one after another; per-transfer wall times as the
                     application measured them (post to DONE), bytes moved;
* ``rate R S``       open loop for S seconds: a transfer posted every 1/R s on a free
                     handle (K handles), however slowly they complete — the demand a
                     decode server puts on its prefill peers;
* ``quit``.

Needs the ``nixl`` wheels (``pip install --no-deps nixl-cu12 numpy``); used by the tests
and ``kvwatch demo``, never by the daemon.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

MARK = "@kvw "


def _reply(obj: dict[str, Any]) -> None:
    print(MARK + json.dumps(obj), flush=True)


def _nixl() -> Any:
    import importlib  # noqa: PLC0415 - the wheel is optional

    for module in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            api = importlib.import_module(module)
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise ImportError("no NIXL wheel installed: pip install --no-deps nixl-cu12 numpy")


def _buffer(size: int, fill: int) -> Any:
    import numpy as np  # noqa: PLC0415 - comes with nixl

    return np.full(size, fill, dtype=np.uint8)


def target(args: argparse.Namespace) -> None:
    agent_cls, config_cls = _nixl()
    agent = agent_cls(f"target-{os.getpid()}", config_cls(backends=["UCX"]))
    buf = _buffer(args.size, 0)
    agent.register_memory([(buf.ctypes.data, args.size, 0, "")], "DRAM")
    descs = agent.get_xfer_descs([(buf.ctypes.data, args.size, 0)], "DRAM")
    meta = {
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "descs": base64.b64encode(agent.get_serialized_descs(descs)).decode(),
    }
    tmp = Path(args.meta).with_suffix(".tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(args.meta)
    _reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    _reply({"received_nonzero": int((buf != 0).sum())})


class Initiator:
    def __init__(self, args: argparse.Namespace) -> None:
        agent_cls, config_cls = _nixl()
        self.agent = agent_cls(f"initiator-{os.getpid()}", config_cls(backends=["UCX"]))
        self.size = args.size
        self.src = _buffer(args.size, 1)
        self.agent.register_memory([(self.src.ctypes.data, args.size, 0, "")], "DRAM")
        meta = json.loads(Path(args.meta).read_text())
        self.remote = self.agent.add_remote_agent(base64.b64decode(meta["metadata"]))
        remote_descs = self.agent.deserialize_descs(base64.b64decode(meta["descs"]))
        local = self.agent.get_xfer_descs([(self.src.ctypes.data, args.size, 0)], "DRAM")
        self.handles = [
            self.agent.initialize_xfer("WRITE", local, remote_descs, self.remote, b"kv") for _ in range(args.handles)
        ]

    def burst(self, n: int) -> dict[str, Any]:
        h = self.handles[0]
        durations = []
        for _ in range(n):
            t0 = time.monotonic_ns()
            state = self.agent.transfer(h)
            while state == "PROC":
                state = self.agent.check_xfer_state(h)
            durations.append(time.monotonic_ns() - t0)
            if state != "DONE":
                return {"error": state, "done": len(durations) - 1}
        return {"transfers": n, "bytes": n * self.size, "durations_ns": durations}

    def rate(self, per_second: float, seconds: float) -> dict[str, Any]:
        busy: dict[int, int] = {}  # handle index -> post time
        posted = completed = skipped = errors = 0
        bytes_done = 0
        start = time.monotonic()
        next_post = start
        while True:
            now = time.monotonic()
            if now - start >= seconds and not busy:
                break
            if now >= next_post and now - start < seconds:
                next_post += 1.0 / per_second
                free = [i for i in range(len(self.handles)) if i not in busy]
                if free:
                    i = free[0]
                    state = self.agent.transfer(self.handles[i])
                    posted += 1
                    if state == "PROC":
                        busy[i] = time.monotonic_ns()
                    elif state == "DONE":
                        completed += 1
                        bytes_done += self.size
                    else:
                        errors += 1
                else:
                    skipped += 1  # demand the handles could not take
            for i in list(busy):
                state = self.agent.check_xfer_state(self.handles[i])
                if state != "PROC":
                    del busy[i]
                    if state == "DONE":
                        completed += 1
                        bytes_done += self.size
                    else:
                        errors += 1
            time.sleep(0.0005)
        return {"posted": posted, "completed": completed, "bytes": bytes_done, "skipped": skipped, "errors": errors}


def initiator(args: argparse.Namespace) -> None:
    ini = Initiator(args)
    _reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "burst":
            _reply(ini.burst(int(words[1])))
        elif words[0] == "rate":
            _reply(ini.rate(float(words[1]), float(words[2])))


class NixlPeer:
    """One peer as a child process (optionally inside a network namespace)."""

    def __init__(
        self,
        role: str,
        meta: Path,
        size: int,
        *,
        handles: int = 1,
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.role = role
        cmd = [
            sys.executable,
            "-m",
            "kvwatch.daemon.lab.nixl_peer",
            role,
            "--meta",
            str(meta),
            "--size",
            str(size),
            "--handles",
            str(handles),
        ]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("peer pipes missing")
        self._in: IO[str] = self.proc.stdin
        self._out: IO[str] = self.proc.stdout
        self.pid = int(self.reply()["pid"])  # the python process (not `ip netns exec`)

    def reply(self) -> dict[str, Any]:
        for line in self._out:
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK) :]))
        raise RuntimeError(f"peer exited ({self.proc.wait()})")

    def ask(self, command: str) -> dict[str, Any]:
        self._in.write(command + "\n")
        self._in.flush()
        return self.reply()

    def close(self) -> dict[str, Any] | None:
        out = None
        try:
            self._in.write("quit\n")
            self._in.flush()
            self._in.close()
            if self.role == "target":
                out = self.reply()
        except (OSError, RuntimeError, ValueError):
            out = None
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvwatch.daemon.lab.nixl_peer")
    p.add_argument("role", choices=["target", "initiator"])
    p.add_argument("--meta", required=True)
    p.add_argument("--size", type=int, default=64 << 20)
    p.add_argument("--handles", type=int, default=1)
    args = p.parse_args(argv)
    (target if args.role == "target" else initiator)(args)


if __name__ == "__main__":
    main()
