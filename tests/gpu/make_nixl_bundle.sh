#!/usr/bin/env bash
# Build .nixl-bundle/: NIXL (vLLM 0.26.0's NixlConnector imports `nixl._api` and `nixl._bindings`) for the
# lent H200 (Python 3.12, torch 2.11.0+cu130, CUDA 13, no network), as wheels, reproducibly, refusing a version
# whose ABI does not fit; then print the device calls that add it to the vLLM site (/tmp/vsite) there.
#
# Usage, from the repo root, after ../shared/gpu/vllm/make-vllm-bundle has made .vllm-bundle/:
#   bash tests/gpu/make_nixl_bundle.sh           # wheels + checks into .nixl-bundle/carry/ (one device call of its own)
#   bash tests/gpu/make_nixl_bundle.sh --slim    # also .nixl-bundle/slim/: the unpacked wheels without what NixlConnector
#                                                # never loads, as one deterministic tar.xz (~17 MiB) that rides in the
#                                                # vLLM bundle's call 3, which saves a device call (~30 s of xz here)
# Environment: NIXL_VERSION (default 1.5.1), ALLOW_INCOMPATIBLE=1 (build even when a check fails),
# FORCE_PARTS=1 (tar + 60 MiB parts even when carry/ fits one call).
#
# What is checked, and why (tests/gpu/nixl_notes.md has the evidence):
# * wheels: `nixl-cu13` (the compiled package, module nixl_cu13) and `nixl` (the meta package: module nixl,
#   which imports nixl_cu<torch.version.cuda major>). The meta package's Requires-Dist names nixl-cu12 too;
#   it is not needed (pip --no-deps). nixl-cu13 requires torch and numpy, both on the machine.
# * ABI: cp312; every libcudart NEEDED is .so.13 (torch 2.11.0+cu130 loads libcudart.so.13); GLIBC/GLIBCXX/CXXABI
#   versions within manylinux_2_28 (the tag of the machine's own torch wheel); no c10/at/torch symbol in the
#   libraries NixlConnector loads (nixl_ep_cu13 is built for torch 2.12-2.14 only: unusable under 2.11, unused
#   by NixlConnector); libnixl.so with plugins/libplugin_UCX.so beside it (the plugin dir is libnixl's dir +
#   /plugins), UCX with its CUDA transport (cuda_copy, cuda_ipc).
# * kvwatch: every NIXL/UCX/verbs symbol that probes/transfer.py hooks (TRANSFER_APIS), resolved in the wheel's
#   libraries whose file names match its LIBRARY_PATTERNS.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -e .git ] && [ -d tests/gpu ] && [ -f probes/transfer.py ] || { echo "run from the kvwatch repo" >&2; exit 1; }

ver=${NIXL_VERSION:-1.5.1}
slim=0
[ "${1:-}" = "--slim" ] && slim=1
out=.nixl-bundle
carry=$out/carry
slimdir=$out/slim
parts=$out/parts
mib=$((1024 * 1024))
# sha256 of the 1.5.1 wheels as PyPI served them on 2026-12-02 (pip checks the index's own hash on download)
declare -A pinned=(
    [nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl]=ce48b601bad4c4503a5d9d418e6f4b1289a3a68e407af99f0f7e377f8371f49b
    [nixl-1.5.1-py3-none-any.whl]=aa90914d7df16fb586e57be633972917c6c2489b004ad241913ecda02207eaab
)

mkdir -p "$out"
# .gitignore does not name .nixl-bundle: without this the 56 MiB wheel would travel with every device call
# (the tree that travels is tracked + untracked-not-ignored files) and could be committed by mistake.
printf '*\n' >"$out/.gitignore"
rm -rf "$carry" "$slimdir" "$parts"
mkdir -p "$carry"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== downloading nixl-cu13==$ver nixl==$ver (CPython 3.12, manylinux x86_64)"
plat=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do plat+=(--platform "${p}_x86_64"); done
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform any -d "$carry" "nixl-cu13==$ver" "nixl==$ver" >"$tmp/pip.log" 2>&1; then
    grep -v 'WARNING: Location' "$tmp/pip.log" >&2
    exit 1
fi
[ "$(ls "$carry"/*.whl | wc -l)" = 2 ] || { ls -la "$carry" >&2; echo "expected 2 wheels" >&2; exit 1; }
cu=$(ls "$carry"/nixl_cu13-"$ver"-*.whl)
meta=$(ls "$carry"/nixl-"$ver"-*.whl)
for w in "$cu" "$meta"; do
    b=$(basename "$w")
    sum=$(sha256sum "$w" | cut -d' ' -f1)
    if [ -n "${pinned[$b]:-}" ]; then
        [ "$sum" = "${pinned[$b]}" ] || { echo "!! $b: sha256 $sum, pinned ${pinned[$b]}" >&2; exit 1; }
        echo "   $b  $(stat -c %s "$w") B  sha256 pinned: ok"
    else
        echo "   $b  $(stat -c %s "$w") B  sha256 $sum (no pin for $ver)"
    fi
done
unzip -p "$cu" '*.dist-info/WHEEL' | sed -n 's/^Tag: /   tag: /p'
for w in "$cu" "$meta"; do
    echo "   $(basename "$w") Requires-Dist: $(unzip -p "$w" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | tr '\n' ' ')"
done

python3 -m zipfile -e "$cu" "$tmp/x"
python3 -m zipfile -e "$meta" "$tmp/m"

echo "== checks (ELF, read here with readelf/objdump/nm)"
if ! python3 - "$tmp/x" "$cu" >"$tmp/check.txt" <<'EOF'; then
import ast, re, subprocess, sys
from pathlib import Path

root, wheel = Path(sys.argv[1]), Path(sys.argv[2]).name
bad = []
def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
def vkey(v):
    return tuple(int(x) for x in v.split("."))

if "-cp312-" not in wheel:
    bad.append(f"{wheel} is not a CPython 3.12 wheel")
sos = sorted(p for p in root.rglob("*.so*") if p.is_file() and not p.name.endswith(".la") and "nixl_ep_" not in p.parts[len(root.parts)])
by_name = {p.name: p for p in sos}
need = {p: re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", run("readelf", "-d", str(p))) for p in sos}

print("== layout (what NixlConnector loads)")
must = {
    "bindings": root / "nixl_cu13" / "_bindings.cpython-312-x86_64-linux-gnu.so",
    "libnixl": root / ".nixl_cu13.mesonpy.libs" / "libnixl.so",
    "UCX plugin": root / ".nixl_cu13.mesonpy.libs" / "plugins" / "libplugin_UCX.so",
}
for what, p in must.items():
    print(f"   {what:10} {p.relative_to(root) if p.exists() else 'MISSING'}")
    if not p.exists():
        bad.append(f"no {what} at {p.relative_to(root)}")
ucp = next((p for p in sos if re.match(r"libucp(-[0-9a-f]{8})?\.so", p.name)), None)
uct_cuda = next((p for p in sos if p.name.startswith("libuct_cuda.so")), None)
tls = sorted(set(re.findall(r"^(cuda_ipc|cuda_copy|gdr_copy)$", run("strings", "-a", str(uct_cuda)), re.M))) if uct_cuda else []
uct = next((p for p in sos if re.match(r"libuct(-[0-9a-f]{8})?\.so", p.name)), None)
tls += sorted(set(re.findall(r"^(posix|sysv|self|tcp)$", run("strings", "-a", str(uct)), re.M))) if uct else []
tls += ["tcp"] if uct and "tcp_ep.c" in run("strings", "-a", str(uct)) else []
mods = sorted(p.name.split(".so")[0] for p in sos if p.parent.name == "ucx")
print(f"   UCX        {ucp.relative_to(root) if ucp else 'MISSING'}; modules {' '.join(mods)}; transports {' '.join(sorted(set(tls)))}")
if not ucp or "cuda_ipc" not in tls:
    bad.append("no UCX with cuda_ipc in the wheel")
eps = sorted(p.name for p in (root / "nixl_ep_cu13").glob("nixl_ep_cpp_torch*.so")) if (root / "nixl_ep_cu13").exists() else []
print(f"   nixl_ep    {' '.join(eps) or 'none'} (torch-versioned; {'a' if any('torch211' in e for e in eps) else 'NO'} build for torch 2.11; NixlConnector does not import nixl_ep)")

print("== ABI (libraries outside nixl_ep_cu13)")
cudart = sorted({n for ns in need.values() for n in ns if n.startswith("libcudart.so")})
print(f"   libcudart NEEDED: {' '.join(cudart) or 'none'}")
if any(n != "libcudart.so.13" for n in cudart):
    bad.append(f"built for another CUDA runtime: {cudart}")
limits = {"GLIBC": "2.28", "GLIBCXX": "3.4.25", "CXXABI": "1.3.11"}  # manylinux_2_28
top = {}
for p in sos:
    for tag, v in re.findall(r"\*UND\*.*?\b(GLIBC|GLIBCXX|CXXABI)_([0-9.]+)\b", run("objdump", "-T", str(p))):
        if tag not in top or vkey(v) > vkey(top[tag][0]):
            top[tag] = (v, p.name)
for tag, (v, name) in sorted(top.items()):
    ok = vkey(v) <= vkey(limits[tag])
    print(f"   highest {tag}_{v} ({name}); manylinux_2_28 allows {limits[tag]}: {'ok' if ok else 'TOO NEW'}")
    if not ok:
        bad.append(f"{name} needs {tag}_{v}")
torch_syms = {}
for p in sos:
    und = run("nm", "-D", "--undefined-only", str(p)).split()
    dem = run("c++filt", *und[1::2]).splitlines() if len(und) > 1 else []
    hits = [d for d in dem if re.search(r"(^|[^A-Za-z0-9_:])(c10|at|torch)::", d)]
    if hits:
        torch_syms[p.name] = hits
print(f"   torch symbols imported: {sum(map(len, torch_syms.values()))} {sorted(torch_syms) or ''}")
if torch_syms:
    bad.append(f"torch symbols in {sorted(torch_syms)}")

print("== from the machine (NEEDED by what NixlConnector loads, not in the wheel)")
start = [must["bindings"], must["UCX plugin"], *(p for p in sos if p.parent.name == "ucx" and re.match(r"lib(uct_cuda|ucm_cuda|uct_cma)\.so", p.name))]
seen, todo, ext = set(), [p for p in start if p.exists()], set()
while todo:
    p = todo.pop()
    if p in seen:
        continue
    seen.add(p)
    for n in need.get(p, []):
        (todo.append(by_name[n]) if n in by_name else ext.add(n))
base = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2", "libgcc_s.so.1", "libstdc++.so.6"}
print(f"   glibc/gcc: {' '.join(sorted(ext & base))}")
print(f"   others:    {' '.join(sorted(ext - base))}  (libcudart.so.13: torch's; libcuda/libnvidia-ml: the driver's)")

print("== kvwatch's hooks (probes/transfer.py) in this wheel")
tree = ast.parse(Path("probes/transfer.py").read_text())
patterns, apis = {}, []
for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LIBRARY_PATTERNS" for t in node.targets):
        patterns = {k.value: re.compile(v.args[0].value) for k, v in zip(node.value.keys, node.value.values)}
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "TransferApi":
        name, lib, sym = (a.value for a in node.args[:3])
        apis.append((name, lib, sym, any(k.arg == "prefix" and k.value.value for k in node.keywords)))
for lib, pat in patterns.items():
    files = [p for p in sos if pat.match(p.name)]
    if not files:
        print(f"   {lib:5} no file matching {pat.pattern} in the wheel")
        continue
    for f in files:
        exports = [l.split()[-1] for l in run("nm", "-D", "--defined-only", str(f)).splitlines()]
        print(f"   {lib:5} {f.relative_to(root)}")
        for name, alib, sym, prefix in apis:
            if alib != lib:
                continue
            hit = [e for e in exports if (e.startswith(sym) if prefix else e.split("@")[0] == sym)]
            print(f"         {name:18} {'prefix ' if prefix else ''}{sym}: {', '.join(hit) if hit else 'MISSING'}")
            if not hit and lib in ("nixl", "ucp"):
                bad.append(f"kvwatch hook {name} ({sym}) missing in {f.name}")
for b in bad:
    print(f"!! {b}")
sys.exit(1 if bad else 0)
EOF
    sed 's/^/   /' "$tmp/check.txt"
    echo "!! nixl $ver does not fit torch 2.11.0+cu130 / CUDA 13 / kvwatch's hooks (above)." >&2
    [ "${ALLOW_INCOMPATIBLE:-0}" = 1 ] || { echo "!! use NIXL_VERSION=1.5.1, or ALLOW_INCOMPATIBLE=1 to build anyway" >&2; exit 1; }
else
    sed 's/^/   /' "$tmp/check.txt"
fi

# The installer and the two-process check travel inside carry/ (and slim/, and the parts), so the device
# command stays one line: bash <dir>/install_nixl.sh
write_device_files() {
    local dir=$1
    cat >"$dir/install_nixl.sh" <<'EOF'
#!/usr/bin/env bash
# On the H200 (written by tests/gpu/make_nixl_bundle.sh): NIXL into /tmp/vsite (NIXL_SITE), next to the vLLM
# bundle, then nixl_check.py: two processes on the one GPU, one NIXL READ each as NixlConnector does it.
# Output: $OUT/nixl_install.txt. NIXL_CHECK_MEM=DRAM runs the check on host memory only.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}
site=${NIXL_SITE:-/tmp/vsite}
mkdir -p "$out" "$site"
(cd "$here" && sha256sum -c --quiet SHA256SUMS) || exit 1
if ls "$here"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$here"/*.whl || exit 1
else
    xz -d -T0 <"$here/nixl-site.tar.xz" | tar -xf - -C "$site" || exit 1
fi
{
    echo "== nixl installed into $site: $(ls -d "$site"/nixl*.dist-info | xargs -n1 basename | tr '\n' ' ')"
    ldconfig -p | grep -E 'libssl\.so\.3|libcrypto\.so\.3|libz\.so\.1 ' | sed 's/^/   /'
    PYTHONPATH=$site timeout 300 python3 "$here/nixl_check.py" --mem "${NIXL_CHECK_MEM:-VRAM}"
    rc=$?
    if [ "$rc" != 0 ] && [ "${NIXL_CHECK_MEM:-VRAM}" = VRAM ]; then
        echo "== VRAM check failed (rc $rc); the same on host memory, to tell UCX's CUDA path from the rest:"
        PYTHONPATH=$site UCX_PROTO_INFO=n timeout 300 python3 "$here/nixl_check.py" --mem DRAM
    fi
    exit "$rc"
} 2>&1 | tee "$out/nixl_install.txt"
exit "${PIPESTATUS[0]}"
EOF
    cat >"$dir/nixl_check.py" <<'EOF'
"""Two processes, one NIXL READ each way vLLM 0.26's NixlConnector does it (written by make_nixl_bundle.sh).

The target (like the prefill instance) fills a pool of layers x blocks x block_len bytes and publishes its
agent metadata; the initiator (like decode) registers its own pool, adds the remote agent, prepares one
descriptor per (layer, block) on both sides (vllm .../nixl/base_worker.py _build_fa_local/_build_fa_remote)
and READs a request's blocks (make_prepped_xfer + transfer, pull_worker.py _read_blocks), with vLLM's agent
config (num_threads=4, capture_telemetry=True). Three reads: contiguous block ids (NIXL merges them), and
descending ids (no merging) just below and at UCX's split_batch_size (1024 descriptors). Also reports whether
UCX rewrote the entries of cudaMalloc/cudaFree/cuMemAlloc_v2/cuMemFree_v2 (its CUDA memory hooks). JSON lines.
"""

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def pool(mem, rows, block_len, seed):
    """rows x block_len bytes; row r holds (r * 13 + seed) % 251 (seed None: zeros)."""
    if mem == "VRAM":
        import torch

        torch.cuda.set_device(0)
        buf = torch.zeros((rows, block_len), dtype=torch.uint8, device="cuda")
        if seed is not None:
            buf[:] = ((torch.arange(rows, device="cuda") * 13 + seed) % 251).to(torch.uint8)[:, None]
        torch.cuda.synchronize()
        return buf, buf.data_ptr(), 0
    buf = np.zeros((rows, block_len), dtype=np.uint8)
    if seed is not None:
        buf[:] = ((np.arange(rows) * 13 + seed) % 251).astype(np.uint8)[:, None]
    return buf, buf.ctypes.data, 0


def descs(addr, rows, block_len, dev):
    out = np.empty((rows, 3), dtype=np.uint64)
    out[:, 0] = addr + np.arange(rows, dtype=np.uint64) * block_len
    out[:, 1] = block_len
    out[:, 2] = dev
    return out


def loaded_libs():
    maps = Path("/proc/self/maps").read_text().split()
    libs = sorted({p for p in maps if "nixl" in p and re.search(r"/(libnixl\.so|libplugin_|libuc[mpst]|ucx/|libibverbs|_bindings)", p)})
    ucp = next((p for p in libs if "/libucp" in p), None)
    version = None
    if ucp:
        fn = ctypes.CDLL(ucp).ucp_get_version_string
        fn.restype = ctypes.c_char_p
        version = fn().decode()
    return {"ucx_version": version, "libs": libs}


def entry_bytes():
    """First 16 bytes of CUDA calls that UCX's memory hooks (libucm_cuda) patch in place in bistro mode, the
    default on x86_64 (UCX_MEM_CUDA_HOOK_MODE): kvwatch's CUDA uprobes sit on the same function entries."""
    out, maps = {}, Path("/proc/self/maps").read_text()
    for pat, names in ((r"\S*/libcudart\.so\.13\S*", ("cudaMalloc", "cudaFree")),
                       (r"\S*/libcuda\.so\.(1|\d{3})\S*", ("cuMemAlloc_v2", "cuMemFree_v2"))):  # fmt: skip
        m = re.search(pat, maps)
        if m:
            lib = ctypes.CDLL(m.group(0))
            for n in names:
                out[n] = ctypes.string_at(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value, 16).hex()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", default="VRAM", choices=["VRAM", "DRAM"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=128)
    ap.add_argument("--block-len", type=int, default=32768, help="bytes per layer per block (tiny model: 32 KiB)")
    ap.add_argument("--role", default="target")
    ap.add_argument("--dir", default="")
    a = ap.parse_args()
    if a.mem == "VRAM":
        import torch  # before nixl: the meta package picks nixl_cu<torch.version.cuda major>

        print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}))
    from nixl._api import nixl_agent, nixl_agent_config

    rows = a.layers * a.pool_blocks
    # the pool first: as in vLLM's worker, the CUDA context exists before UCX starts (base_worker.py _nixl_handshake)
    buf, addr, dev = pool(a.mem, rows, a.block_len, 1 if a.role == "target" else None)
    before = entry_bytes()
    agent = nixl_agent(a.role, nixl_agent_config(num_threads=4, capture_telemetry=True))
    agent.register_memory(agent.get_reg_descs([(addr, rows * a.block_len, dev, "")], a.mem))
    if a.role == "target":
        work = Path(tempfile.mkdtemp(prefix="nixl-check-"))
        (work / "md").write_bytes(agent.get_agent_metadata())
        (work / "addr").write_text(json.dumps({"addr": addr, "dev": dev}))
        print(json.dumps({"role": "target", "plugins": agent.get_plugin_list(), **loaded_libs()}))
        env = dict(os.environ, UCX_PROTO_INFO=os.environ.get("UCX_PROTO_INFO", "y"))
        child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--role", "initiator", "--dir", str(work)], env=env)
        notifs = []
        while child.poll() is None:
            for msgs in agent.get_new_notifs().values():
                notifs += [m.decode() for m in msgs]
            time.sleep(0.01)
        time.sleep(0.5)
        for msgs in agent.get_new_notifs().values():
            notifs += [m.decode() for m in msgs]
        print(json.dumps({"role": "target", "child_rc": child.returncode, "notifs": notifs}))
        sys.exit(child.returncode or (0 if len(notifs) == 3 else 1))
    work = Path(a.dir)
    remote = agent.add_remote_agent((work / "md").read_bytes())
    r = json.loads((work / "addr").read_text())
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(descs(addr, rows, a.block_len, dev), a.mem))
    remote_h = agent.prep_xfer_dlist(remote, agent.get_xfer_descs(descs(r["addr"], rows, a.block_len, r["dev"]), a.mem))
    ok = True
    for name, nblocks, order in (("contiguous", 64, 1), ("descending", 63, -1), ("descending", 64, -1)):
        remote_ids = list(range(nblocks))[::order]
        local_ids = list(range(a.pool_blocks - nblocks, a.pool_blocks))
        idx = lambda ids: np.array([li * a.pool_blocks + b for li in range(a.layers) for b in ids])  # noqa: E731
        t0 = time.monotonic_ns()
        h = agent.make_prepped_xfer("READ", local_h, idx(local_ids), remote_h, idx(remote_ids), notif_msg=name.encode())
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        wall_us = (time.monotonic_ns() - t0) / 1e3
        tel = agent.get_xfer_telemetry(h)
        agent.release_xfer_handle(h)
        if a.mem == "VRAM":
            import torch

            torch.cuda.synchronize()
        rows_l, rows_r = idx(local_ids), idx(remote_ids)
        got = np.asarray(buf[rows_l.tolist(), 0].cpu()) if a.mem == "VRAM" else buf[rows_l, 0]
        expect = ((rows_r * 13 + 1) % 251).astype(np.uint8)  # every layer's rows, first byte of each
        good = state == "DONE" and bool((got == expect).all())
        ok &= good
        print(json.dumps({
            "read": name, "blocks": nblocks, "descs_asked": nblocks * a.layers, "state": state, "data_ok": good,
            "descCount": tel.descCount, "totalBytes": tel.totalBytes, "expected_bytes": nblocks * a.layers * a.block_len,
            "postDuration_us": tel.postDuration, "xferDuration_us": tel.xferDuration, "wall_us": round(wall_us),
        }))  # fmt: skip
    after = entry_bytes()
    patched = sorted(n for n in after if before.get(n) != after[n])
    hook_mode = os.environ.get("UCX_MEM_CUDA_HOOK_MODE", "(default)")
    print(json.dumps({"role": "initiator", "UCX_MEM_CUDA_HOOK_MODE": hook_mode, "entries_patched_by_ucx": patched,
                      "entries": after, **loaded_libs()}))  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
EOF
}
write_device_files "$carry"
(cd "$carry" && sha256sum ./*.whl install_nixl.sh nixl_check.py >SHA256SUMS)

# What travels: the tree (tracked + untracked-not-ignored files, shared/ if the checkout has one) with each call.
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
if git check-ignore -q "$carry/SHA256SUMS"; then ignored=yes; else ignored=NO; fi
echo "== sizes"
printf '   %-56s %6s MiB\n' "nixl-cu13 + nixl $ver wheels, installer, check" "$(mb "$wheels")" \
    "the tree that travels with every call" "$(mb "$tree")" \
    "a call carrying carry/ (limit 64)" "$(mb $((wheels + tree)))" \
    "vLLM call 3 (part 02 + make_tiny_model.py + tree)" "$(mb $((part02 + tiny + tree)))"
echo "   $carry ignored by git: $ignored"
[ "$ignored" = yes ] || { echo "!! $carry is not ignored: it would travel with every call" >&2; exit 1; }
[ "$part02" -gt 0 ] || echo "   (no .vllm-bundle/parts/bundle.part02 here: build the vLLM bundle first)"

mode=carry
if [ "${FORCE_PARTS:-0}" = 1 ] || [ $((wheels + tree)) -gt $((63 * mib)) ]; then
    mode=parts
    mkdir -p "$parts"
    tar -C "$carry" -cf - . | split -b 60M -d - "$parts/nixl.part"
    echo "== parts (plain tar: the wheels are zip-compressed already)"
    ls -l "$parts" | sed 's/^/   /'
    mkdir -p "$tmp/re"
    cat "$parts"/nixl.part* | tar -xf - -C "$tmp/re"
    (cd "$tmp/re" && sha256sum -c --quiet SHA256SUMS)
    echo "   the parts reassemble into $(ls "$tmp/re" | wc -l) files whose checksums match"
fi

if [ "$slim" = 1 ]; then
    # The wheels unpacked, less what NixlConnector never loads: nixl_ep_cu13 (torch 2.12-2.14 builds only), the
    # build-time headers/pkgconfig/scripts (*.data, *.scripts). Deterministic: sorted names, fixed times and owners,
    # single-threaded xz. The dist-info folders stay (importlib.metadata), their RECORD then lists more than is there.
    mkdir -p "$slimdir" "$tmp/s"
    cp -a "$tmp/x/." "$tmp/m/." "$tmp/s/"
    rm -rf "$tmp/s/nixl_ep_cu13" "$tmp/s"/nixl_cu13-*.data "$tmp/s"/nixl_cu13.scripts
    echo "== slim: $(du -sm "$tmp/s" | cut -f1) MB unpacked, xz -6 single-threaded ..."
    tar -C "$tmp/s" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --mode=u+rwX,go+rX,go-w -cf - . \
        | nice -n 19 xz -6 -T1 -c >"$slimdir/nixl-site.tar.xz"
    write_device_files "$slimdir"
    (cd "$slimdir" && sha256sum nixl-site.tar.xz install_nixl.sh nixl_check.py >SHA256SUMS)
    slimsize=$(size "$slimdir"/*)
    printf '   %-56s %6s MiB\n' "slim/ (nixl-site.tar.xz, installer, check)" "$(mb "$slimsize")" \
        "vLLM call 3 with slim/ in it (limit 64)" "$(mb $((part02 + tiny + tree + slimsize)))"
    [ $((part02 + tiny + tree + slimsize)) -le $((63 * mib)) ] || echo "!! slim/ does not fit in call 3: use carry/"
    sed 's/^/   /' "$slimdir/SHA256SUMS"
fi

sed 's/^/   /' "$carry/SHA256SUMS"
q='"'
echo
echo "== device calls (back to back: the machine keeps /tmp only while warm, 30 s after a call)"
echo "   1-2. as for vLLM alone: carry [${q}.vllm-bundle/parts/bundle.part00${q}] (then part01)"
echo "        command: bash tests/gpu/run_vllm_on_device.sh part 00   (then 01)"
if [ "$slim" = 1 ]; then
    echo "   3.   carry [${q}.vllm-bundle/parts/bundle.part02${q}, ${q}.vllm-bundle/make_tiny_model.py${q}, ${q}$slimdir${q}]"
    echo "        command: bash tests/gpu/run_vllm_on_device.sh unpack 02 && bash $slimdir/install_nixl.sh"
    echo "        (or, without slim/: call 3 as for vLLM alone, then call 3b below)"
else
    echo "   3.   carry [${q}.vllm-bundle/parts/bundle.part02${q}, ${q}.vllm-bundle/make_tiny_model.py${q}]"
    echo "        command: bash tests/gpu/run_vllm_on_device.sh unpack 02"
fi
if [ "$mode" = parts ]; then
    for p in "$parts"/nixl.part*; do
        echo "   3b.  carry [${q}$p${q}]: command: mkdir -p /tmp/nb && cp $p /tmp/nb/"
    done
    echo "        the last one instead: ... && mkdir -p /tmp/nc && cat /tmp/nb/nixl.part* | tar -xf - -C /tmp/nc && bash /tmp/nc/install_nixl.sh"
else
    echo "   3b.  carry [${q}$carry${q}]: command: bash $carry/install_nixl.sh"
fi
echo "        (sha256sum -c; pip install --no-index --no-deps --target /tmp/vsite, or the slim tar; then two processes"
echo "         on the GPU READ 64/63/64 blocks of 16 x 32 KiB from each other through NIXL/UCX with vLLM's agent"
echo "         config, data checked, NIXL telemetry and UCX's protocol choice printed: \$OUT/nixl_install.txt)"
echo "   4.   the P/D run (kvwatch: carry [${q}.gpu-bundle${q}, ${q}.whl${q}]): prefill and decode started one after the"
echo "        other as tests/gpu/nixl_notes.md writes them, PYTHONPATH=/tmp/vsite, then tests/gpu/pd_proxy.py, then load."
