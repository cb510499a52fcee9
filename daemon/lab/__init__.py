"""What only the demo, the tests, the benchmarks and the doctor canaries use: simulated engines,
workloads, stub libraries, network and cgroup labs. `kvwatch run` imports nothing from here."""
