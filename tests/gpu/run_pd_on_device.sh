#!/usr/bin/env bash
# vLLM 0.26.0 prefill/decode over NIXL on the lent H200, watched by kvwatch (issue 26; device tool), from the
# repo root. Calls back to back: the machine keeps /tmp only while it stays warm (30 s after a call).
# Built first on the development host: .vllm-bundle (../shared/gpu/vllm/make-vllm-bundle), .nixl-bundle
# (bash tests/gpu/make_nixl_bundle.sh [--slim]), .gpu-bundle (bcc) and kvwatch's wheels in .whl.
#
#   1-2. carry [".vllm-bundle/parts/bundle.part00"], command: bash tests/gpu/run_vllm_on_device.sh part 00  (then 01)
#   3.   with --slim (saves a call):
#        carry [".vllm-bundle/parts/bundle.part02", ".vllm-bundle/make_tiny_model.py", ".nixl-bundle/slim"]
#        command: bash tests/gpu/run_pd_on_device.sh unpack slim
#        without: carry [".vllm-bundle/parts/bundle.part02", ".vllm-bundle/make_tiny_model.py"]
#        command: bash tests/gpu/run_pd_on_device.sh unpack
#   3b.  (without --slim only) carry [".nixl-bundle/carry"], command: bash tests/gpu/run_pd_on_device.sh nixl
#        (install_nixl.sh: sha256sum -c, pip --no-index --no-deps --target /tmp/vsite, then two processes READ
#        GPU blocks from each other through NIXL/UCX: $OUT/nixl_install.txt says whether cuda_ipc works here)
#   4.   carry [".gpu-bundle", ".whl"], timeout_s 600, command: bash tests/gpu/run_pd_on_device.sh all
#        kvwatch, prefill (8100), decode (8200), pd_proxy (8000), then steady 75 s, slow 45 s (a device-to-device
#        copy hog on the same GPU), recover 40 s, starve 50 s (decode capped at 0.25 CPU: UCX's tcp/lo
#        transport starves), recover2 40 s,
#        lowdemand 35 s; closure; $OUT gets 7 files (validation.json ...).
#        Phase lengths: STEADY/SLOW/RECOVER/STARVE/LOWDEMAND; more flags: PDVAL_ARGS (validate_pd.py --help).
#        Budget: ~10 s kvwatch, ~90 s per instance (started one after the other), ~235 s of phases, ~60 s reserve
#        (quiescence, closure, stops, packing); the harness clips phases to --deadline 560.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?unpack [slim] | nixl | all}

with_bcc() {
    if [ -e /opt/kvbcc/.done ]; then  # unpacked by an earlier call on this machine
        LD_LIBRARY_PATH=/opt/kvbcc/usr/lib/x86_64-linux-gnu:/opt/kvbcc/lib/x86_64-linux-gnu \
        PYTHONPATH=/opt/kvbcc/usr/lib/python3/dist-packages:$PYTHONPATH "$@"
    else
        .gpu-bundle/with-bcc "$@"
    fi
}

case "$step" in
    unpack)
        bash tests/gpu/run_vllm_on_device.sh unpack 02 || exit 1
        if [ "${2:-}" = slim ]; then
            bash .nixl-bundle/slim/install_nixl.sh || exit 1
        fi
        ;;
    nixl)
        [ -d /tmp/vsite/vllm ] || { echo "no /tmp/vsite/vllm: unpack the vLLM bundle first, on this warm machine"; exit 1; }
        bash .nixl-bundle/carry/install_nixl.sh || exit 1
        ;;
    all)
        [ -d /tmp/vsite/vllm ] && [ -d /tmp/tiny ] || { echo "no /tmp/vsite/vllm or /tmp/tiny: run calls 1-3 first"; exit 1; }
        PYTHONPATH=/tmp/vsite python3 -c 'import nixl._api, nixl._bindings, nixl; print("nixl from", nixl.__file__)' \
            || { echo "NIXL does not import from /tmp/vsite: run call 3 (slim) or 3b first"; exit 1; }
        if [ ! -e /tmp/site/.done ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
            touch /tmp/site/.done
        fi
        mkdir -p /tmp/kvpkg/kvwatch
        for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
        export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1 VVAL_WORK=/tmp/pdval
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader; uname -r
        with_bcc python3 -c 'import bcc, kvwatch.probes.transfer; print("bcc", bcc.__version__)' || exit 1
        # at most 8 files come back from $OUT: the harness writes 7
        with_bcc python3 tests/gpu/validate_pd.py --out "$out" --deadline "${DEADLINE:-560}" \
            --steady "${STEADY:-75}" --slow "${SLOW:-45}" --recover "${RECOVER:-40}" \
            --starve "${STARVE:-50}" --lowdemand "${LOWDEMAND:-35}" \
            ${PDVAL_ARGS:-} 2>&1 | tee /tmp/validate_pd.log | tail -100
        ;;
    *)
        echo "unknown step $step"; exit 2
        ;;
esac
