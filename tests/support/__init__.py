"""What the test tiers share: the daemon as a subprocess and the waits on what it publishes
(``daemon``), kernel ground truths and workload children (``kernel``), the simulated engine's
scenarios (``engine_sim``), KV event scripts counted offline (``kv_scripts``), the real vLLM run
replayed (``vllm_replay``), snapshots built by hand (``snapshots``), a fake /proc (``procfs``),
an HTTP endpoint that records (``http``) and the trace checker (``trace_format``).

A test module imports from here, never from another test module."""
