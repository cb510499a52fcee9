#!/usr/bin/env bash
# The real-vLLM validation on the lent H200 (device tool), from the repo root. Five calls back
# to back: the machine keeps /tmp only while it stays warm (30 s after a call).
#
#   1-2. carry [".vllm-bundle/parts/bundle.part00"], command: bash tests/gpu/run_vllm_on_device.sh part 00   (then 01)
#   3.   carry [".vllm-bundle/parts/bundle.part02", ".vllm-bundle/make_tiny_model.py"] (and ".tools/py-spy"
#        for the engine-cost call's daemon profile)
#        command: bash tests/gpu/run_vllm_on_device.sh unpack 02
#   4.   carry [".gpu-bundle", ".whl"], command: bash tests/gpu/run_vllm_on_device.sh first
#   5.   command: bash tests/gpu/run_vllm_on_device.sh second      (kvwatch, vLLM and the subscriber
#        started by call 4 are still running: each in its own session)
#   6.   command: bash tests/gpu/run_vllm_on_device.sh cost        (vLLM still running)
#
# Carried bundles, built on the development host first (the GPU machine has no network):
# .gpu-bundle (bcc and its libraries, with a with-bcc launcher), .vllm-bundle (vLLM 0.26.0, its
# wheels and a tiny random-weight Llama, split in parts), and kvwatch's wheels for Python 3.12 in .whl.
# A call carries the tracked tree (~4.6 MiB) beside its part, under 64 MiB together: parts of 58 MiB
# (re-split: cat .vllm-bundle/parts/bundle.part* | split -b 58M -d - NEWDIR/bundle.part).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?part NN | unpack NN | first | second | cost | noprefix}

with_bcc() {
    if [ -e /opt/kvbcc/.done ]; then  # unpacked by an earlier call on this machine
        LD_LIBRARY_PATH=/opt/kvbcc/usr/lib/x86_64-linux-gnu:/opt/kvbcc/lib/x86_64-linux-gnu \
        PYTHONPATH=/opt/kvbcc/usr/lib/python3/dist-packages:$PYTHONPATH "$@"
    else
        .gpu-bundle/with-bcc "$@"
    fi
}

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
        # py-spy for the engine-cost call's daemon profile, when carried (.tools/py-spy, from its wheel)
        if [ -x .tools/py-spy ]; then mkdir -p /tmp/pyspy && cp .tools/py-spy /tmp/pyspy/; fi
        PYTHONPATH=/tmp/vsite python3 -c 'import vllm, msgspec, zmq; print("vllm", vllm.__version__)'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        df -h /tmp | tail -1
        ;;
    first | second | cost | noprefix)
        if [ ! -e /tmp/site/.done ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
            touch /tmp/site/.done
        fi
        mkdir -p /tmp/kvpkg/kvwatch
        for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
        export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
        with_bcc python3 -c 'import bcc, kvwatch.probes.cuda; print("bcc", bcc.__version__)' || exit 1
        # at most 8 files come back from $OUT: the harness writes just that many
        with_bcc python3 tests/gpu/validate_vllm.py --out "$out" --plan "$step" --deadline "${DEADLINE:-560}" ${SKIP:+--skip "$SKIP"} 2>&1 \
            | tee "/tmp/validate_$step.log" | tail -80
        ;;
esac
