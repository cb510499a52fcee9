"""KVWatchProbeShed: kvwatch's cost budget detached a watched process's uprobes (its probed
calls cost more than ``self_cost.budget`` of the process's CPU for several windows); they are
attached again after a back-off. While shed, that family's numbers for the process stand still.
Firing while any family of the process is shed; the cause is the family."""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVWatchProbeShed"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="kvwatch detached uprobes costing a process > 1 % of its CPU",
        severities=("warning",),
        causes=(),
        labels=(),
        summary=(
            "kvwatch shed its {{ $labels.cause }} uprobes on {{ $labels.engine }} pid {{ $labels.pid "
            "}}: over its cost budget on {{ $labels.instance }}"
        ),
        description=(
            "kvwatch's {{ $labels.cause }} uprobes cost {{ $labels.engine }} pid {{ $labels.pid }} "
            "(pod {{ $labels.pod }}) {{ with printf \"kvwatch_uprobe_cost_ratio{instance='%s',pid='%s'"
            '}" $labels.instance $labels.pid | query }}{{ . | first | value | humanizePercentage '
            "}}{{ else }}more than the budget{{ end }} of its CPU, so kvwatch detached them; they "
            "are attached again after a back-off. Until then that family's numbers for the process "
            "stand still. Raise self_cost.budget to keep them, or leave kvwatch to protect the "
            "workload."
        ),
        group="kvwatch.agent",
    ),
)


@dataclass(slots=True)
class _Always:
    enabled: bool = True  # no section of its own: the budget's (self_cost) decides what is shed


COST_RATIO = "uprobe_cost_ratio"  # the finding's value: uprobes' cost over the process's CPU


class ProbeShed(ProcessDetector[_Always, None]):
    name = ALERT

    def __init__(self) -> None:
        super().__init__(_Always())

    def applies(self, p: ProcessWindow) -> bool:
        return bool(p.uprobes)

    def new_state(self) -> None:
        return None

    def judge(self, key: str, st: None, p: ProcessWindow, now: float) -> Finding:
        shed = sorted(name for name, u in p.uprobes.items() if u.shed)
        ratio = p.uprobe_cost_ratio
        return Finding(
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
