"""One module per engine (daemon/engines/kinds/): what kvwatch knows of an engine is declared
there, and the mechanisms (discovery, the command-line plan, the page, tiers, latencies, disk
tiers) read it from ``KINDS``. Nothing else in the product names an engine's metric, process
title, flag or environment key, so adding an engine is adding its module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvwatch.daemon import discovery
from kvwatch.daemon.engines import exposition, latency, tiers
from kvwatch.daemon.engines.kinds import BY_NAME, KINDS

REPO = Path(__file__).resolve().parents[2]
# What only an engine's module may spell: its metric names, process titles, flags, environment keys.
ENGINE_WORDS = re.compile(
    r"\b(vllm|sglang|lmcache):[a-z]|\blmcache_mp_[a-z]|\bkvbm_[a-z]|VLLM::|sglang::|--kv-events-config"
    r"|--enable-metrics|--hicache|--disaggregation-mode|kv_role|\b(LMCACHE|SGLANG|VLLM)_[A-Z]"
)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            out.add(id(first.value))
    return out


def test_only_an_engines_module_names_it() -> None:
    found = []
    for root in ("daemon", "exporters"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel.parts[:3] == ("daemon", "engines", "kinds") or rel.parts[:2] == ("daemon", "lab"):
                continue  # the engines' own modules; the lab's simulated engines speak their protocols
            tree = ast.parse(path.read_text())
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
                if id(node) not in docs and ENGINE_WORDS.search(text):
                    found.append(f"{rel}:{node.lineno}: {text[:60]!r}")
    assert not found, "engine knowledge outside daemon/engines/kinds/:\n" + "\n".join(found)


def test_every_engine_is_read_by_every_mechanism() -> None:
    """The mechanisms' tables are the engines' declarations, in KINDS' order, and no more."""
    assert len(BY_NAME) == len(KINDS)
    assert tuple(r for k in KINDS for r in k.rules) == discovery.DEFAULT_RULES
    assert {r.engine for r in discovery.DEFAULT_RULES} == set(BY_NAME)  # each rule names its own engine
    assert all(r.engine == k.name for k in KINDS for r in k.rules)
    assert tuple(r for k in KINDS for r in k.tiers) == tiers.RULES
    assert tuple(r for k in KINDS for r in k.latencies) == latency.RULES
    assert (
        *BY_NAME["vllm"].samples.prefix_queries,
        *BY_NAME["sglang"].samples.prefix_queries,
    ) == exposition.PREFIX_QUERIES
    for k in KINDS:
        for key in k.environ:
            assert key in discovery.ENV_KEYS
        for field in k.samples.__slots__:
            for name in getattr(k.samples, field):
                assert exposition.reads(name), (k.name, field, name)


def test_an_engines_processes_are_named_by_its_own_rules() -> None:
    """Command lines each engine's module is written for: found as that engine, that component."""
    lines = {
        "vllm": ("/venv/bin/python3 /venv/bin/vllm serve m --port 8000", "api_server"),
        "sglang": ("python3 -m sglang.launch_server --model m --enable-metrics", "server"),
        "lmcache": ("python -m lmcache.v1.server localhost 65432", ""),
        "dynamo": ("python3 -m dynamo.frontend --http-port 8000", ""),
        "tgi": ("text-generation-launcher --model-id m", "launcher"),
        "lmdeploy": ("lmdeploy serve api_server m", ""),
    }
    compiled = discovery.compile_rules(discovery.DEFAULT_RULES)
    for engine, (cmdline, component) in lines.items():
        rule = next(r for r in compiled if r.matches("python3", cmdline))
        assert rule.engine == engine, (cmdline, rule.engine)
        assert discovery.component_of("python3", cmdline) == component, cmdline
    assert (
        next(r for r in compiled if r.matches("tritonserver", "tritonserver --model-repository /m")).engine == "triton"
    )
    assert discovery.disagg_role('vllm serve m --kv-transfer-config {"kv_role":"kv_consumer"}') == "decode"
    assert discovery.disagg_role("python -m sglang.launch_server --disaggregation-mode prefill") == "prefill"
