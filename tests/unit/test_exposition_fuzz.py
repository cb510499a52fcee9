"""Property-based fuzz of the /metrics page reader (``engines/exposition.py``): any text, real
engine pages with hostile values, garbage lines, very long lines and deep label sets.

It holds that a page either counts or fails as a ``PageError`` naming a line and a kind (never
its text, never another exception); that every number a counted page yields is finite, >= 0 and
at most 2^63 (a ratio at most 1); that every hostile value kvwatch reads is dropped alone and
counted by its reason; and that the numbers it did not touch are what the clean page says.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines import exposition as ex
from kvwatch.daemon.model.engines import EngineSample

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engine_metrics"
PAGES = {p.name: p.read_text() for p in sorted(FIXTURES.glob("*.txt"))}
KINDS = {kind for _, kind in ex._PARSE_KINDS} | {"syntax"}
FIELDS = {  # EngineSample field -> the sample names it is read from
    "usage": ex.USAGE,
    "prefix_queries": ex.PREFIX_QUERIES,
    "prefix_hits": ex.PREFIX_HITS,
    "preemptions": ex.PREEMPTIONS,
    "running": ex.RUNNING,
    "waiting": ex.WAITING,
    "evicted_tokens": ex.EVICTED_TOKENS,
    "generation_tokens": ex.GENERATION_TOKENS,
    "lmcache_evicted_keys": ex.LMCACHE_EVICTED_KEYS,
    "lmcache_hit_tokens": ex.LMCACHE_HIT_TOKENS,
    "lmcache_requested_tokens": ex.LMCACHE_REQUESTED_TOKENS,
}
# a hostile value, and the reason it is rejected for in any sample kvwatch reads
HOSTILE = {
    "+Inf": "infinite",
    "-Inf": "infinite",
    "NaN": "nan",
    "1e400": "infinite",  # the parser makes it inf
    "-1": "negative",
    "-0.5": "negative",
    "1e19": "too_large",
    "1" + "0" * 30: "too_large",
    "9" * 400: "too_large",  # an int too large for a float
}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAGE_CHARS = st.sampled_from(list('abcvlm:_{}="\\, \n\t#+-.0123456789eEIfnNaTYPEHELPgaugecounter\u00b2\ufffd'))


def assert_sane(s: EngineSample) -> None:
    numbers = [v for f in dataclasses.fields(s) if isinstance(v := getattr(s, f.name), float | int)]
    numbers += [r.value for r in s.tiers] + [x for r in s.latencies for x in (r.sum_seconds, r.count)]
    assert all(math.isfinite(v) and 0 <= v <= ex.MAX_VALUE for v in numbers)
    assert s.usage is None or s.usage <= 1
    assert all(r.value <= 1 for r in s.tiers if r.unit == "ratio")
    assert set(s.rejected) <= set(ex.REJECT_REASONS) and all(n > 0 for n in s.rejected.values())


def read(text: str) -> EngineSample | ex.PageError:
    try:
        return ex.parse_exposition(text, at=0.0)
    except ex.PageError as err:
        assert err.kind in KINDS and str(err) == f"line {err.line}: {err.kind}"
        assert 1 <= err.line <= text.count("\n") + 1
        return err


@FUZZ
@given(st.text(PAGE_CHARS, max_size=400) | st.text(max_size=200))
def test_any_text_counts_or_fails_as_a_page_error(text: str) -> None:
    got = read(text)
    if isinstance(got, EngineSample):
        assert_sane(got)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(sorted(PAGES)), st.integers(0, 10**6))
def test_bytes_decoded_as_the_scraper_decodes_them(raw: bytes, name: str, where: int) -> None:
    """Bad UTF-8 (decoded with errors=replace, as fetch does) spliced into a real page."""
    page = PAGES[name]
    at = where % (len(page) + 1)
    got = read(page[:at] + raw.decode("utf-8", errors="replace") + page[at:])
    if isinstance(got, EngineSample):
        assert_sane(got)


def read_lines(page: str) -> list[int]:
    """The lines of a page that hold a sample kvwatch reads (by name)."""
    out = []
    for i, line in enumerate(page.split("\n")):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line and not line.startswith("#") and ex.reads(name):
            out.append(i)
    return out


@FUZZ
@given(st.sampled_from(sorted(PAGES)), st.data())
def test_hostile_values_are_counted_by_reason_and_stop_nothing_else(name: str, data: st.DataObject) -> None:
    page = PAGES[name]
    lines = page.split("\n")
    candidates = read_lines(page)
    picked = data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=8)) if candidates else []
    want: dict[str, int] = {}
    touched: set[str] = set()
    for i in picked:
        value = data.draw(st.sampled_from(sorted(HOSTILE)))
        head, _, _ = lines[i].rpartition(" ")
        lines[i] = f"{head} {value}"
        want[HOSTILE[value]] = want.get(HOSTILE[value], 0) + 1
        touched.add(head.split("{", 1)[0])
    clean, dirty = ex.parse_exposition(page, at=0.0), ex.parse_exposition("\n".join(lines), at=0.0)
    assert_sane(dirty)
    got = dict(dirty.rejected)
    above_one = got.pop("above_one", 0) - want.pop("above_one", 0)
    assert got == want and above_one >= 0  # a ratio of two counts may lose its denominator's peers
    for field, names in FIELDS.items():
        if not touched & set(names):
            assert getattr(dirty, field) == getattr(clean, field), field


@FUZZ
@given(st.sampled_from(sorted(PAGES)), st.integers(0, 10**6), st.sampled_from(["{", '{a="', "x{a=b} 1", "x 1 2x"]))
def test_a_garbage_line_fails_the_page_at_its_line_never_quoting_it(name: str, where: int, garbage: str) -> None:
    lines = PAGES[name].split("\n")
    at = where % (len(lines) + 1)
    marker = "kvwatch_fuzz_marker_7d1f"
    lines.insert(at, f"{marker}{garbage}")
    got = read("\n".join(lines))
    assert isinstance(got, ex.PageError) and got.line == at + 1
    assert marker not in str(got) and got.__cause__ is None


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 200_000), st.integers(0, 10**9))
def test_very_long_lines_and_deep_label_sets_still_count(labels: int, width: int, value: int) -> None:
    pairs = ",".join(f'l{i}="v"' for i in range(labels - 1))
    line = f'vllm:num_requests_running{{{pairs}{"," if pairs else ""}long="{"x" * width}"}} {value}'
    s = ex.parse_exposition(f"# TYPE vllm:num_requests_running gauge\n{line}\n", at=0.0)
    assert s.running == value and s.rejected == {}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_real_page_is_sane(name: str) -> None:
    assert_sane(ex.parse_exposition(PAGES[name], at=0.0))
