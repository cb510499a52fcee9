"""bench/report.py: the headline row of the engine-cost run, read from its markdown."""

from __future__ import annotations

from tests.support.bench import bench_module

report = bench_module("report")

RUN = """\
| figure | off (mean) | on (mean) | on / off | 95 % interval | ± % | within ±2 % | median pair ratio |
| --- | ---: | ---: | ---: | --- | ---: | :---: | ---: |
| requests/s | 46.699 | 45.691 | 0.9784 | 0.9198 to 1.0479 | 7.10 | no | 0.9699 |
| engine CPU s per 1,000 requests (all its processes) | 28.135 | 28.494 | 1.0128 | 0.9541 to 1.0688 | 5.79 | no | 1.0405 |
| EngineCore CPU s per wall s (1.0: a core kept busy) | 1.008 | 1.018 | 1.0101 | 1.0005 to 1.0266 | 1.63 | yes | 1.0025 |

* The EngineCore kept 1.01 cores busy off and 1.02 on; kvwatch's meter is 0.054 % of its CPU in the on rounds.

kvwatch's cost to the EngineCore by its parts, CPU s per 1,000 requests: ... = **0.1089**, **0.44 %** of its 24.740 \
with kvwatch off (0.69 % at the interval's top).
"""


def test_engine_cost_headline_gives_each_ratio_with_its_interval() -> None:
    got = report.engine_cost(RUN)
    assert "requests/s x 0.9784 (0.9198 to 1.0479)" in got
    assert "engine CPU per request x 1.0128 (0.9541 to 1.0688)" in got
    assert "EngineCore CPU per second x 1.0101 (1.0005 to 1.0266)" in got
    assert "CPU-bound (1.01 cores busy) and kvwatch's meter is 0.054 % of its CPU" in got
    assert "by its parts (traps, programs, the KV event publisher's thread) 0.44 % of it (0.69 % at most)" in got


def test_engine_cost_not_run() -> None:
    assert report.engine_cost("") == "not measured (device time)"
