"""The scenarios ``kvwatch demo --scenario`` takes: named here, apart from the lab that runs them,
so that the command line knows them without loading it."""

# in the order the demo runs them (lab/demo.py)
DEMO_SCENARIOS = (
    "host-tier",
    "reuse-collapse",
    "transfer-collapse",
    "eviction-burst",
    "prefix-cache",
    "preemption-livelock",
    "oom",
)
