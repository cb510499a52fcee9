"""Every engine kvwatch knows, one module each (``daemon/engines/kind.py`` says what a module
declares). The order is the mechanisms' order of preference: the first engine's discovery rule
that matches names a process, and where two engines export the same field, the first one's
sample names are tried first.
"""

from __future__ import annotations

from kvwatch.daemon.engines.kind import EngineKind
from kvwatch.daemon.engines.kinds import dynamo, found_only, lmcache, sglang, tgi, vllm

KINDS: tuple[EngineKind, ...] = (
    vllm.KIND,
    lmcache.KIND,
    sglang.KIND,
    dynamo.KIND,
    tgi.KIND,
    found_only.TRITON,
    found_only.LMDEPLOY,
)
BY_NAME = {k.name: k for k in KINDS}
