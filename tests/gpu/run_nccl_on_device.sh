#!/usr/bin/env bash
# On the lent nvidia-h200-x2 machine (device tool), from the repo root:
#   kind: nvidia-h200-x2; carry: [".gpu-bundle", ".whl"]; command: bash tests/gpu/run_nccl_on_device.sh
# Two ranks exchange KV-sized tensors over NCCL (torch.distributed send/recv); kvwatch's
# transfer probes count them per process; the cost is measured attached vs detached.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/kvpkg/kvwatch
for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r; nvidia-smi topo -m; } > "$out/gpu.txt" 2>&1
head -3 "$out/gpu.txt"
timeout "${NCCL_TIMEOUT:-240}" .gpu-bundle/with-bcc python3 tests/gpu/validate_nccl.py --out "$out" --rounds 9 2>&1 | tee "$out/validate_nccl.log" | tail -40
