"""Composition: the one place that builds the agent from config (real probes, /proc, NVML, the
engine taps, the alert sinks) and puts an HTTP server in front of it. ``kvwatch run`` and the
demo use ``Daemon``; ``top --local`` and ``record`` use ``build_agent``. Nothing else builds an
agent: exporters read snapshots, and are handed a loop when they need one.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any

import structlog

from kvwatch.daemon.agent import Agent, AgentParts
from kvwatch.daemon.alerts import AlertBook, AlertSink, LogSink
from kvwatch.daemon.config import Config, parse_listen
from kvwatch.daemon.detectors.registry import alert_label_names, alert_names, build_detectors, lasting_alerts
from kvwatch.daemon.discovery import Discovery
from kvwatch.daemon.engines.audit import MetricAudit, audit_settings
from kvwatch.daemon.engines.ledger import LossLedger
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.families.cost import SelfCost
from kvwatch.daemon.families.cuda import cuda_family
from kvwatch.daemon.families.gpu import GpuMemory
from kvwatch.daemon.families.memory import MemoryFamily
from kvwatch.daemon.families.transfer import link_bytes_per_second, transfer_family
from kvwatch.daemon.host.allocator import Allocator
from kvwatch.daemon.host.nvml import Nvml
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.host.psi import PressureReader
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.tracker import ProcessTracker
from kvwatch.daemon.version import kvwatch_version
from kvwatch.exporters.http import MetricsServer
from kvwatch.exporters.prometheus import SnapshotCollector, build_registry
from kvwatch.probes.bpf import bcc_version
from kvwatch.probes.canary import BpfStats, CanaryResult, UprobeCanary
from kvwatch.probes.cuda import CudaProbeOptions, CudaProbes
from kvwatch.probes.memory import MemoryProbeOptions, MemoryProbes
from kvwatch.probes.transfer import TransferProbeOptions, TransferProbes

log = structlog.get_logger("kvwatch")


def cuda_options(config: Config) -> CudaProbeOptions:
    return CudaProbeOptions(
        max_ledger=config.probes.cuda_max_ledger,
        max_processes=max(1024, config.discovery.max_processes * 2),
        driver_api=config.probes.cuda_driver_api,
    )


def memory_options(config: Config) -> MemoryProbeOptions:
    return MemoryProbeOptions(
        features=frozenset(config.probes.memory),
        max_watched=max(4096, config.discovery.max_processes * 4),
        max_kv_inodes=config.kv_tiers.max_files,
        max_evicted=config.probes.max_evicted_pages_tracked,
        max_reclaimers=config.probes.max_reclaimers,
        ringbuf_pages=config.probes.ringbuf_pages,
    )


def build_agent(
    config: Config, *, sinks: Iterable[AlertSink] = (), use_bpf: bool = True, allocator: Allocator | None = None
) -> Agent:
    """The production wiring: real probes, real /proc, NVML when present. One ``ProcFS`` for
    everyone: the agent reads through it, and the probes are handed its procfs mount."""
    procfs = ProcFS(proc=config.discovery.proc_root)
    memory = MemoryProbes(memory_options(config)) if use_bpf and config.probes.memory else None
    cuda = CudaProbes(cuda_options(config), proc_root=procfs.proc) if use_bpf and config.probes.cuda else None
    nvml = None
    if config.discovery.nvml != "off":
        nvml, reason = Nvml.open()
        if nvml is None:
            level = log.warning if config.discovery.nvml == "on" else log.info
            level("NVML not used", reason=reason)
    transfer = (
        TransferProbes(
            TransferProbeOptions(pending_timeout_seconds=config.probes.transfer_pending_timeout_seconds),
            proc_root=procfs.proc,
        )
        if use_bpf and config.probes.transfer
        else None
    )
    errors = ErrorBook()  # one book for the loop and everything it drives
    engines = None
    if config.engines.kv_events or config.engines.metrics:
        engines = EngineTaps(config.engines, procfs, errors)
    all_sinks = list(sinks)
    if config.alerts.alertmanager.url:
        from kvwatch.exporters.alertmanager import AlertmanagerSink  # noqa: PLC0415 - only when configured

        all_sinks.append(AlertmanagerSink(config.alerts.alertmanager))
    return assemble(
        config,
        memory=memory,
        cuda=cuda,
        transfer=transfer,
        engines=engines,
        procfs=procfs,
        nvml=nvml,
        sinks=all_sinks,
        canary=UprobeCanary().measure if use_bpf else None,
        bpf_stats=BpfStats() if use_bpf else None,
        errors=errors,
        allocator=allocator,
    )


def assemble(
    config: Config,
    *,
    memory: MemoryProbes | None,
    cuda: CudaProbes | None = None,
    transfer: TransferProbes | None = None,
    engines: EngineTaps | None = None,
    procfs: ProcFS,
    nvml: Nvml | None = None,
    sinks: Sequence[AlertSink] | None = None,
    canary: Callable[[], CanaryResult] | None = None,
    bpf_stats: BpfStats | None = None,
    errors: ErrorBook | None = None,
    allocator: Allocator | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> Agent:
    """An agent from its probes (any of them None: that source runs without), /proc and NVML:
    every collaborator of the loop is built here. Tests hand it stand-ins the same way."""
    errors = errors if errors is not None else ErrorBook()
    discovery = Discovery(config.discovery, procfs, nvml.pids if nvml is not None else None, config.engines.endpoints)
    tracker = ProcessTracker(
        discovery,
        procfs,
        memory,
        clock=clock,
        max_processes=config.discovery.max_processes,
        follow_children=config.discovery.follow_children,
        hints_per_tick=config.discovery.exec_hints_per_tick,
    )
    gpu = GpuMemory(nvml, errors)
    link = link_bytes_per_second(config.transfers.link_bits_per_second, config.transfers.link_interface, procfs)
    detectors = build_detectors(config.detectors, link)
    default_sinks: list[AlertSink] = [LogSink()] if config.alerts.log else []
    return Agent(
        config,
        AgentParts(
            errors=errors,
            procfs=procfs,
            tracker=tracker,
            memory=MemoryFamily(config, memory, tracker, procfs, errors, clock=clock),
            gpu=gpu,
            cuda=cuda_family(cuda, config, errors, clock, more_observations=gpu.observe),
            transfer=transfer_family(transfer, config, errors, clock),
            engines=engines,
            pressure=PressureReader(procfs),
            detectors=detectors,
            losses=LossLedger(config.engines.kv_block_bytes, config.engines.loss_linger_seconds),
            audit=MetricAudit(audit_settings(config.detectors.engine_metric_divergence)),
            self_cost=SelfCost(config.self_cost),
            alerts=AlertBook(
                default_sinks + list(sinks or []),
                alert_names(detectors),
                lasting_alerts(detectors),
                alert_label_names(),
            ),
            link_bytes_per_second=link,
            canary=canary,
            bpf_stats=bpf_stats,
            allocator=allocator,
            clock=clock,
            wall=wall,
        ),
    )


class Daemon:
    """The agent, its HTTP server and signal handling, as ``kvwatch run`` uses them."""

    def __init__(self, config: Config, *, sinks: Sequence[Any] = ()) -> None:
        self.config = config
        self.stop = threading.Event()
        allocator = Allocator()
        allocator.tune()  # before the agent's threads start
        self.agent = build_agent(config, sinks=sinks, allocator=allocator)
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
            max_connections=config.daemon.max_connections,
            timeout_seconds=config.daemon.http_timeout_seconds,
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
        """Stop serving and close the agent side by side: the HTTP server leaves its loop only at
        its next poll (up to half a second) and the agent's close waits seconds for the kernel to
        release its uprobes, so neither waits for the other. Returns when both are done; the
        server only ever reads published snapshots, which closing the agent leaves intact."""
        stopping = threading.Thread(target=self.server.stop, name="kvwatch-http-stop")
        stopping.start()
        try:
            self.agent.close()
        finally:
            stopping.join()
        log.info("stopped: probes detached, alert sinks flushed")
