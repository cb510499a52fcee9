#!/usr/bin/env bash
# LMCache on the lent H200 (device tool), from the repo root, on the machine that has just unpacked the
# vLLM bundle into /tmp/vsite (tests/gpu/run_vllm_on_device.sh part/unpack, back to back).
# tests/gpu/make_lmcache_bundle.sh builds .lmcache-bundle/ and prints the calls:
#   part NN   only when the bundle was split: copy .lmcache-bundle/parts/lmcache.partNN to /tmp/lb/
#   install   LMCache + aiofile + caio into /tmp/vsite (pip --no-index --no-deps --target), the config to
#             /tmp/lmcache-local.yaml; then check that the compiled ops load (dlopen RTLD_NOW after torch),
#             that LMCache bound them, and that vLLM's connector module imports
#   smoke     serve the tiny model with LMCacheConnectorV1 (CPU pool + disk tier under /tmp/lmcache-disk),
#             store 16 prompts, reset vLLM's GPU prefix cache, send them again; keep vLLM's log, the
#             lmcache:* lines of /metrics and the disk tier's listing in $OUT
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?part NN | install | smoke | start | squeeze}
export LMCACHE_TRACK_USAGE=false  # no network there: LMCache's usage reporting would only time out

case "$step" in
    part)
        mkdir -p /tmp/lb && cp ".lmcache-bundle/parts/lmcache.part$2" /tmp/lb/ && ls -la /tmp/lb
        ;;
    install)
        [ -d /tmp/vsite/vllm ] || { echo "no /tmp/vsite/vllm: unpack the vLLM bundle first, on this warm machine"; exit 1; }
        src=.lmcache-bundle/carry
        if [ ! -d "$src" ]; then
            src=/tmp/lmcache-carry
            mkdir -p "$src" && cat /tmp/lb/lmcache.part* | tar -xf - -C "$src" || exit 1
        fi
        (cd "$src" && sha256sum -c --quiet SHA256SUMS) || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite "$src"/*.whl || exit 1
        cp "$src/lmcache-local.yaml" /tmp/lmcache-local.yaml
        PYTHONPATH=/tmp/vsite python3 - "$(cat "$src/EXT")" <<'EOF' 2>&1 | tee "$out/lmcache_install.txt"
import ctypes, glob, os, sys, time
t0 = time.time()
import torch
ext = sys.argv[1]
so = glob.glob(f"/tmp/vsite/lmcache/{ext}.cpython-312-*.so")[0]
try:  # the ABI test: every symbol resolved now, against the torch/CUDA libraries torch has loaded
    ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    print(f"dlopen {os.path.basename(so)}: ok")
except OSError as e:
    print(f"dlopen {os.path.basename(so)}: FAILED: {e}")
import aiofile, numba
import lmcache
from lmcache.v1.platform import resolve_device_ops, torch_device_type
ops = resolve_device_ops(torch_device_type)
native = sum(type(v).__name__ == "builtin_function_or_method" for v in vars(ops).values())
print(f"lmcache {lmcache.__version__} on {torch_device_type}: {native} ops bound from {ext}"
      f"{'' if native else ' (NONE: pure-torch fallback)'}")
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl  # what vLLM 0.26.0 imports
print(f"torch {torch.__version__} cuda {torch.version.cuda}, numba {numba.__version__},"
      f" {LMCacheConnectorV1Impl.__name__} imported in {time.time() - t0:.0f} s")
sys.exit(0 if native else 1)
EOF
        ;;
    smoke)
        [ -f /tmp/lmcache-local.yaml ] && [ -d /tmp/tiny ] || { echo "run install (and the vLLM unpack) first"; exit 1; }
        export PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
            VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 PYTHONUNBUFFERED=1 \
            LMCACHE_CONFIG_FILE=/tmp/lmcache-local.yaml LMCACHE_MAX_LOCAL_CPU_SIZE=${LMCACHE_MAX_LOCAL_CPU_SIZE:-0.125} \
            PROMETHEUS_MULTIPROC_DIR=/tmp/prom-mp
        # a CPU pool (128 MiB by default here) smaller than what 16 prompts store (tiny model: 32 KiB/token,
        # 8 MiB/chunk, 16 x 4 chunks) so that the second round reads part of it back from the disk tier
        rm -rf /tmp/prom-mp /tmp/lmcache-disk && mkdir -p /tmp/prom-mp /tmp/lmcache-disk
        python3 -m vllm.entrypoints.cli.main serve /tmp/tiny --load-format dummy --served-model-name tiny \
            --enable-prefix-caching --block-size 16 --num-gpu-blocks-override 2048 --max-model-len 2048 \
            --max-num-seqs 32 --gpu-memory-utilization 0.3 --enforce-eager --seed 0 \
            --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' \
            --host 127.0.0.1 --port 8000 >"$out/lmcache_vllm.log" 2>&1 &
        vpid=$!
        python3 - <<'EOF' 2>&1 | tee "$out/lmcache_smoke.txt"
import json, os, time, urllib.request
base = "http://127.0.0.1:8000"
def call(path, body=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()
t0 = time.time()
while True:
    try:
        call("/health"); break
    except Exception:
        if time.time() - t0 > 300: raise SystemExit("vLLM did not answer /health in 300 s")
        time.sleep(3)
print(f"/health after {time.time() - t0:.0f} s")
prompts = [[1000 + 37 * i + j for j in range(1024)] for i in range(16)]
keys = ("hit_tokens", "stored_tokens", "requested_tokens", "lookup_hits", "usage")
for rnd in (1, 2):
    t = time.time()
    for p in prompts:
        call("/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0})
    files = os.listdir("/tmp/lmcache-disk")
    print(f"round {rnd}: 16 requests in {time.time() - t:.1f} s; disk tier: {len(files)} files,"
          f" {sum(os.path.getsize(os.path.join('/tmp/lmcache-disk', f)) for f in files) / 2**20:.0f} MiB")
    if rnd == 1:  # drop vLLM's GPU prefix cache only (reset_external=false): round 2 must come from LMCache
        for _ in range(20):
            ok = json.loads(call("/reset_prefix_cache", {})).get("success")
            if ok:
                break
            time.sleep(1)
        print("reset_prefix_cache:", ok)
time.sleep(12)  # LMCache logs its stats to Prometheus every 10 s
for line in call("/metrics").splitlines():
    if line.startswith("lmcache:") and any(k in line.split("{")[0] for k in keys):
        print("  " + line)
EOF
        metrics=$(python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8000/metrics").read().decode())' 2>&1)
        echo "$metrics" | grep -E '^(lmcache:|# (HELP|TYPE) lmcache:)' >"$out/lmcache_metrics.txt"
        ls -la /tmp/lmcache-disk | head -40 >"$out/lmcache_disk.txt"
        kill "$vpid"; wait "$vpid" 2>/dev/null
        grep -iE 'lmcache|c_ops|cuda_ops|compiled extension|Traceback|Error' "$out/lmcache_vllm.log" | head -60
        ;;
    start|squeeze|all)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        mkdir -p /tmp/kvpkg/kvwatch
        for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
        export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1 VVAL_WORK=/tmp/lmval
        [ -d /tmp/vsite/lmcache ] && [ -d /tmp/tiny ] || { echo "no LMCache in /tmp/vsite or no /tmp/tiny: run calls 1-3 first"; exit 1; }
        if [ "$step" != squeeze ]; then
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
            df -hT / /tmp /var/tmp 2>&1; cat /proc/swaps; ls /sys/fs/cgroup | head -30
            .gpu-bundle/with-bcc python3 -c 'import bcc, kvwatch.probes.memory; print("bcc", bcc.__version__)' || exit 1
        fi
        .gpu-bundle/with-bcc python3 tests/gpu/validate_lmcache.py --step "$step" --out "$out" \
            --steady "${STEADY:-300}" ${LMVAL_ARGS:-} 2>&1 | tee "/tmp/validate_lmcache_$step.log" | tail -120
        ;;
esac
