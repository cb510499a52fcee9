"""KVWatchProbeShed: kvwatch's cost budget detached a watched process's uprobes (its probed
calls cost more than ``self_cost.budget`` of the process's CPU for several windows); they are
attached again after a back-off. While shed, that family's numbers for the process stand still.
Firing while any family of the process is shed; the cause is the family."""

from __future__ import annotations

from kvwatch.daemon.detectors.base import Finding, Subject
from kvwatch.daemon.detectors.view import NodeView
from kvwatch.daemon.families.runner import UPROBES_SHED
from kvwatch.daemon.selfcost import COST_RATIO

ALERT = "KVWatchProbeShed"


class ProbeShed:
    name = ALERT

    def forget(self, subject_key: str) -> None:
        pass

    def evaluate(self, view: NodeView) -> list[Finding]:
        out = []
        for key, p in view.processes.items():
            gauges = p.series.gauges
            families = sorted(k.removeprefix(UPROBES_SHED) for k in gauges if k.startswith(UPROBES_SHED))
            if not families:
                continue
            shed = [f for f in families if gauges.get(f"{UPROBES_SHED}{f}")]
            ratio = gauges.get(COST_RATIO)
            out.append(
                Finding(
                    alert=ALERT,
                    subject=Subject(key, p.subject.labels),
                    firing=bool(shed),
                    cause=shed[0] if shed else "",
                    values={COST_RATIO: ratio} if ratio is not None else {},
                    summary=f"pid {p.subject.labels.get('pid', '?')}: "
                    + (f"{', '.join(shed)} uprobes detached, over the cost budget" if shed else "uprobes attached")
                    + (f" (last measured {ratio:.1%} of its CPU)" if ratio is not None else ""),
                    severity="warning",
                )
            )
        return out
