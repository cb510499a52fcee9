"""The ``kvwatch`` command: run, doctor, demo (top and record come with their exporters)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
from kvwatch.daemon import logs
from kvwatch.daemon.config import Config, ConfigError, load_config, parse_listen

log = structlog.get_logger("kvwatch")

RUN_EPILOG = """\
examples:
  kvwatch run                                   # defaults, or /etc/kvwatch/kvwatch.toml if present
  kvwatch run --listen 0.0.0.0:9740             # expose /metrics beyond loopback
  kvwatch run --pid 4242 --kv-dir /mnt/nvme/lmcache
  kvwatch run --set detectors.host_tier_eviction.warmup_seconds=0
  KVWATCH_DISCOVERY__INTERVAL_SECONDS=2 kvwatch run --log-format json

overhead: tracepoints cost tens of ns per page event and are counted in the kernel;
see bench/ and docs/ for measured figures.
"""


def kvwatch_version() -> str:
    try:
        return version("kvwatch")
    except PackageNotFoundError:
        return "0+unknown"


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML config file (default /etc/kvwatch/kvwatch.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="set any config key")
    p.add_argument("--log-format", choices=["auto", "json", "console"], help="log output format")
    p.add_argument("--pid", action="append", type=int, default=[], help="watch this process by hand (repeatable)")
    p.add_argument("--kv-dir", action="append", type=Path, default=[], help="a KV-tier directory (repeatable)")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {}
    if getattr(args, "listen", None):
        o["daemon.listen"] = args.listen
    if args.log_format:
        o["daemon.log_format"] = args.log_format
    return o


def config_from_args(args: argparse.Namespace) -> Config:
    config = load_config(args.config, overrides=_overrides(args), sets=args.set)
    if args.pid or args.kv_dir:
        data = config.model_dump()
        data["discovery"]["pids"] = sorted({*config.discovery.pids, *args.pid})
        data["kv_tiers"]["dirs"] = [*data["kv_tiers"]["dirs"], *({"path": d} for d in args.kv_dir)]
        config = Config.model_validate(data)
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwatch",
        description="Watch LLM inference servers' KV cache from the outside with eBPF.",
    )
    parser.add_argument("--version", action="version", version=f"kvwatch {kvwatch_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="the daemon (foreground)",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_flags(run)
    run.add_argument("--listen", metavar="HOST:PORT", help="address for /metrics, /healthz, /readyz")
    run.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)

    doctor = sub.add_parser("doctor", help="check prerequisites and run a canary per probe")
    _add_config_flags(doctor)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--no-oom-canary", action="store_true", help="skip the OOM canary (kills its own child)")

    demo = sub.add_parser("demo", help="reproduce each failure mode with the daemon watching")
    _add_config_flags(demo)
    demo.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:0")
    demo.add_argument(
        "--scenario",
        action="append",
        choices=["host-tier", "reuse-collapse", "transfer-collapse", "eviction-burst", "oom"],
        help="default: all",
    )
    demo.add_argument("--work-dir", type=Path, default=Path("/var/tmp/kvwatch-demo"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as err:
        print(f"kvwatch: {err}", file=sys.stderr)
        return 2
    logs.configure(config.daemon.log_format, config.daemon.log_level)
    if args.command == "run":
        return cmd_run(config, args)
    if args.command == "doctor":
        from kvwatch.daemon.doctor import run_doctor  # noqa: PLC0415 - subcommand on demand

        return run_doctor(config, as_json=args.json, oom_canary=not args.no_oom_canary)
    if args.command == "demo":
        from kvwatch.daemon.demo import run_demo  # noqa: PLC0415 - subcommand on demand

        return run_demo(config, args)
    return 2


class Daemon:
    """The agent, its HTTP server and signal handling, as ``kvwatch run`` uses them."""

    def __init__(self, config: Config, *, sinks: Sequence[Any] = ()) -> None:
        from kvwatch.daemon.agent import build_agent  # noqa: PLC0415 - keeps `--help` fast
        from kvwatch.exporters.http import MetricsServer  # noqa: PLC0415
        from kvwatch.exporters.prometheus import SnapshotCollector, build_registry  # noqa: PLC0415
        from kvwatch.probes.bpf import bcc_version  # noqa: PLC0415

        self.config = config
        self.stop = threading.Event()
        self.agent = build_agent(config, sinks=sinks)
        collector = SnapshotCollector(lambda: self.agent.snapshot, version=kvwatch_version(), bcc_version=bcc_version())
        host, port = parse_listen(config.daemon.listen)
        self.server = MetricsServer(
            host,
            port,
            build_registry(collector),
            lambda: self.agent.snapshot,
            tick_seconds=config.daemon.tick_seconds,
            clock=time.time,
            tls_cert=config.daemon.tls_cert,
            tls_key=config.daemon.tls_key,
        )

    def install_signal_handlers(self) -> None:
        def _stop(signum: int, _frame: FrameType | None) -> None:
            log.info("stopping", signal=signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def serve(self) -> None:
        self.server.start()
        host, port = self.server.address
        log.info("kvwatch running", listen=f"{host}:{port}", version=kvwatch_version())
        try:
            self.agent.start()
            snap = self.agent.snapshot
            log.info(
                "probes attached" if snap.ready else "running degraded",
                ready=snap.ready,
                reasons=list(snap.not_ready_reasons),
                watched=sum(1 for p in snap.processes if p.alive),
            )
            self.agent.run(self.stop)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.server.stop()
        self.agent.close()
        log.info("stopped: probes detached, alert sinks flushed")


def cmd_run(config: Config, args: argparse.Namespace) -> int:
    if args.ebpf:
        from kvwatch.daemon.agent import memory_options  # noqa: PLC0415
        from kvwatch.probes.memory import MemoryProbes  # noqa: PLC0415

        print(MemoryProbes(memory_options(config)).ebpf_text())
        return 0
    try:
        daemon = Daemon(config)
    except OSError as err:
        log.error("cannot listen", listen=config.daemon.listen, error=str(err))  # noqa: TRY400 - the message says it all
        return 1
    daemon.install_signal_handlers()
    daemon.serve()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
