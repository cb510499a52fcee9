"""Engines kvwatch finds and labels, and watches from the kernel and the CUDA runtime only:
Triton Inference Server and LMDeploy (no KV taps of their own)."""

from __future__ import annotations

from kvwatch.daemon.config import EngineRule
from kvwatch.daemon.engines.kind import SCRIPT, EngineKind

TRITON = EngineKind(name="triton", rules=(EngineRule(engine="triton", comm=r"^tritonserver$"),))
LMDEPLOY = EngineKind(name="lmdeploy", rules=(EngineRule(engine="lmdeploy", cmdline=SCRIPT + r"lmdeploy\s+serve\b"),))
