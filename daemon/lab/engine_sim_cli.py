"""Driving the simulated vLLM: scripted traffic, a stand-in for ``vllm serve`` (stdin
commands for the tests and the demo, or HTTP only with ``--serve-until-signal``), and the
stand-in run as a console script the way pip installs vLLM."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvwatch.daemon.lab.engine_sim import BLOCK_BYTES, SimulatedVllm
from kvwatch.daemon.lab.wire_encode import Layout


@dataclass(slots=True)
class Traffic:
    """Requests per second, drawn from ``hot`` prefixes, or unique prompts when ``unique``."""

    rate: float = 20.0
    hot: int = 20
    blocks: int = 8
    unique: bool = False
    decode: float = 0.0  # tokens/s the scripted running requests generate
    preempting: float = 0.0  # requests/s preempted
    keys: tuple[str | None, str | None] = (None, None)  # its requests' cache salt and LoRA adapter
    # other tenants' traffic beside this one, by (salt, adapter)
    tenants: dict[tuple[str | None, str | None], Traffic] = field(default_factory=dict)
    _n: int = 0
    _owed: float = 0.0  # requests owed to the next step (a tenant's own)
    # Held by the traffic loop for each step and by the command loop for each command, so that
    # a command answered "ok" is not followed by a step of the traffic it replaced.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def prefixes(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            self._n += 1
            out.append(10_000_000 + self._n if self.unique else self._n % self.hot)
        return out


@contextmanager
def running(sim: SimulatedVllm, traffic: Traffic, *, hz: float = 20.0) -> Iterator[threading.Event]:
    """Drive ``traffic`` into ``sim`` on a thread until the block exits (the Event stops it early)."""
    stop = threading.Event()

    def loop() -> None:
        carry = [0.0, 0.0, 0.0]  # requests, tokens, preemptions owed
        while not stop.wait(1.0 / hz):
            with traffic.lock:
                for i, rate in enumerate((traffic.rate, traffic.decode, traffic.preempting)):
                    carry[i] += rate / hz
                k, tokens, preempted = (int(c) for c in carry)
                carry = [c - int(c) for c in carry]
                parts = [(traffic.prefixes(k), traffic.blocks, traffic.keys)]
                for t in traffic.tenants.values():
                    t._owed += t.rate / hz
                    parts.append((t.prefixes(int(t._owed)), t.blocks, t.keys))
                    t._owed -= int(t._owed)
                sim.steps(parts)
                if tokens:
                    sim.generate(tokens)
                if preempted:
                    sim.preempt(preempted)

    t = threading.Thread(target=loop, name="sim-vllm-traffic", daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(timeout=5)


# --- a stand-in for `vllm serve`, driven line by line on stdin -----------------------------------
USAGE = """commands (one per line; each answered with "ok <command>"):
  traffic RATE HOT BLOCKS UNIQUE   requests/s from HOT prefixes of BLOCKS blocks (UNIQUE 1: new prompts)
  tenant SALT RATE HOT BLOCKS UNIQUE    a tenant's own traffic beside it, its requests salted SALT
  adapter NAME RATE HOT BLOCKS UNIQUE   the same for requests to LoRA adapter NAME (RATE 0: stop)
  active N      running requests hold N blocks      evict N [1]  drop N cached blocks (policy bug; 1: and reset)
  reset         prefix-cache reset                   preempt N
  decode TOKENS_PER_S   running requests generate     preempting PER_S   requests preempted per second
  sleep LEVEL   sleep mode 1/2 (0: awake)            lose N / forget N   batches off the wire
  garbage       one malformed message               stats     pool counters as JSON
  subscribers N   answered once N subscribers receive what is published next
  underreport SHARE   /metrics reports only SHARE of the offload bytes stored (0..1; 1: the truth)
  quit"""


def _commands(sim: SimulatedVllm, traffic: Traffic) -> dict[str, Callable[[list[Any]], object]]:
    ballast: list[bytes] = []

    def set_traffic(n: list[Any]) -> None:
        traffic.rate, traffic.hot, traffic.blocks, traffic.unique = n[0], int(n[1]), int(n[2]), bool(n[3])

    pub = sim.publisher
    return {
        "traffic": set_traffic,
        "tenant": lambda n: _tenant(traffic, n),
        "adapter": lambda n: _tenant(traffic, n, adapter=True),
        "active": lambda n: sim.set_active(int(n[0])),
        "evict": lambda n: sim.evict(int(n[0]), reset=len(n) > 1 and bool(n[1])),
        "reset": lambda n: sim.reset(),
        "preempt": lambda n: sim.preempt(int(n[0])),
        "decode": lambda n: setattr(traffic, "decode", n[0]),
        "preempting": lambda n: setattr(traffic, "preempting", n[0]),
        "broken": lambda n: setattr(sim.pool, "broken", bool(n[0])),
        "balloon": lambda n: ballast.extend(b"\x01" * (1 << 20) for _ in range(int(n[0]))),  # MiB, touched
        "underreport": lambda n: setattr(sim.metrics, "store_share", n[0]),  # of offload bytes stored
        "sleep": lambda n: sim.sleep(int(n[0])) if int(n[0]) else sim.wake_up(),
        "lose": lambda n: pub.lose(int(n[0])),
        "forget": lambda n: pub.forget(int(n[0])),
        "garbage": lambda n: pub.publish_raw(b"\xc1 not msgpack"),
        "subscribers": lambda n: pub.wait_subscribed(int(n[0])),  # answered once N have subscribed
    }


def _tenant(traffic: Traffic, words: list[Any], *, adapter: bool = False) -> None:
    """``words``: the tenant's name, then RATE HOT BLOCKS UNIQUE."""
    name, n = str(words[0]), [float(w) for w in words[1:]]
    keys = (None, name) if adapter else (name, None)
    if n[0] <= 0:
        traffic.tenants.pop(keys, None)
        return
    traffic.tenants[keys] = Traffic(rate=n[0], hot=int(n[1]), blocks=int(n[2]), unique=bool(n[3]), keys=keys)


def _args(argv: list[str] | None) -> Any:
    import argparse  # noqa: PLC0415 - only the stand-in needs it

    ap = argparse.ArgumentParser(prog="vllm", description="simulated vLLM engine (kvwatch tests and demo)")
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--host", default="0.0.0.0")  # noqa: S104 - vLLM's default: every interface
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--kv-events-config", default="{}")
    ap.add_argument("--capacity", "--num-gpu-blocks-override", dest="capacity", type=int, default=4000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-offloading-size", type=float, default=0.0, help="GiB of CPU tier (OffloadingConnector)")
    ap.add_argument("--served-model-name")
    ap.add_argument("--layout", default=Layout.V0_26.value, choices=[x.value for x in Layout])
    ap.add_argument("--step-seconds", type=float, default=0.005)
    ap.add_argument(
        "--broken-prefix-cache", action="store_true", help="lookups always miss; blocks still stored and announced"
    )
    ap.add_argument(
        "--serve-until-signal", action="store_true", help="no stdin commands: serve HTTP until SIGTERM (as vLLM)"
    )
    args, _unknown = ap.parse_known_args(argv)  # the rest of vLLM's flags mean nothing here
    return args


def main(argv: list[str] | None = None) -> None:
    import json  # noqa: PLC0415 - only the stand-in needs them
    import signal  # noqa: PLC0415
    import sys  # noqa: PLC0415

    args = _args(argv)
    kv = json.loads(args.kv_events_config)
    sim = SimulatedVllm(
        kv_endpoint=kv.get("endpoint", "tcp://*:5557"),
        replay_endpoint=kv.get("replay_endpoint"),
        topic=kv.get("topic", ""),
        http_host=args.host,
        http_port=args.port,
        capacity=args.capacity,
        layout=Layout(args.layout),
        model=args.served_model_name or args.model,
        cpu_blocks=int(args.kv_offloading_size * (1 << 30)) // BLOCK_BYTES,
        max_num_seqs=args.max_num_seqs,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        step_seconds=args.step_seconds,
        broken_prefix_cache=args.broken_prefix_cache,
    )
    if args.serve_until_signal:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        print("ready", flush=True)
        stop.wait()
        sim.close()
        return
    traffic = Traffic(rate=0.0)
    commands = _commands(sim, traffic)
    print("ready", flush=True)
    with running(sim, traffic):
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            cmd = words[0]
            nums: list[Any] = [float(w) for w in words[1:] if _number(w)]
            if cmd in ("tenant", "adapter"):  # a name first
                nums = [words[1], *nums] if len(words) > 1 else []
            if cmd == "quit":
                break
            with traffic.lock:
                print(_answer(sim, commands, cmd, nums), flush=True)
    sim.close()


def _answer(sim: SimulatedVllm, commands: dict[str, Callable[[list[Any]], object]], cmd: str, nums: list[Any]) -> str:
    import json  # noqa: PLC0415

    if cmd == "stats":
        return json.dumps({**asdict(sim.pool.stats), "batches": sim.publisher.sent})
    handler = commands.get(cmd)
    if handler is None:
        return f"unknown {cmd}\n{USAGE}"
    handler(nums)
    sim.publisher.flush()
    return f"ok {cmd}"


def _number(w: str) -> bool:
    try:
        float(w)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()


class SimulatedEngineProcess:
    """The stand-in run the way pip installs vLLM: a console script named ``vllm`` executed
    through its shebang, so /proc shows "/path/python /dir/vllm serve MODEL ..." as for the real
    engine (and kvwatch's discovery and command-line parsing see what they would see)."""

    def __init__(
        self,
        workdir: Path,
        *,
        http_port: int,
        kv_events: Mapping[str, Any] | None,
        capacity: int = 4000,
        layout: Layout = Layout.V0_26,
        netns: str | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        import json  # noqa: PLC0415
        import subprocess  # noqa: PLC0415
        import sys  # noqa: PLC0415

        workdir.mkdir(parents=True, exist_ok=True)
        script = workdir / "vllm"
        script.write_text(f"#!{sys.executable}\nfrom kvwatch.daemon.lab.engine_sim_cli import main\n\nmain()\n")
        script.chmod(0o755)
        argv = [str(script), "serve", "demo-model", "--port", str(http_port), "--capacity", str(capacity)]
        argv += ["--layout", layout.value, *extra]
        if kv_events is not None:
            argv += ["--kv-events-config", json.dumps(dict(kv_events))]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("simulated engine pipes missing")
        self._in, self._out = self.proc.stdin, self.proc.stdout
        self._expect("ready")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _expect(self, word: str, timeout: float = 30.0) -> str:
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            line = self._out.readline().strip()
        finally:
            timer.cancel()
        if line != word:
            raise RuntimeError(f"simulated engine {self.pid}: expected {word!r}, got {line!r}")
        return line

    def do(self, line: str) -> None:
        self._in.write(line + "\n")
        self._in.flush()
        self._expect(f"ok {line.split(maxsplit=1)[0]}")

    def stats(self) -> dict[str, int]:
        import json  # noqa: PLC0415

        self._in.write("stats\n")
        self._in.flush()
        out: dict[str, int] = json.loads(self._out.readline())
        return out

    def close(self) -> None:
        import contextlib  # noqa: PLC0415

        with contextlib.suppress(OSError, ValueError):
            self._in.write("quit\n")
            self._in.flush()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> SimulatedEngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
