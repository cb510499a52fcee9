"""The data that crosses the daemon's layers (docs/architecture.md, the tree): frozen records and
the per-subject windows, no behaviour beyond arithmetic on themselves.

``findings`` (Subject, Finding), ``windows`` (what detectors evaluate), ``history`` (a subject's
typed observations over time; ``series``, one counter's), one module per source's observations
(``memory``, ``cuda``, ``uprobes``, ``transfers``, ``kv_counts``, ``engine_scrape``), ``engines``
(what the engine taps hand the loop), ``snapshot`` (what exporters read). Built by families/ and
engines/, read by detectors/ and exporters/; imports only itself and the probes' records
(tests/unit/test_architecture.py)."""
