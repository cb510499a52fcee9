"""Errors raised by the probe layer. OS and bcc failures are converted here, once."""

from __future__ import annotations


class ProbeError(Exception):
    """Base class for every failure of the probe layer."""


class BccUnavailable(ProbeError):
    """bcc cannot be imported (not installed, or not the system interpreter)."""


class ProbeCompileError(ProbeError):
    """The BPF program did not compile or load."""


class ProbeAttachError(ProbeError):
    """One hook could not be attached; the rest of the program keeps working."""

    def __init__(self, hook: str, target: str, reason: str) -> None:
        super().__init__(f"{hook}: cannot attach to {target}: {reason}")
        self.hook = hook
        self.target = target
        self.reason = reason
