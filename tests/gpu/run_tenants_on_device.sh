#!/usr/bin/env bash
# The tenant validation (issue 24) on the lent H200 (device tool), from the repo root. Four calls
# back to back: the machine keeps /tmp only while it stays warm (30 s after a call).
#
#   1-2. carry [".vllm-bundle/parts/bundle.part00"], command: bash tests/gpu/run_tenants_on_device.sh part 00   (then 01)
#   3.   carry [".vllm-bundle/parts/bundle.part02", ".vllm-bundle/make_tiny_model.py"]
#        command: bash tests/gpu/run_tenants_on_device.sh unpack 02
#   4.   carry [".gpu-bundle", ".whl"], command: bash tests/gpu/run_tenants_on_device.sh main   (timeout_s 600)
#
# Built here first (the GPU machine has no network): .gpu-bundle (../shared/gpu/make-bcc-bundle),
# .vllm-bundle (../shared/gpu/vllm/make-vllm-bundle, and its make_tiny_model.py copied beside the
# parts), and kvwatch's wheels for Python 3.12 that the machine lacks in .whl.
# DEADLINE (default 500 s) bounds validate_tenants.py, vLLM's start included; LORA=0 leaves the
# adapters out, SELFTHRASH=0 the last phase; SCENARIO=issue36 (three salted tenants, a 60 s flood),
# CPU_TIER=GiB (vLLM's CPU offload tier), DEFAULTS=1 (kvwatch's detectors at their defaults), QUICK=1
# (short phases), MEMPROBE=1 (the daemon's memory by kind, tests/tools/memprobe).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?part NN | unpack NN | main}
case "$step" in
    part)
        mkdir -p /tmp/b && cp ".vllm-bundle/parts/bundle.part$2" /tmp/b/ && ls -la /tmp/b
        ;;
    unpack)
        cp ".vllm-bundle/parts/bundle.part$2" /tmp/b/ || exit 1
        mkdir -p /tmp/vsite
        time (cat /tmp/b/bundle.part* | xz -d -T0 | tar -xf - -C /tmp/vsite) || exit 1
        rm -rf /tmp/b
        python3 .vllm-bundle/make_tiny_model.py /tmp/tiny || exit 1
        PYTHONPATH=/tmp/vsite python3 -c 'import vllm, msgspec, zmq; print("vllm", vllm.__version__)' || exit 1
        # the dummy adapters load as vLLM reads them (safetensors, PEFT config), before the long call
        python3 tests/gpu/tenant_lora.py /tmp/tiny /tmp/lora-check lora-check || exit 1
        PYTHONPATH=/tmp/vsite python3 -c '
import json
from safetensors import safe_open
from vllm.lora.peft_helper import PEFTHelper
d = "/tmp/lora-check/lora-check"
PEFTHelper.from_dict(json.load(open(d + "/adapter_config.json")))
with safe_open(d + "/adapter_model.safetensors", framework="pt") as f:
    keys = list(f.keys()); t = f.get_tensor(keys[0])
print("adapter ok:", len(keys), "tensors,", keys[0], tuple(t.shape), t.dtype)' || echo "adapter check failed: the main call will record LoRA's failure"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        ;;
    main)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        mkdir -p /tmp/kvpkg/kvwatch
        for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
        export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
        [ -d /tmp/vsite/vllm ] && [ -d /tmp/tiny ] || { echo "no /tmp/vsite or /tmp/tiny: run part 00, 01, unpack 02 first"; exit 1; }
        .gpu-bundle/with-bcc python3 -c 'import bcc, kvwatch.probes.cuda; print("bcc", bcc.__version__)' || exit 1
        flags=()
        [ "${LORA:-1}" = 0 ] && flags+=(--no-lora)
        [ "${SELFTHRASH:-1}" = 0 ] && flags+=(--no-selfthrash)
        # issue 36: SCENARIO=issue36 CPU_TIER=GiB DEFAULTS=1 (kvwatch's detectors at their defaults)
        [ -n "${SCENARIO:-}" ] && flags+=(--scenario "$SCENARIO")
        [ -n "${CPU_TIER:-}" ] && flags+=(--cpu-tier "$CPU_TIER")
        [ "${DEFAULTS:-0}" = 1 ] && flags+=(--defaults)
        [ "${QUICK:-0}" = 1 ] && flags+=(--quick)
        [ -n "${PHASES:-}" ] && flags+=(--phase-seconds "$PHASES")  # e.g. PHASES=solo=40,recover=20
        # MEMPROBE=1: the daemon's memory by kind of mapping into $out/memprobe.* (tests/tools/memprobe;
        # KVW_TRACEMALLOC=N adds tracemalloc's top allocation sites, at a cost in memory)
        if [ "${MEMPROBE:-0}" = 1 ]; then
            export PYTHONPATH="$PWD/tests/tools/memprobe:$PYTHONPATH" KVW_MEMPROBE="$out/memprobe"
        fi
        .gpu-bundle/with-bcc python3 tests/gpu/validate_tenants.py --out "$out" --deadline "${DEADLINE:-500}" "${flags[@]}" 2>&1 \
            | tee /tmp/validate_tenants.log | tail -80
        # the device returns at most 8 files: the memory probe's go back as one archive
        if compgen -G "$out/memprobe.*" > /dev/null; then
            tar -czf "$out/memprobe.tar.gz" -C "$out" $(cd "$out" && ls memprobe.* | grep -v '\.tar\.gz$') \
                && rm -f $(ls "$out"/memprobe.* | grep -v '\.tar\.gz$')
        fi
        ;;
esac
