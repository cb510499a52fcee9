"""An engine's taps from its own command line (read as argv from /proc, so JSON flag values keep
their spaces): the plan of the engine's module for the process's component (vLLM's API server,
SGLang's server: ``kinds/``), else an engine's plan for any process whose flags are that engine's
(a wrapper launching vLLM with vLLM's own argument parser); its /metrics only when the process is
that engine's, or names a ``--port``.

Where each endpoint is reached from kvwatch is ``Reach``'s to say (``reach.py``), and only an
endpoint of the process's own is tapped; what is refused is a note of the plan and counted
(``planning.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.kinds import BY_NAME, KINDS
from kvwatch.daemon.engines.planning import Planning, flag_values
from kvwatch.daemon.engines.reach import Reach
from kvwatch.daemon.model.engines import EnginePlan
from kvwatch.daemon.tracker import Tracked


def plan_from_cmdline(t: Tracked, argv: Sequence[str], cfg: EnginesConfig, reach: Reach) -> EnginePlan | None:
    """The taps of an engine's root process, and of any watched process whose command line is an
    engine's own; None for the rest."""
    engine, component = t.proc.labels.engine, t.proc.labels.component
    flags = flag_values(argv[1:])
    kind = BY_NAME.get(engine)
    own = kind.plans.get(component) if kind is not None else None
    if own is not None:
        plan = own(Planning(t.key, t.pid, reach), flags, cfg)
    else:
        plan = _any_process_plan(t, flags, cfg, reach)
    if plan is None or (not plan.streams and plan.metrics_url is None and not plan.notes):
        return None
    return plan


def _any_process_plan(t: Tracked, flags: Mapping[str, str], cfg: EnginesConfig, reach: Reach) -> EnginePlan | None:
    for k in KINDS:
        if k.any_process_plan is None:
            continue
        metrics = t.proc.labels.engine == k.name or "--port" in flags
        planned = k.any_process_plan(
            Planning(t.key, t.pid, reach), flags, cfg if metrics else msgspec.structs.replace(cfg, metrics=False)
        )
        if planned is not None:
            return planned
    return None
