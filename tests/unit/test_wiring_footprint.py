"""What ``kvwatch run`` imports before it watches anything: its idle RSS is mostly the libraries
it loads (docs/performance.md, bench/bench_footprint.py). numpy (~15 MiB with its BLAS library)
comes only with a KV hash memory's first seal; the subcommands' own modules (top's terminal app,
record, the doctor, the lab) only with their command.

Each check runs in a fresh interpreter, since this one has imported whatever other tests needed.
bcc is kept out there (``sys.modules["bcc"] = None``, which ``probes/bpf.py`` takes as bcc
missing): the test needs no bcc and loads no compiler.
"""

from __future__ import annotations

import json
import subprocess
import sys

# imported by no module that `kvwatch run` loads at start
NOT_AT_START = (
    "numpy",
    "textual",
    "kvwatch.daemon.engines.hashmem_sealed",
    "kvwatch.daemon.lab",
    "kvwatch.daemon.doctor",
    "kvwatch.exporters.top_app",
    "kvwatch.exporters.record",
    "kvwatch.exporters.alertmanager",
)

PROBE = """
import json, sys
sys.modules["bcc"] = None
import kvwatch.daemon.cli, kvwatch.daemon.wiring
from kvwatch.daemon.engines.hashmem import HashMemory

def loaded():
    names = json.loads(sys.argv[1])
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in sys.modules))

mem = HashMemory(1024)  # an open dict of 64 entries
mem.put_keys(range(63), 1.0)
assert mem.take_keys([1, 2])[1] == [1.0, 1.0] and mem.count([3, 99]) == 1
at_start = loaded()
mem.put_keys(range(100, 200), 2.0)  # past the open dict: sealed
assert len(mem) == 161 and mem.take_keys([150])[1] == [2.0]
print(json.dumps([at_start, loaded()]))
"""


def test_kvwatch_run_imports_no_numpy_until_a_hash_memory_seals() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(NOT_AT_START)], capture_output=True, text=True, check=True
    )
    at_start, after_seal = json.loads(out.stdout.strip().splitlines()[-1])
    assert at_start == []
    assert after_seal == ["kvwatch.daemon.engines.hashmem_sealed", "numpy"]
