"""kvwatch: a node agent that watches LLM inference servers' KV cache from the outside with eBPF.

The code lives at the repository's top level (daemon/, probes/, exporters/); src/kvwatch links to
it so that ``kvwatch.daemon.x`` is ``daemon/x.py`` with ``src`` on the path, installed or not."""
