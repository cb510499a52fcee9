#!/usr/bin/env bash
# On the lent GPU machine (device tool), from the repo root:
#   carry: [".gpu-bundle", ".whl"];  command: bash tests/gpu/run_on_device.sh
# Installs the wheels kvwatch needs beside the machine's own packages, makes the
# source tree importable as `kvwatch`, and runs the GPU validations under bcc.
set -uo pipefail
out=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/kvpkg/kvwatch
for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
uname -r >> "$out/gpu.txt"
.gpu-bundle/with-bcc python3 -c 'import bcc, kvwatch.probes.cuda; print("bcc", bcc.__version__)' || exit 1
.gpu-bundle/with-bcc python3 tests/gpu/bench_calls.py "$out" 2>&1 | tail -40
.gpu-bundle/with-bcc python3 tests/gpu/validate_cuda.py --out "$out" "$@" 2>&1 | tail -30
