"""Base of the detectors that judge each watched process on its own observations, with a state of
their own per process (dropped with the process)."""

from __future__ import annotations

from typing import ClassVar, Generic, Protocol, TypeVar

from kvwatch.daemon.model.findings import Finding
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow


class _Switchable(Protocol):
    @property
    def enabled(self) -> bool: ...


C = TypeVar("C", bound=_Switchable)
S = TypeVar("S")


class ProcessDetector(Generic[C, S]):
    """Judges every watched process it ``applies`` to; subclasses give ``name``, ``new_state``
    and ``judge`` (``judge_all`` where one process gives findings of more than one alert:
    ``alerts`` names them all)."""

    name: str = ""
    alerts: ClassVar[tuple[str, ...]] = ()  # every alert it can raise; () means (name,)
    outlives_subject: ClassVar[bool] = False  # its alerts stay when their process exits

    def __init__(self, config: C) -> None:
        self.config = config
        self._state: dict[str, S] = {}

    def forget(self, subject_key: str) -> None:
        self._state.pop(subject_key, None)

    def evaluate(self, view: NodeWindow) -> list[Finding]:
        if not self.config.enabled:
            return []
        out = []
        for key, p in view.processes.items():
            if self.applies(p):
                st = self._state.get(key)
                if st is None:
                    st = self._state[key] = self.new_state()
                out += self.judge_all(key, st, p, view.now)
        return out

    def applies(self, p: ProcessWindow) -> bool:
        """Judged at all (override: by default, every process)."""
        return True

    def new_state(self) -> S:
        raise NotImplementedError

    def judge(self, key: str, st: S, p: ProcessWindow, now: float) -> Finding:
        raise NotImplementedError

    def judge_all(self, key: str, st: S, p: ProcessWindow, now: float) -> list[Finding]:
        return [self.judge(key, st, p, now)]
