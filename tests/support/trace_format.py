"""A checker for the Chrome trace-event format (the JSON Perfetto and chrome://tracing load).

Written from the format's specification ("Trace Event Format", Google): the JSON object
form with ``traceEvents``; per phase the fields each event must carry. Returns every
problem found, so a test failure names them all.
"""

from __future__ import annotations

import numbers
from typing import Any

PHASES = set("BEXiIsCbneMPOND(ftTpSU") | {"R"}
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def _num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _metadata_problems(ev: dict[str, Any]) -> list[str]:
    out = [] if ev.get("name") in METADATA_NAMES else [f"unknown metadata {ev.get('name')!r}"]
    return out if isinstance(ev.get("args"), dict) else [*out, "metadata without args"]


def _event_problems(ev: dict[str, Any], open_b: dict[tuple[Any, Any], int]) -> list[str]:
    out: list[str] = []
    ph = ev.get("ph")
    if ph not in PHASES:
        return [f"unknown phase {ph!r}"]
    if not isinstance(ev.get("name"), str):
        out.append("name missing")
    if "pid" not in ev:
        out.append("pid missing")
    out += [f"{k} not an integer" for k in ("pid", "tid") if k in ev and not isinstance(ev[k], int)]
    if "args" in ev and not isinstance(ev["args"], dict):
        out.append("args not an object")
    if ph == "M":
        return out + _metadata_problems(ev)
    if not _num(ev.get("ts")) or ev["ts"] < 0:
        out.append("ts missing or negative")
    if ph != "C" and "tid" not in ev:
        out.append("tid missing")
    if ph == "X" and (not _num(ev.get("dur")) or ev["dur"] < 0):
        out.append("complete event without a non-negative dur")
    args = ev.get("args")
    if ph == "C" and (not isinstance(args, dict) or not args or not all(_num(v) for v in args.values())):
        out.append("counter args must be a non-empty map of numbers")
    if ph == "i" and ev.get("s", "t") not in ("g", "p", "t"):
        out.append(f"instant scope {ev.get('s')!r}")
    if ph in ("B", "E"):
        key = (ev.get("pid"), ev.get("tid"))
        open_b[key] = open_b.get(key, 0) + (1 if ph == "B" else -1)
        if open_b[key] < 0:
            out.append("E without B")
    return out


def problems(trace: Any) -> list[str]:
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not the JSON object form: no traceEvents list"]
    out: list[str] = []
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        out.append(f"displayTimeUnit {trace['displayTimeUnit']!r} is neither ms nor ns")
    open_b: dict[tuple[Any, Any], int] = {}
    for i, ev in enumerate(trace["traceEvents"]):
        if not isinstance(ev, dict):
            out.append(f"event {i}: not an object")
            continue
        out += [f"event {i} ({ev.get('ph')}): {p}" for p in _event_problems(ev, open_b)]
    out += [f"B without E on {k}" for k, n in open_b.items() if n > 0]
    return out
