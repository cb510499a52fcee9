"""Engine taps: which KV event streams and /metrics endpoints belong to which engine, and reading them."""
