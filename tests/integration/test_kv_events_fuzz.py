"""Property-based, through the hub's own message path (frames, sequence numbers, decoding,
counting): every good message counts and every bad one is counted by reason, none stops the next.
The messages are handed to the hub's per-message step (``KVEventHub._take``) one after another,
as its drain would; its sockets are open but never reached. The decoder alone:
``tests/unit/test_wire_fuzz.py``."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.model.engines import StreamSpec
from tests.support.kv_fuzz import streams

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def messages(draw: st.DrawFn) -> tuple[list[list[bytes]], Counter[str], int]:
    """Good messages numbered in order, bad ones between them: (frames, reasons, good count)."""
    out: list[list[bytes]] = []
    reasons: Counter[str] = Counter()
    good = 0
    for seq, s in enumerate(draw(streams())):
        bad = draw(st.sampled_from([None, None, "frames", "sequence"]))
        if bad == "frames":
            out.append(draw(st.lists(st.binary(max_size=10), max_size=5).filter(lambda f: len(f) != 3)))
            reasons["frames"] += 1
        elif bad == "sequence":
            out.append([b"", bytes(draw(st.sampled_from([0, 1, 7, 9]))), s.payload])
            reasons["sequence"] += 1
        out.append([b"", seq.to_bytes(8, "big"), s.payload])  # a bad payload still takes its number
        if s.kind is None:
            good += 1
        else:
            reasons[s.kind] += 1
    return out, reasons, good


@FUZZ
@given(messages())
def test_fuzz_the_hub_counts_every_good_message_and_every_bad_one_by_reason(
    case: tuple[list[list[bytes]], Counter[str], int],
) -> None:
    frames, reasons, good = case
    hub = KVEventHub(thrash_seconds=5.0)
    spec = StreamSpec("tcp://127.0.0.1:9")  # never reached: the test hands the hub its messages
    try:
        hub.set_streams([spec])
        hub.run_once(0)
        st_ = hub._streams[spec]
        for f in frames:
            hub._take(st_, [memoryview(x) for x in f], 0.0)
        s = hub.stats()[spec]
    finally:
        hub.close()
    assert dict(s.decode_errors) == reasons
    assert s.batches == good
    assert (s.gaps, s.lost, s.restarts) == (0, 0, 0)
