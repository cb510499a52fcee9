"""Prometheus families of what kvwatch costs, live: per BPF program its kernel-side run time and
runs (while the kernel's BPF statistics are on), the per-call cost of a probed call, and per
watched process what the uprobes cost it and whether the budget shed them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values


def self_cost_families(s: Snapshot) -> Iterator[Metric]:
    c = s.self_cost
    stats = GaugeMetricFamily(
        "kvwatch_bpf_stats_enabled", "1 while the kernel's BPF run-time statistics are on (self_cost.bpf_stats)"
    )
    run_seconds = CounterMetricFamily(
        "kvwatch_probe_run_seconds",
        "kernel-side run time of each kvwatch BPF program while BPF statistics were on",
        labels=["family", "program"],
    )
    runs = CounterMetricFamily(
        "kvwatch_probe_runs",
        "runs of each kvwatch BPF program while BPF statistics were on",
        labels=["family", "program"],
    )
    call = GaugeMetricFamily(
        "kvwatch_uprobe_call_cost_seconds",
        "what one probed call (entry and return) costs its caller on this node: the traps, timed by a canary "
        "at start, plus the family's mean program time per call from the BPF statistics (source says which)",
        labels=["family", "source"],
    )
    canary = GaugeMetricFamily(
        "kvwatch_uprobe_canary_call_seconds", "the canary's probed-call cost (two traps and a minimal program)"
    )
    sheds = CounterMetricFamily(
        "kvwatch_uprobe_sheds", "times the cost budget detached a process's uprobes of this family", labels=["family"]
    )
    if c is not None:
        stats.add_metric([], 1.0 if c.bpf_stats else 0.0)
        for prog in c.programs:
            run_seconds.add_metric([prog.family, prog.program], prog.run_seconds)
            runs.add_metric([prog.family, prog.program], prog.runs)
        for fam, (ns, source) in sorted(c.call_ns.items()):
            call.add_metric([fam, source], ns / 1e9)
        if c.canary_call_ns is not None:
            canary.add_metric([], c.canary_call_ns / 1e9)
        for fam, n in sorted((c.sheds or {}).items()):
            sheds.add_metric([fam], n)
    labels = [*PROCESS_LABELS, "family"]
    cost = CounterMetricFamily(
        "kvwatch_uprobe_cost_seconds",
        "estimated time kvwatch's uprobes took from this process: its probed calls x the per-call cost",
        labels=labels,
    )
    ratio = GaugeMetricFamily(
        "kvwatch_uprobe_cost_ratio",
        "kvwatch's uprobes' share of this process's CPU time over the last budget window (all families)",
        labels=PROCESS_LABELS,
    )
    shed = GaugeMetricFamily(
        "kvwatch_uprobes_shed",
        "1 while the cost budget has this family's uprobes detached from the process",
        labels=labels,
    )
    for p in s.processes:
        v = label_values(p.labels, PROCESS_LABELS)
        for f in p.uprobe_costs:
            cost.add_metric([*v, f.family], f.cost_seconds)
            shed.add_metric([*v, f.family], 1.0 if f.shed else 0.0)
        r = next((f.ratio for f in p.uprobe_costs if f.ratio is not None), None)
        if r is not None:
            ratio.add_metric(v, r)
    yield from (stats, run_seconds, runs, call, canary, sheds, cost, ratio, shed)
