#!/usr/bin/env bash
# Build .lmcache-bundle/: LMCache (vLLM's LMCacheConnectorV1) and the only wheels it needs beyond the
# vLLM bundle and the H200 machine's own packages, for the lent H200 (Python 3.12, torch 2.11.0+cu130,
# no network). Then print the device calls that add it to the vLLM site (/tmp/vsite) there.
#
# Usage, from the repo root, after ../shared/gpu/vllm/make-vllm-bundle has made .vllm-bundle/:
#   bash tests/gpu/make_lmcache_bundle.sh               # build, check, print the calls
#   bash tests/gpu/make_lmcache_bundle.sh --check-abi   # also resolve the extension's torch symbols against
#                                                       # torch 2.11.0's own libraries (downloads that 531 MB
#                                                       # wheel once into /tmp/lmcache-abi-torch-2.11.0)
# Environment: LMCACHE_VERSION (default 0.5.3, see below), FORCE_PARTS=1 (tar + 60 MiB parts even when the
# wheels fit beside the vLLM bundle's last part), ALLOW_INCOMPATIBLE=1 (build even when the compiled ops
# were built for another torch).
#
# Why 0.5.3 and not 0.5.6 (tests/gpu/lmcache_notes.md has the evidence): every LMCache wheel from 0.4.5 on
# is built with CUDA 13.0 (NEEDED libcudart.so.13), but from 0.5.4 on the compiled ops (cuda_ops) are built
# against torch 2.13: they need c10::NotImplementedError(SourceLocation, std::string), which torch 2.11.0
# does not export, so the extension fails to load there (LMCache then falls back to its pure-torch ops).
# 0.5.3 (c_ops) was built against torch 2.10/2.11 headers and all its torch symbols resolve in 2.11.0.
#
# What it needs at import, traced statically from lmcache.integration.vllm.vllm_v1_adapter (the module
# vLLM 0.26.0's lmcache_connector.py imports): everything is on the machine or in the vLLM bundle except
# aiofile (imported at module level by lmcache/v1/storage_backend/gds_backend.py) and its dependency caio.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -e .git ] && [ -d tests/gpu ] || { echo "run from the kvwatch repo" >&2; exit 1; }

ver=${LMCACHE_VERSION:-0.5.3}
extra_wheels=("aiofile==3.12.3" "caio==0.12.10")
check_abi=0
[ "${1:-}" = "--check-abi" ] && check_abi=1
out=.lmcache-bundle
carry=$out/carry
parts=$out/parts
mib=$((1024 * 1024))

mkdir -p "$out"
# .gitignore does not name .lmcache-bundle: without this the wheels would travel with every device call
# (the tree that travels is tracked + untracked-not-ignored files) and could be committed by mistake.
printf '*\n' >"$out/.gitignore"
rm -rf "$carry" "$parts"
mkdir -p "$carry"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== downloading lmcache==$ver ${extra_wheels[*]} (CPython 3.12, manylinux x86_64)"
plat=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do plat+=(--platform "${p}_x86_64"); done
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform any -d "$carry" "lmcache==$ver" "${extra_wheels[@]}" >"$tmp/pip.log" 2>&1; then
    grep -v 'WARNING: Location' "$tmp/pip.log" >&2
    exit 1
fi
whl=$(ls "$carry"/lmcache-"$ver"-*.whl)
[ "$(ls "$carry"/*.whl | wc -l)" = 3 ] || { ls -la "$carry" >&2; echo "expected 3 wheels" >&2; exit 1; }

echo "== the compiled modules of $(basename "$whl")"
python3 -m zipfile -e "$whl" "$tmp/x"
ext=""
for so in "$tmp"/x/lmcache/*.so; do
    name=$(basename "$so")
    needed=$(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | grep -E 'cudart|torch|c10' | tr '\n' ' ' || true)
    nvcc=$(grep -a -o -m1 -E 'cuda_[0-9]+\.[0-9]+\.r[0-9.]+/compiler\.[0-9_]+' "$so" | head -1 || true)
    printf '   %-48s %s%s\n' "$name" "$needed" "${nvcc:+ [nvcc $nvcc]}"
    case "$name" in c_ops.*|cuda_ops.*) ext=$name ;; esac
done
[ -n "$ext" ] || { echo "no c_ops/cuda_ops extension in the wheel" >&2; exit 1; }
ext_so=$tmp/x/lmcache/$ext
ext_mod=${ext%%.*}

# Torch headers compiled into the extension leave their assert sites in it ("...torch/include/<file>":<line>).
# Lines differ between torch releases (read from each release's wheel):
#   DispatchKeySet.h  SymInt.h  ivalue.h
#   306               92        1362      torch 2.10.0 and 2.11.0 (same lines at every site the ops cite)
#   306               88        1362      torch 2.12.0
#   302               88        1355      torch 2.13.0
marker() { grep -a -o -E "$1 INTERNAL ASSERT FAILED at \"[^\"]*/include/$2\":[0-9]+" "$ext_so" | head -1 | sed 's/.*://' || true; }
m="$(marker '\.repr_\) == 0\)' c10/core/DispatchKeySet.h)/$(marker 'is_heap_allocated\(\)' c10/core/SymInt.h)"
m="$m/$(marker 'kNumTags' ATen/core/ivalue.h)"
case "$m" in
    306/92/1362) built="torch 2.10 or 2.11 headers" ;;
    306/88/1362) built="torch 2.12 headers" ;;
    302/88/1355) built="torch 2.13 headers" ;;
    *) built="unknown torch headers" ;;
esac
nie=no
if nm -D --undefined-only "$ext_so" | grep '_ZN3c1019NotImplementedErrorC1ENS_14SourceLocation' >/dev/null; then nie=yes; fi
cudart=no
if readelf -d "$ext_so" | grep 'libcudart.so.13' >/dev/null; then cudart=yes; fi
echo "   $ext_mod: assert sites $m -> $built; links libcudart.so.13: $cudart;" \
    "needs c10::NotImplementedError(SourceLocation, std::string) (exported by torch 2.13, not by 2.10-2.12): $nie"
compatible=0
[ "$built" = "torch 2.10 or 2.11 headers" ] && [ "$nie" = no ] && [ "$cudart" = yes ] && compatible=1

if [ "$check_abi" = 1 ]; then
    cache=${TORCH_ABI_CACHE:-/tmp/lmcache-abi-torch-2.11.0}
    if [ ! -s "$cache/exports.txt" ]; then
        echo "== downloading torch==2.11.0 (531 MB, once) to read its exported symbols"
        mkdir -p "$cache"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 -d "$cache" torch==2.11.0 >"$tmp/pip-torch.log" 2>&1 ||
            { grep -v 'WARNING: Location' "$tmp/pip-torch.log" >&2; exit 1; }
        python3 - "$cache" <<'EOF'
import glob, os, sys, zipfile
cache = sys.argv[1]
whl = glob.glob(os.path.join(cache, "torch-2.11.0-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for n in ["torch/version.py"] + [f"torch/lib/lib{l}.so" for l in
              ("c10", "c10_cuda", "torch", "torch_cpu", "torch_cuda", "torch_python")]:
        with open(os.path.join(cache, os.path.basename(n)), "wb") as f:
            f.write(z.read(n))
EOF
        for l in "$cache"/lib*.so; do nm -D --defined-only "$l" | awk '{print $3}'; done |
            sed 's/@.*//' | sort -u >"$cache/exports.txt"
        rm -f "$cache"/lib*.so "$cache"/torch-*.whl
    fi
    echo "== undefined c10::/at::/torch:: symbols of each module, resolved against $(grep -o "__version__ = '[^']*'" "$cache/version.py")"
    abi_ok=1
    for so in "$tmp"/x/lmcache/*.so; do
        nm -D --undefined-only "$so" | awk '{print $2}' | sed 's/@.*//' | sort -u >"$tmp/u"
        paste "$tmp/u" <(c++filt <"$tmp/u") | awk -F'\t' '$2 ~ /(c10::|at::|torch::)/ {print $1}' >"$tmp/t"
        comm -23 "$tmp/t" "$cache/exports.txt" >"$tmp/miss"
        printf '   %-48s %3d torch symbols, %d not exported by torch 2.11.0\n' \
            "$(basename "$so")" "$(wc -l <"$tmp/t")" "$(wc -l <"$tmp/miss")"
        if [ -s "$tmp/miss" ]; then c++filt <"$tmp/miss" | sed 's/^/      missing: /'; abi_ok=0; fi
    done
    [ "$abi_ok" = 1 ] || compatible=0
fi

if [ "$compatible" != 1 ]; then
    echo "!! lmcache $ver's $ext_mod will not load under torch 2.11.0+cu130 (LMCache then falls back to pure-torch ops)."
    [ "${ALLOW_INCOMPATIBLE:-0}" = 1 ] || { echo "!! use LMCACHE_VERSION=0.5.3, or ALLOW_INCOMPATIBLE=1 to build anyway" >&2; exit 1; }
fi

# The config LMCache reads from LMCACHE_CONFIG_FILE (keys: lmcache/v1/config.py, _CONFIG_DEFINITIONS;
# LMCACHE_<KEY> variables override the file). The disk tier writes one <key>.pt file per chunk there.
cat >"$carry/lmcache-local.yaml" <<'EOF'
# LMCache engine config for vLLM's LMCacheConnectorV1 on the H200: a pinned CPU pool and a local disk tier.
chunk_size: 256                         # tokens per chunk (one disk file per chunk); a multiple of --block-size
local_cpu: true                         # the CPU tier (pinned host memory, LMCache's own allocator)
max_local_cpu_size: 1.0                 # GiB (x 1024**3)
local_disk: "file:///tmp/lmcache-disk/" # file:// is stripped (config_base._parse_local_disk); created if absent
max_local_disk_size: 4.0                # GiB (x 1024**3); LRU eviction removes the files
local_disk_path_sharding: by_gpu        # one path listed: every GPU uses it
save_unfull_chunk: false                # only whole chunks are stored
EOF
echo "$ext_mod" >"$carry/EXT"
(cd "$carry" && sha256sum ./*.whl lmcache-local.yaml EXT >SHA256SUMS)

# What travels in the vLLM bundle's call 3 (tests/gpu/run_vllm_on_device.sh unpack 02): part 02, the tiny
# model script and the tree (tracked + untracked-not-ignored files, shared/ if the checkout has one).
size() { { stat -c %s "$@" 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}'; }
mb() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
tree=$(python3 - <<'EOF'
import os, subprocess
names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True).stdout.split(b"\0")
total = sum(os.path.getsize(n) for n in names if n and os.path.isfile(n))
if os.path.isdir("shared"):
    total += sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk("shared") for f in fs)
print(total)
EOF
)
part02=$(size .vllm-bundle/parts/bundle.part02)
tiny=$(size .vllm-bundle/make_tiny_model.py)
wheels=$(size "$carry"/*)
call3=$((part02 + tiny + tree + wheels))
if git check-ignore -q "$carry/SHA256SUMS"; then ignored=yes; else ignored=NO; fi
echo "== sizes"
printf '   %-52s %6s MiB\n' "lmcache $ver + aiofile + caio (+ config), carried as is" "$(mb "$wheels")" \
    "vLLM bundle part 02 + make_tiny_model.py" "$(mb $((part02 + tiny)))" \
    "the tree that travels with every call" "$(mb "$tree")" \
    "call 3 with LMCache in it (limit 64)" "$(mb "$call3")"
echo "   $carry ignored by git: $ignored"
[ "$ignored" = yes ] || { echo "!! $carry is not ignored: it would travel with every call" >&2; exit 1; }
[ "$part02" -gt 0 ] || echo "   (no .vllm-bundle/parts/bundle.part02 here: build the vLLM bundle first)"

mode=carry
if [ "${FORCE_PARTS:-0}" = 1 ] || [ "$call3" -gt $((63 * mib)) ]; then
    mode=parts
    mkdir -p "$parts"
    tar -C "$carry" -cf - . | split -b 60M -d - "$parts/lmcache.part"
    echo "== parts (plain tar: the wheels are zip-compressed already)"
    ls -l "$parts" | sed 's/^/   /'
    mkdir -p "$tmp/re"
    cat "$parts"/lmcache.part* | tar -xf - -C "$tmp/re"
    (cd "$tmp/re" && sha256sum -c --quiet SHA256SUMS)
    echo "   the parts reassemble into $(ls "$tmp/re" | wc -l) files whose checksums match"
fi

cat "$carry/SHA256SUMS" | sed 's/^/   /'
q='"'
step3="bash tests/gpu/run_vllm_on_device.sh unpack 02 && bash tests/gpu/run_lmcache_on_device.sh install"
echo
echo "== device calls (back to back: the machine keeps /tmp only while warm, 30 s after a call)"
echo "   1-2. as for vLLM alone: carry [${q}.vllm-bundle/parts/bundle.part00${q}] (then part01)"
echo "        command: bash tests/gpu/run_vllm_on_device.sh part 00   (then 01)"
if [ "$mode" = parts ]; then
    for p in "$parts"/lmcache.part*; do
        n=${p##*.part}
        echo "   L$n.  carry [${q}$p${q}]"
        echo "        command: bash tests/gpu/run_lmcache_on_device.sh part $n"
    done
    echo "   3.   carry [${q}.vllm-bundle/parts/bundle.part02${q}, ${q}.vllm-bundle/make_tiny_model.py${q}]"
else
    echo "   3.   carry [${q}.vllm-bundle/parts/bundle.part02${q}, ${q}.vllm-bundle/make_tiny_model.py${q}, ${q}$carry${q}]"
fi
echo "        command: $step3"
echo "        (installs the wheels with pip install --no-index --no-deps --target /tmp/vsite, copies the config"
echo "         to /tmp/lmcache-local.yaml, dlopens $ext_mod with RTLD_NOW after torch, imports the adapter)"
echo "   4.   smoke test of LMCache alone (no kvwatch): command: bash tests/gpu/run_lmcache_on_device.sh smoke"
echo "        or the kvwatch call: carry [${q}.gpu-bundle${q}, ${q}.whl${q}], and start vLLM with"
echo "        PYTHONPATH=/tmp/vsite LMCACHE_CONFIG_FILE=/tmp/lmcache-local.yaml LMCACHE_TRACK_USAGE=false \\"
echo "        PROMETHEUS_MULTIPROC_DIR=<an empty dir> (so lmcache:* from the engine process reach vLLM's /metrics)"
echo "        and, instead of --kv-offloading-size/--kv-offloading-backend (one connector at a time):"
echo "        --kv-transfer-config '{${q}kv_connector${q}:${q}LMCacheConnectorV1${q},${q}kv_role${q}:${q}kv_both${q}}'"
