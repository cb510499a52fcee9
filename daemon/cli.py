"""The ``kvwatch`` command: run, top, record, doctor, demo."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from kvwatch.daemon import logs
from kvwatch.daemon.config import Config
from kvwatch.daemon.config.load import ConfigError, load_config
from kvwatch.daemon.demo_scenarios import DEMO_SCENARIOS
from kvwatch.daemon.version import kvwatch_version
from kvwatch.exporters.top_columns import SORT_KEYS

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


TOP_EPILOG = """\
keys: s next sort column, r reverse, / filter, escape clear filter, a alerting only,
      t tenants (per tenant of each engine's KV pool: who stores, whose blocks are evicted,
      who recomputes, and by whom), + / - refresh faster / slower, q quit
sort columns: pid engine pod gpu alloc allocb free dev host pgfree evict policy stall xfer bw link kv alerts
reads a running daemon's /api/v1/top when one answers, otherwise starts its own probes (root).
"""

RECORD_EPILOG = """\
examples:
  sudo kvwatch record --duration 30 --output /tmp/kv.json   # then open it in ui.perfetto.dev
the trace has one track group per process (CUDA allocations, KV transfers, reclaim stalls,
KV blocks, KV lost, KV tenants, engine latency, alerts) and a node track (KV-tier page cache);
counters are counts per tick; engine latency: the mean ms of each tick's new observations.
alerts come from the running daemon (--url, default from daemon.listen) when it answers: its
detectors are warm; --local, or no daemon, takes the recorder's own (silent through warm-up).
"""


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


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
    """The configuration from every source; --pid and --kv-dir add to the lists the others give,
    checked with them (a bad one is a problem naming its key, like any other)."""
    extend = {
        "discovery.pids": (list(args.pid), "--pid"),
        "kv_tiers.dirs": ([{"path": str(d)} for d in args.kv_dir], "--kv-dir"),
    }
    return load_config(args.config, overrides=_overrides(args), sets=args.set, extend=extend)


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand with the config flags every command takes."""
    p = sub.add_parser(name, help=help_text, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_flags(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwatch",
        description="Watch LLM inference servers' KV cache from the outside with eBPF.",
    )
    parser.add_argument("--version", action="version", version=f"kvwatch {kvwatch_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = _command(sub, "run", "the daemon (foreground)", RUN_EPILOG)
    run.add_argument("--listen", metavar="HOST:PORT", help="address for /metrics, /healthz, /readyz")
    run.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)

    doctor = _command(sub, "doctor", "check prerequisites and run a canary per probe")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--no-oom-canary", action="store_true", help="skip the OOM canary (kills its own child)")

    top = _command(sub, "top", "live table of watched inference processes", TOP_EPILOG)
    top.add_argument("--interval", type=_positive, default=1.0, metavar="S", help="refresh every S seconds (1)")
    top.add_argument("--once", action="store_true", help="print one plain frame after one interval and exit")
    top.add_argument("--url", help="the daemon to read (default: from the config's daemon.listen)")
    top.add_argument("--local", action="store_true", help="do not look for a daemon: start kvwatch's own probes")
    top.add_argument("--sort", choices=SORT_KEYS, default="alloc", help="initial sort column (alloc)")
    top.add_argument("--filter", default="", help="initial filter: text in any column")
    top.add_argument("--width", type=int, help="--once: width of the frame (default 240)")
    top.add_argument("--tenants", action="store_true", help="start in the tenant view (key t toggles it)")

    rec = _command(
        sub, "record", "record a timeline (Chrome trace-event JSON for Perfetto / chrome://tracing)", RECORD_EPILOG
    )
    rec.add_argument("--duration", type=_positive, required=True, metavar="S", help="seconds to record")
    rec.add_argument("--output", "-o", type=Path, required=True, metavar="FILE", help="trace file to write (.json)")
    rec.add_argument("--max-events", type=int, default=1_000_000, metavar="N", help="bound on events kept (1000000)")
    rec.add_argument("--url", help="the daemon whose alerts to record (default: from the config's daemon.listen)")
    rec.add_argument("--local", action="store_true", help="alerts from the recorder's own detectors, not a daemon's")

    demo = _command(sub, "demo", "reproduce each failure mode with the daemon watching")
    demo.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:0")
    demo.add_argument(
        "--scenario",
        action="append",
        choices=DEMO_SCENARIOS,
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
    commands = {"run": cmd_run, "top": cmd_top, "record": cmd_record, "doctor": cmd_doctor, "demo": cmd_demo}
    return commands[args.command](config, args)


def cmd_record(config: Config, args: argparse.Namespace) -> int:
    logs.configure(config.daemon.log_format, "warning")
    from kvwatch.daemon.wiring import build_agent  # noqa: PLC0415 - bcc only when needed
    from kvwatch.exporters.record_cmd import run_record  # noqa: PLC0415 - subcommand on demand
    from kvwatch.exporters.record_daemon import DaemonAlerts  # noqa: PLC0415
    from kvwatch.exporters.top import daemon_source  # noqa: PLC0415

    daemon = None if args.local else DaemonAlerts(daemon_source(config, args.url, timeout=0.5))
    tick = config.daemon.tick_seconds
    return run_record(lambda: build_agent(config), tick, args.duration, args.output, args.max_events, daemon=daemon)


def cmd_doctor(config: Config, args: argparse.Namespace) -> int:
    logs.configure(config.daemon.log_format, config.daemon.log_level)
    from kvwatch.daemon.doctor.main import run_doctor  # noqa: PLC0415 - subcommand on demand

    return run_doctor(config, as_json=args.json, oom_canary=not args.no_oom_canary)


def cmd_demo(config: Config, args: argparse.Namespace) -> int:
    logs.configure(config.daemon.log_format, config.daemon.log_level)
    from kvwatch.daemon.lab.demo import run_demo  # noqa: PLC0415 - subcommand on demand

    return run_demo(config, args)


def cmd_top(config: Config, args: argparse.Namespace) -> int:
    import tempfile  # noqa: PLC0415

    from kvwatch.exporters.top_cmd import TopOptions, run_top  # noqa: PLC0415 - subcommand on demand

    live = not args.once and sys.stdout.isatty()
    if live:  # the screen belongs to the table: the probes' log lines go to a file
        path = Path(tempfile.gettempdir()) / f"kvwatch-top-{os.getuid()}.log"
        logs.configure("json", "warning", stream=path.open("a"))
    else:
        logs.configure(config.daemon.log_format, "warning")
    opts = TopOptions(
        interval=args.interval,
        once=args.once,
        url=args.url,
        local=args.local,
        sort=args.sort,
        filter=args.filter,
        width=args.width,
        tenants=args.tenants,
    )
    from kvwatch.daemon.wiring import build_agent  # noqa: PLC0415 - bcc only when needed

    return run_top(config, opts, local=lambda: build_agent(config))


def cmd_run(config: Config, args: argparse.Namespace) -> int:
    logs.configure(config.daemon.log_format, config.daemon.log_level)
    from kvwatch.daemon.wiring import Daemon, memory_options  # noqa: PLC0415 - keeps `--help` fast

    if args.ebpf:
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
