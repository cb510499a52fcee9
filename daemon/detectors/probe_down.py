"""KVWatchProbeDown: a hook the config asked for is not attached, or attached but silent.

"Silent" is judged only for hooks that fire continuously on any live node
(page release); the rest are checked by ``kvwatch doctor``'s canaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.windows import NodeWindow
from kvwatch.probes.records import HookState

ALERT = "KVWatchProbeDown"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="a probe the configuration asks for is not attached, or silent",
        severities=("warning",),
        causes=("missing", "failed", "shed", "silent"),
        labels=("probe", "family"),
        summary="kvwatch probe {{ $labels.probe }} is {{ $labels.cause }} on {{ $labels.instance }}",
        description=(
            "A probe the configuration asks for is not attached or has gone silent ({{ $labels.cause "
            "}}): kvwatch is partly blind on {{ $labels.instance }}. `kvwatch doctor` names the "
            "reason."
        ),
        group="kvwatch.agent",
        process=False,
    ),
)
ALWAYS_BUSY = frozenset({"page_free"})
SILENT_AFTER_SECONDS = 60.0


@dataclass(slots=True)
class _Silence:
    hits: int
    since: float


class ProbeDown:
    name = ALERT
    alerts: ClassVar[tuple[str, ...]] = (ALERT,)
    outlives_subject: ClassVar[bool] = False

    def __init__(self) -> None:
        self._silence: dict[str, _Silence] = {}

    def forget(self, subject_key: str) -> None:
        self._silence.pop(subject_key, None)

    def evaluate(self, view: NodeWindow) -> list[Finding]:
        out: list[Finding] = []
        hits, now = view.probe_hits, view.now
        for st in view.probes:
            if st.state is HookState.DISABLED or not st.required:
                continue
            key = f"probe:{st.family}:{st.name}"
            cause = ""
            if st.state is not HookState.ATTACHED:
                cause = st.state.value
            elif st.name in ALWAYS_BUSY:
                h = hits.get(st.name, 0)
                s = self._silence.get(key)
                if s is None or h != s.hits:
                    self._silence[key] = _Silence(h, now)
                elif now - s.since >= SILENT_AFTER_SECONDS:
                    cause = "silent"
            out.append(
                Finding(
                    alert=ALERT,
                    subject=Subject(key, {"probe": st.name, "family": st.family}),
                    firing=bool(cause),
                    cause=cause,
                    summary=f"probe {st.family}/{st.name} on {st.target}: {cause or 'ok'}"
                    + (f" ({st.reason})" if st.reason else ""),
                    severity="warning",
                )
            )
        return out
