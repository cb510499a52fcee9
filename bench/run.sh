#!/usr/bin/env bash
# Run every benchmark (root, real kernel), write bench/results/*.md, then docs/performance.md.
# Needs the set-up of deploy/setup.sh and gcc + taskset.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v gcc >/dev/null || apt-get install -y -qq gcc >/dev/null
.venv/bin/python bench/bench_memory.py --rounds "${ROUNDS:-5}" --seconds "${SECONDS_PER_MODE:-20}" --out bench/results/memory.md
.venv/bin/python bench/bench_cuda.py --rounds "${ROUNDS:-5}" --out bench/results/cuda.md
.venv/bin/python bench/bench_live_cost.py --rounds "${ROUNDS:-5}" --out bench/results/live_cost.md
.venv/bin/python bench/bench_transfer.py --rounds "${ROUNDS:-5}" --out bench/results/transfer.md
.venv/bin/python bench/bench_kv_events.py --seconds "${KV_SECONDS:-10}" --groups 1,6 --out bench/results/kv_events.md
.venv/bin/python bench/bench_kv_memory.py --seconds "${KV_MEMORY_SECONDS:-60}" --out bench/results/kv_memory.md
.venv/bin/python bench/bench_kv_memory.py --offload --seconds "${KV_MEMORY_SECONDS:-600}" --samples 20 --out bench/results/kv_memory_offload.md
.venv/bin/python bench/bench_kv_memory.py --groups 6 --seconds "${KV_MEMORY_SECONDS:-60}" --out bench/results/kv_memory_groups.md
.venv/bin/python bench/bench_kv_message_rss.py --bytes 16777216,67108864 --hub --out bench/results/kv_message_rss.md
.venv/bin/python bench/bench_kv_retained_rss.py --label "this checkout" --out bench/results/kv_retained_rss.md
.venv/bin/python bench/bench_regret_memory.py --out bench/results/regret_memory.md
.venv/bin/python bench/bench_footprint.py --seconds "${FOOTPRINT_SECONDS:-300}" --out bench/results/footprint.md
.venv/bin/python bench/bench_daemon_load.py --seconds "${LOAD_SECONDS:-20}" --out bench/results/daemon_load.md
.venv/bin/python bench/bench_detection.py --out bench/results/detection.md
# bench/soak.py (30 minutes) is run by hand: sudo .venv/bin/python bench/soak.py --minutes 30
.venv/bin/python bench/report.py
