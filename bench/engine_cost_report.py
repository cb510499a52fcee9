"""bench/bench_engine_cost.py's numbers: the summary over its pairs and the markdown it writes."""

from __future__ import annotations

import math
import platform
import time
from typing import Any

from pairstats import compare

# (key, what it is): vLLM's result keys, then the bench's own per-round figures
FIGURES = (
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tokens/s"),
    ("median_ttft_ms", "TTFT median, ms"),
    ("p99_ttft_ms", "TTFT p99, ms"),
    ("median_tpot_ms", "TPOT median, ms"),
    ("p99_tpot_ms", "TPOT p99, ms"),
    ("cpu_s_per_1000", "engine CPU s per 1,000 requests (all its processes)"),
    ("cpu_api_s_per_1000", "of that, the API server"),
    ("cpu_core_s_per_1000", "of that, the EngineCore process(es)"),
    ("core_cores_busy", "EngineCore CPU s per wall s (1.0: a core kept busy)"),
    ("core_side_s_per_1000", "of the EngineCore, its threads beside the engine loop, s per 1,000 requests"),
)


def figure(row: dict[str, Any], key: str) -> float:
    v = row["result"].get(key) if key in row["result"] else row.get(key)
    return float(v) if v is not None else math.nan


def pairs(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(on, off) of ``key`` for every pair with both rounds run."""
    by: dict[int, dict[bool, float]] = {}
    for r in rows:
        by.setdefault(r["pair"], {})[r["kvwatch"]] = figure(r, key)
    return [(m[True], m[False]) for _, m in sorted(by.items()) if len(m) == 2]


def _mean(v: list[float]) -> float:
    v = [x for x in v if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def _ratio(rows: list[dict[str, Any]], num: str, den: str) -> float:
    d = sum(r.get(den, math.nan) for r in rows if num in r)
    return sum(r[num] for r in rows if num in r) / d if d else math.nan


def side_threads(rows: list[dict[str, Any]]) -> None:
    """Each round's EngineCore CPU outside its engine loop (every thread but the busiest name),
    per 1,000 requests: where a KV event subscriber's cost lands (the publisher's I/O thread)."""
    for r in rows:
        th, done = r.get("core_threads_cpu_s"), float(r["result"].get("completed") or 0)
        if th and done:
            r["core_side_s_per_1000"] = 1000.0 * (sum(th.values()) - max(th.values())) / done


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    side_threads(rows)
    figures = {k: compare(p).as_dict() for k, _ in FIGURES if (p := pairs(rows, k))}
    on = [r for r in rows if r["kvwatch"]]
    off = [r for r in rows if not r["kvwatch"]]
    proofs = {
        "off_rounds": len(off),
        "off_proven_clean": sum(bool(r["toggle"].get("clean")) for r in off),
        "off_rounds_with_other_kvwatch": sum(bool(r["toggle"].get("kvw_programs_loaded")) for r in off),
        "on_rounds": len(on),
        "on_proven_tapped": sum(bool(r.get("tapped_before", {}).get("ok")) for r in on),
        "on_still_tapped_after": sum(bool(r.get("tapped_after", {}).get("ok")) for r in on),
        "on_rounds_with_probes_shed": sum(bool(r.get("tapped_after", {}).get("shed")) for r in on),
    }
    beside = {}  # per part of the engine: [measured on - off and its interval, kvwatch's meter]
    for part, key in (("all", ""), ("api", "api_"), ("core", "core_")):
        f = figures.get(f"cpu_{key}s_per_1000", {})
        meter = _mean([r.get(f"meter_{key}s_per_1000", math.nan) for r in on])
        beside[part] = {"measured": [f.get("diff_mean"), f.get("diff_low"), f.get("diff_high")], "meter": meter}
    return {
        "pairs": len(pairs(rows, "cpu_s_per_1000")),
        "figures": figures,
        "cpu_diff_vs_meter_s_per_1000": beside,
        "daemon_cpu_s_per_1000": _mean([r.get("daemon_cpu_s_per_1000", math.nan) for r in on]),
        "meter_share_of_core": _ratio(on, "meter_core_s_per_1000", "cpu_core_s_per_1000"),
        "proofs": proofs,
    }


def round_line(r: dict[str, Any]) -> str:
    res = r["result"]
    extra = f", meter {r['meter_s_per_1000']:.3f} s/1k" if "meter_s_per_1000" in r else ""
    return (
        f"[{time.strftime('%H:%M:%S')}] round {r['round']} pair {r['pair']} kvwatch {'on ' if r['kvwatch'] else 'off'}: "
        f"{res.get('completed')} done in {r['wall_s']} s, {float(res['request_throughput']):.1f} req/s, "
        f"TTFT p50 {float(res['median_ttft_ms']):.1f} ms, engine CPU {r['cpu_s_per_1000']:.3f} s/1k{extra}; "
        f"{r['toggle']['action']} ({'clean' if r['toggle'].get('clean') else 'tapped' if r['toggle'].get('ok') else 'NOT PROVEN'})"
    )


def _f(v: Any, digits: int = 3) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _figures_table(s: dict[str, Any]) -> list[str]:
    lines = [
        "| figure | off (mean) | on (mean) | on / off | 95 % interval | ± % | within ±2 % | median pair ratio |",
        "| --- | ---: | ---: | ---: | --- | ---: | :---: | ---: |",
    ]
    for key, what in FIGURES:
        f = s["figures"].get(key)
        if f:
            lines.append(
                f"| {what} | {_f(f['off_mean'])} | {_f(f['on_mean'])} | {_f(f['ratio'], 4)} | "
                f"{_f(f['low'], 4)} to {_f(f['high'], 4)} | {_f(f['half_width_pct'], 2)} | "
                f"{'yes' if f['narrower_than_2pct'] else 'no'} | {_f(f['median_pair_ratio'], 4)} |"
            )
    return lines


def _rounds_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| round | pair | kvwatch | proof before | after | requests | req/s | TTFT p50 ms | TPOT p50 ms | engine CPU s/1k "
        "| API s/1k | core s/1k | meter s/1k | daemon CPU s/1k |",
        "| ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t, res = r["toggle"], r["result"]
        proof = ("clean" if t.get("clean") else "NOT CLEAN") if not r["kvwatch"] else (
            "tapped" if r.get("tapped_before", {}).get("ok") else "NOT TAPPED")  # fmt: skip
        after = r.get("tapped_after", {})
        after_s = "" if not r["kvwatch"] else "tapped" if after.get("ok") else f"shed {after.get('shed', 0):.0f}"
        lines.append(
            f"| {r['round']} | {r['pair']} | {'on' if r['kvwatch'] else 'off'} | {t['action']}, {proof} | {after_s} | "
            f"{res.get('completed')} | {_f(res.get('request_throughput'), 1)} | {_f(res.get('median_ttft_ms'), 1)} | "
            f"{_f(res.get('median_tpot_ms'), 2)} | {_f(r['cpu_s_per_1000'])} | {_f(r['cpu_api_s_per_1000'])} | "
            f"{_f(r['cpu_core_s_per_1000'])} | {_f(r.get('meter_s_per_1000'))} | {_f(r.get('daemon_cpu_s_per_1000'))} |"
        )
    return lines


def _toggles(rows: list[dict[str, Any]]) -> list[str]:
    starts = [r["toggle"] for r in rows if r["toggle"]["action"] == "start"]
    stops = [r["toggle"] for r in rows if r["toggle"]["action"] == "stop"]
    if not starts:
        return []
    return [
        f"* kvwatch starts: /readyz after {min(t['ready_s'] for t in starts)}-{max(t['ready_s'] for t in starts)} s, "
        f"the engine tapped after {min(t['tapped_s'] for t in starts)}-{max(t['tapped_s'] for t in starts)} s; "
        f"CUDA probes per process at start: {starts[-1]['cuda_probes']}; BPF programs held: "
        f"{starts[-1]['programs_held']}.",
        f"* kvwatch stops: {sum(t['exited_on_sigterm'] for t in stops)} of {len(stops)} exited on SIGTERM, "
        f"stop + proof {min((t['stop_s'] for t in stops), default=0)}-{max((t['stop_s'] for t in stops), default=0)} s; "
        f"programs listed by {stops[-1]['programs_listed_by'] if stops else '—'}.",
    ]


HTTP_NOTE = [
    "",
    "The HTTP stand-in client does not stream: its TTFT is each request's whole latency, its TPOT that latency "
    "over the output tokens.",
]


def _others(p: dict[str, Any]) -> str:
    n = p.get("off_rounds_with_other_kvwatch", 0)
    if not n:
        return ""
    return (
        f"in {n} of them another kvwatch daemon (not this bench's) held kvw_* programs and may have probed the "
        'engine in "off" (tolerated with --tolerate-other-kvwatch); '
    )


def _bound(s: dict[str, Any]) -> list[str]:
    """What the EngineCore's busy share says about reading its CPU per request."""
    busy = s["figures"].get("core_cores_busy")
    share = s.get("meter_share_of_core", math.nan)
    if not busy:
        return []
    line = (
        f"* The EngineCore kept {_f(busy['off_mean'], 2)} cores busy off and {_f(busy['on_mean'], 2)} on; kvwatch's "
        f"meter is {_f(100 * share, 3)} % of its CPU in the on rounds."
    )
    if busy["off_mean"] >= 0.95:
        line += (
            " Its engine loop is one thread kept busy whatever the load, so its CPU per request is the inverse of "
            "its throughput: a probe's cost in it shows as throughput, and both ratios carry the machine's noise."
        )
    return [line]


def _threads(rows: list[dict[str, Any]], top: int = 8) -> list[str]:
    """The EngineCore's threads by name, each one's CPU per wall second in the off and on rounds."""
    busy: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for r in rows:
        for name, cpu in r.get("core_threads_cpu_s", {}).items():
            busy[r["kvwatch"]].setdefault(name, []).append(cpu / r["wall_s"] if r["wall_s"] else math.nan)
    names = set(busy[False]) | set(busy[True])
    if not names:
        return []
    mean = {(on, n): _mean(busy[on].get(n, [])) for on in (False, True) for n in names}
    order = sorted(names, key=lambda n: -max(_nz(mean[False, n]), _nz(mean[True, n])))[:top]
    return [
        "",
        "The EngineCore's threads by name (threads of one name summed), CPU s per wall s, mean over rounds:",
        "",
        "| thread | off | on | on - off |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {n} | {_f(mean[False, n], 4)} | {_f(mean[True, n], 4)} | {_f(mean[True, n] - mean[False, n], 4)} |"
            for n in order
        ),
        "",
    ]


def _attribution(result: dict[str, Any], top: int = 12) -> list[str]:
    """The round with BPF statistics on: kvwatch's programs by their kernel-side time."""
    r = result.get("attribution")
    if not r or not r.get("bpf_programs"):
        return []
    done = float(r.get("result", {}).get("completed") or 0)
    progs = r["bpf_programs"]
    total = sum(v["run_ns"] for v in progs.values()) / 1e9
    core = r.get("cpu_core_s_per_1000", math.nan)
    order = sorted(progs, key=lambda n: -progs[n]["run_ns"])[:top]

    def row(n: str) -> str:
        v = progs[n]
        per = v["run_ns"] / v["runs"] if v["runs"] else math.nan
        return f"| {n} | {_f(v['runs'] / done if done else math.nan, 2)} | {_f(per, 0)} | {per_k(v['run_ns'] / 1e9, done)} |"

    return [
        "",
        f"Where kvwatch's kernel-side time went: one more on round after the pairs (in no ratio), {int(done)} "
        "requests with the kernel's BPF statistics on; every program's runs and run time over the load, in "
        "whichever process it ran (a uprobe's traps are not in them; the meter has those). Total "
        f"{per_k(total, done)} CPU s per 1,000 requests, against the EngineCore's {_f(core)} in that round; the "
        f"meter {_f(r.get('meter_core_s_per_1000', math.nan))} in the EngineCore.",
        "",
        "| program | runs per request | ns per run | CPU s per 1,000 requests |",
        "| --- | ---: | ---: | ---: |",
        *(row(n) for n in order),
        "",
    ]


def _by_parts(result: dict[str, Any]) -> list[str]:
    """kvwatch's cost to the EngineCore summed from the parts measured apart, each resolved far
    below the rounds' noise: the uprobes' traps (the meter), the programs' run time (the BPF
    statistics round; every process's, so an upper bound), and the CPU of the EngineCore's threads
    beside its engine loop, on minus off (the KV event subscription), with its interval."""
    s, r = result["summary"], result.get("attribution") or {}
    side, core = s["figures"].get("core_side_s_per_1000"), s["figures"].get("cpu_core_s_per_1000")
    done = float(r.get("result", {}).get("completed") or 0)
    if not side or not core or not done or not r.get("bpf_programs"):
        return []
    meter = s["cpu_diff_vs_meter_s_per_1000"]["core"]["meter"]
    progs = 1000.0 * sum(v["run_ns"] for v in r["bpf_programs"].values()) / 1e9 / done
    total, high = meter + progs + side["diff_mean"], meter + progs + side["diff_high"]
    base = core["off_mean"]
    return [
        "",
        "kvwatch's cost to the EngineCore by its parts, CPU s per 1,000 requests: the uprobes' traps (the meter) "
        f"{_f(meter, 4)} + the BPF programs' run time (the statistics round, every process's) {_f(progs, 4)} + its "
        f"threads beside the engine loop, on - off (the KV event publisher's I/O) {_f(side['diff_mean'], 4)} "
        f"({_f(side['diff_low'], 4)} to {_f(side['diff_high'], 4)}) = **{_f(total, 4)}**, "
        f"**{_f(100 * total / base, 2)} %** of its {_f(base)} with kvwatch off ({_f(100 * high / base, 2)} % at the "
        "interval's top).",
        "",
    ]


def per_k(seconds: float, done: float) -> str:
    return _f(1000.0 * seconds / done, 4) if done else "n/a"


def _nz(v: float) -> float:
    return 0.0 if math.isnan(v) else v


def _sized(a: dict[str, Any]) -> str:
    fixed = a.get("num_prompts") not in (None, "0", 0)
    return "fixed by --num-prompts" if fixed else f"calibrated to {a.get('round_seconds')} s"


def _overhead(result: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Where a pair's time went besides the client's runs: toggles with their proofs, the settle,
    the meter's wait after on rounds."""
    timed = [r for r in rows if "elapsed_s" in r]
    pairs = len({r["pair"] for r in timed})
    if not pairs:
        return []
    per_pair = sum(r["elapsed_s"] for r in timed) / pairs
    client = sum(r["wall_s"] for r in timed) / pairs
    return [
        f"* Time per pair: {per_pair:.1f} s, of which the client's two runs {client:.1f} s and the rest "
        f"{per_pair - client:.1f} s (toggles and their proofs, settle, the meter's wait); every round's requests "
        f"sampled before the rounds in {result.get('presample_s', 0.0)} s."
    ]


def render(result: dict[str, Any]) -> str:
    s, rows, a = result["summary"], result.get("rounds", []), result.get("args", {})
    cal = result.get("calibration", {})
    p = s["proofs"]
    b = s["cpu_diff_vs_meter_s_per_1000"]
    lines = [
        f"# kvwatch's cost to a running engine — {time.strftime('%Y-%m-%d %H:%M')} — kernel {platform.release()}",
        f"engine {a.get('engine')}, client {a.get('client')}, dataset {a.get('dataset')}, concurrency "
        f"{a.get('concurrency')}, {cal.get('num_prompts')} prompts a round ({_sized(a)}), "
        f"settle {a.get('settle')} s after every proven toggle; {s['pairs']} ABBA pairs; ratios of means over the "
        "pairs with a percentile bootstrap 95 % interval (10,000 resamples of whole pairs)",
        "",
        *_figures_table(s),
        *(HTTP_NOTE if a.get("client") == "http" else []),
        "",
        "Engine CPU with kvwatch minus without, per 1,000 requests (mean over pairs, 95 % interval), beside "
        "kvwatch's own meter over the same on rounds (`kvwatch_uprobe_cost_seconds_total` of those processes):",
        "",
        "| processes | measured on - off, s | 95 % interval | kvwatch's meter, s |",
        "| --- | ---: | --- | ---: |",
        *(
            f"| {what} | {_f(b[k]['measured'][0])} | {_f(b[k]['measured'][1])} to {_f(b[k]['measured'][2])} | "
            f"{_f(b[k]['meter'])} |"
            for k, what in (("all", "the engine (all)"), ("api", "API server"), ("core", "EngineCore"))
            if k in b
        ),
        "",
        "* The meter counts the uprobes alone; the measured difference also holds what kvwatch's /metrics "
        "scrapes and its KV event subscription cost the engine.",
        f"* kvwatch's daemon itself used {_f(s['daemon_cpu_s_per_1000'])} CPU s per 1,000 requests (not in the "
        "engine's figures).",
        *_bound(s),
        *_threads(rows),
        *_attribution(result),
        *_by_parts(result),
        f"* Proofs: {p['off_proven_clean']} of {p['off_rounds']} off rounds began with kvwatch proven gone (daemon "
        "reaped, none of its BPF programs loaded, no uprobe of it in tracefs, no unheld kvw_* program); "
        f"{_others(p)}{p['on_proven_tapped']} of {p['on_rounds']} on rounds began with the engine's processes watched, CUDA "
        f"probes attached in the EngineCore and the KV event stream connected, nothing shed; "
        f"{p['on_still_tapped_after']} still so after the round ({p['on_rounds_with_probes_shed']} had probes shed "
        "by kvwatch's cost budget by its end).",
        *_toggles(rows),
        *_overhead(result, rows),
        *(f"* Note: {n}" for n in result.get("notes", [])),
        "",
        "Per round:",
        "",
        *_rounds_table(rows),
    ]
    return "\n".join(lines) + "\n"
