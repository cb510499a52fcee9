#!/usr/bin/env bash
# The KV-cache-group validation on the lent H200 (device tool), from the repo root. Four calls
# back to back: the machine keeps /tmp only while it stays warm (30 s after a call).
#
#   1-2. carry [".vllm-bundle/parts/bundle.part00"], command: bash tests/gpu/run_groups_on_device.sh part 00   (then 01)
#   3.   carry [".vllm-bundle/parts/bundle.part02", ".vllm-bundle/make_tiny_model.py"]
#        command: bash tests/gpu/run_groups_on_device.sh unpack 02
#   4.   carry [".gpu-bundle", ".whl"], command: bash tests/gpu/run_groups_on_device.sh main
#
# Built here first (the GPU machine has no network): .gpu-bundle (../shared/gpu/make-bcc-bundle),
# .vllm-bundle (../shared/gpu/vllm/make-vllm-bundle, and its make_tiny_model.py copied beside the
# parts), and kvwatch's wheels for Python 3.12 that the machine lacks in .whl.
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
        python3 tests/gpu/vllm_models.py /tmp/tiny /tmp/models || exit 1
        PYTHONPATH=/tmp/vsite python3 -c 'import vllm, msgspec, zmq, transformers; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
        PYTHONPATH=/tmp/vsite python3 -c '
from transformers import AutoConfig
for n in ("hybrid", "sliding", "sliding_gemma"):
    c = AutoConfig.from_pretrained("/tmp/models/" + n)
    print(n, type(c).__name__, getattr(c, "layer_types", None), c.sliding_window)'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        ;;
    main)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        mkdir -p /tmp/kvpkg/kvwatch
        for d in daemon probes exporters; do ln -sfn "$PWD/$d" "/tmp/kvpkg/kvwatch/$d"; done
        export PYTHONPATH=/tmp/kvpkg:/tmp/site:$PWD PYTHONUNBUFFERED=1
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
        .gpu-bundle/with-bcc python3 -c 'import bcc, kvwatch.probes.cuda; print("bcc", bcc.__version__)' || exit 1
        .gpu-bundle/with-bcc python3 tests/gpu/validate_groups.py --out "$out" --deadline "${DEADLINE:-540}" 2>&1 \
            | tee /tmp/validate_groups.log | tail -60
        ;;
esac
