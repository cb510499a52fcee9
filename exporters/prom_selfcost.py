"""Prometheus families of what kvwatch costs, live: per BPF program its kernel-side run time and
runs (while the kernel's BPF statistics are on), the per-call cost of a probed call, and per
watched process what the uprobes cost it and whether the budget shed them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_bpf_stats_enabled",
            GAUGE,
            "1 while the kernel's BPF run-time statistics are on (self_cost.bpf_stats)",
            (),
        ),
        MetricSpec(
            "kvwatch_probe_run_seconds",
            COUNTER,
            "kernel-side run time of each kvwatch BPF program while BPF statistics were on",
            ("family", "program"),
        ),
        MetricSpec(
            "kvwatch_probe_runs",
            COUNTER,
            "runs of each kvwatch BPF program while BPF statistics were on",
            ("family", "program"),
        ),
        MetricSpec(
            "kvwatch_uprobe_call_cost_seconds",
            GAUGE,
            (
                "what one probed call (entry and return) costs its caller on this node: the traps, "
                "timed by a canary at start, plus the family's mean program time per call from the "
                "BPF statistics (source says which)"
            ),
            ("family", "source"),
        ),
        MetricSpec(
            "kvwatch_uprobe_canary_call_seconds",
            GAUGE,
            "the canary's probed-call cost (two traps and a minimal program)",
            (),
        ),
        MetricSpec(
            "kvwatch_uprobe_sheds",
            COUNTER,
            "times the cost budget detached a process's uprobes of this family",
            ("family",),
        ),
        MetricSpec(
            "kvwatch_uprobe_cost_seconds",
            COUNTER,
            "estimated time kvwatch's uprobes took from this process: its probed calls x the per-call cost",
            (*PROCESS_LABELS, "family"),
        ),
        MetricSpec(
            "kvwatch_uprobe_cost_ratio",
            GAUGE,
            "kvwatch's uprobes' share of this process's CPU time over the last budget window (all families)",
            PROCESS_LABELS,
        ),
        MetricSpec(
            "kvwatch_uprobes_shed",
            GAUGE,
            "1 while the cost budget has this family's uprobes detached from the process",
            (*PROCESS_LABELS, "family"),
        ),
    )
)


def self_cost_families(s: Snapshot) -> Iterator[Metric]:
    c = s.self_cost
    stats = METRICS.gauge("kvwatch_bpf_stats_enabled")
    run_seconds = METRICS.counter("kvwatch_probe_run_seconds")
    runs = METRICS.counter("kvwatch_probe_runs")
    call = METRICS.gauge("kvwatch_uprobe_call_cost_seconds")
    canary = METRICS.gauge("kvwatch_uprobe_canary_call_seconds")
    sheds = METRICS.counter("kvwatch_uprobe_sheds")
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
    cost = METRICS.counter("kvwatch_uprobe_cost_seconds")
    ratio = METRICS.gauge("kvwatch_uprobe_cost_ratio")
    shed = METRICS.gauge("kvwatch_uprobes_shed")
    for p in s.processes:
        v = label_values(p.labels, PROCESS_LABELS)
        for f in p.uprobe_costs:
            cost.add_metric([*v, f.family], f.cost_seconds)
            shed.add_metric([*v, f.family], 1.0 if f.shed else 0.0)
        r = next((f.ratio for f in p.uprobe_costs if f.ratio is not None), None)
        if r is not None:
            ratio.add_metric(v, r)
    yield from (stats, run_seconds, runs, call, canary, sheds, cost, ratio, shed)
