"""Property-based fuzz of the whole scrape (``engines/metrics.py``: the deadline-bound GET, then
the page read) against a real HTTP server on loopback. Hypothesis writes one engine's page, or
its whole raw answer (status line, headers, body); a good engine beside it is scraped in the same
round. It holds that the bad engine never stops the good one from counting, that the bad one's
scrape either counts (its rejected samples counted by reason) or fails with one counted reason
(never an unnamed one), and that no failure quotes what the engine sent."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines.exposition import REJECT_REASONS, parse_exposition
from kvwatch.daemon.engines.metrics import EngineScraper
from kvwatch.daemon.model.engines import ScrapeTarget, TargetState
from tests.support.engine_pages import Routes, page_server
from tests.support.kv_scripts import FIXTURES

PAGES = FIXTURES / "engine_metrics"
GOOD = (PAGES / "vllm-0.33.0.txt").read_bytes()
REAL = [p.read_bytes() for p in sorted(PAGES.glob("*.txt"))]
MARKER = b"kvwatch-fuzz-marker-41c9"
FAILED = re.compile(r"^(http_[1-5][0-9]{2}|http_other|deadline|connect|redirect|protocol|too_large|parse)$")
HOSTILE = [b"+Inf", b"-Inf", b"NaN", b"-1", b"1e400", b"9" * 400, b"1e19", MARKER]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Routes]]:
    with page_server() as served:
        yield served


def mutate(page: bytes, data: st.DataObject) -> bytes:
    """A real page with some values made hostile, a line of garbage, bytes cut or spliced in."""
    lines = page.split(b"\n")
    for _ in range(data.draw(st.integers(0, 6))):
        i = data.draw(st.integers(0, len(lines) - 1))
        if lines[i] and not lines[i].startswith(b"#"):
            lines[i] = lines[i].rpartition(b" ")[0] + b" " + data.draw(st.sampled_from(HOSTILE))
    if data.draw(st.booleans()):
        lines.insert(data.draw(st.integers(0, len(lines))), MARKER + data.draw(st.binary(max_size=40)))
    out = b"\n".join(lines)
    if not data.draw(st.booleans()):
        return out
    cut = data.draw(st.integers(0, len(out)))
    return out[:cut] + data.draw(st.binary(max_size=30)) + out[cut:]


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """A whole raw HTTP answer: any status, headers that may lie, a body that may be cut."""
    status = draw(st.sampled_from([200, 204, 301, 302, 307, 404, 500]) | st.integers(0, 1200))
    body = draw(st.sampled_from(REAL) | st.binary(max_size=200))
    headers = [b"Content-Type: text/plain"]
    length = draw(st.sampled_from(["exact", "short", "long", "none", "chunked-garbage"]))
    if length in ("exact", "short", "long"):
        headers.append(b"Content-Length: %d" % (len(body) + {"exact": 0, "short": -1, "long": 50}[length]))
    elif length == "chunked-garbage":
        headers.append(b"Transfer-Encoding: chunked")
        body = draw(st.sampled_from([b"zz\r\n" + MARKER, b"5\r\nab", b"0\r\n\r\n", b"ffffffffff\r\n"]))
    headers += draw(st.lists(st.binary(max_size=30).map(lambda b: b.replace(b"\r\n", b"")), max_size=3))
    reason = draw(st.sampled_from([b"OK", MARKER]))
    head = b"HTTP/1.1 %d %s\r\n" % (status, reason) + b"\r\n".join(headers) + b"\r\n\r\n"
    return draw(st.sampled_from([head + body, head[: draw(st.integers(0, len(head)))], MARKER + b"\r\n\r\n"]))


def round_of(base: str, routes: Routes) -> tuple[TargetState, TargetState]:
    """One round: the good engine and the fuzzed one, scraped together."""
    good, bad = ScrapeTarget(base + "/good", "1@1"), ScrapeTarget(base + "/bad", "2@2")
    s = EngineScraper(timeout=5.0)
    s.set_targets([good, bad])
    s.scrape_once()
    st = s.states()
    s.close()
    return st[good], st[bad]


def assert_round(good: TargetState, bad: TargetState) -> None:
    want = parse_exposition(GOOD.decode(), at=0.0)
    assert good.ok == 1 and good.failures == {} and good.last is not None
    assert good.last.usage == want.usage and good.last.prefix_queries == want.prefix_queries
    assert bad.ok + sum(bad.failures.values()) == 1
    event(f"result {next(iter(bad.failures), 'ok')}")
    if bad.ok:
        assert bad.last is not None and dict(bad.rejected) == dict(bad.last.rejected)
        event(f"rejected {sum(bad.rejected.values()) > 0}")
        assert set(bad.rejected) <= set(REJECT_REASONS)
    else:
        (reason,) = bad.failures
        assert FAILED.match(reason), (reason, bad.last_error)
        assert MARKER.decode() not in bad.last_error


@SETTINGS
@given(st.sampled_from(REAL), st.data())
def test_a_bad_page_never_stops_a_good_one_and_is_counted(
    server: tuple[str, Routes], page: bytes, data: st.DataObject
) -> None:
    base, routes = server
    routes["/good"] = (200, GOOD, 0.0)
    routes["/bad"] = (200, mutate(page, data), 0.0)
    assert_round(*round_of(base, routes))


@SETTINGS
@given(answers())
def test_a_bad_answer_never_stops_a_good_one_and_is_counted(server: tuple[str, Routes], raw: bytes) -> None:
    base, routes = server
    routes["/good"] = (200, GOOD, 0.0)
    routes.raw["/bad"] = raw
    assert_round(*round_of(base, routes))
