#!/usr/bin/env bash
# kvwatch's cost to a real vLLM 0.26.0 on the lent H200 (bench/bench_engine_cost.py): ONE device call
# after the vLLM bundle is unpacked. Back to back (the machine keeps /tmp only while it stays warm):
#
#   1-2. carry [".vllm-bundle/parts/bundle.part00"], command: bash tests/gpu/run_vllm_on_device.sh part 00   (then 01)
#   3.   carry [".vllm-bundle/parts/bundle.part02", ".vllm-bundle/make_tiny_model.py", ".tools/py-spy"]
#        command: bash tests/gpu/run_vllm_on_device.sh unpack 02
#   4.   carry [".gpu-bundle", ".whl"], timeout_s 600,
#        command: bash tests/gpu/run_engine_cost_on_device.sh
#        (knobs, as environment in front: PAIRS=8 ROUND_SECONDS=16 SETTLE=3 DATASET=prefix_repetition
#         CONCURRENCY=16 DEADLINE=565 PIN= PROFILE_AT=150 BPF_STATS_ROUND=1 (empty: none); ARGS="..." for any other flag of the bench: ARGS="--num-prompts 640"
#         fixes the round size, so that every round's requests are sampled while vLLM starts)
#
# In the call: the bench starts vLLM at once (prefix caching, the CPU offloading connector, KV events,
# /tmp/tiny with dummy weights: tests/gpu/vllm_harness.vllm_argv) and imports vLLM's client while it
# starts (~50 s of the ~90-100 s to /health); meanwhile this script installs kvwatch's wheels and
# unpacks bcc, which kvwatch's first start (after /health and a warm-up round) needs. Then ABBA pairs
# until the deadline. Comes back in $OUT: engine_cost.json, engine_cost.md, engine_cost_logs.tar.gz, daemon_profile.tar.gz.
set -uo pipefail
# after the pairs, one on round with the kernel's BPF statistics on (each program's time; in no ratio)
BPF_STATS_ROUND=${BPF_STATS_ROUND-1}
# engine:client:daemon CPUs (e.g. PIN=0-7:8-11:12-15): none by default; pinned so on the H200 the engine
# served 27-40 requests/s instead of 42-52, with wider intervals (bench/results/h200-2026-12-03-engine-cost)
PIN=${PIN-}
out=${OUT:-/tmp/out}
mkdir -p "$out"
here=$PWD

# kvwatch runs with bcc's libraries; the bench, its client and vLLM run without them
cat > /tmp/kvwatch-daemon <<LAUNCH
#!/usr/bin/env bash
export PYTHONPATH=/tmp/kvpkg:/tmp/site:$here PYTHONUNBUFFERED=1
exec $here/.gpu-bundle/with-bcc python3 -m kvwatch.daemon "\$@"
LAUNCH
chmod +x /tmp/kvwatch-daemon

PYTHONPATH=/tmp/vsite:$here HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 python3 bench/bench_engine_cost.py \
    --engine vllm --client vllm --out "$out" --work /tmp/kvw-engine-cost --kvwatch-cmd /tmp/kvwatch-daemon \
    --pairs "${PAIRS:-8}" --round-seconds "${ROUND_SECONDS:-16}" --settle "${SETTLE:-3}" \
    --dataset "${DATASET:-prefix_repetition}" --concurrency "${CONCURRENCY:-16}" --deadline "${DEADLINE:-565}" \
    ${PIN:+--pin "$PIN"} ${BPF_STATS_ROUND:+--bpf-stats-round} ${ARGS:-} > /tmp/engine_cost.log 2>&1 &
bench=$!

if [ ! -e /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.done
fi
mkdir -p /tmp/kvpkg/kvwatch
for d in daemon probes exporters; do ln -sfn "$here/$d" "/tmp/kvpkg/kvwatch/$d"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
PYTHONPATH=/tmp/kvpkg:/tmp/site:$here .gpu-bundle/with-bcc python3 -c 'import bcc, kvwatch.probes.cuda; print("bcc", bcc.__version__)' \
    || { echo "bcc or kvwatch does not import: stopping the bench"; kill "$bench"; }
# Where the daemon's own CPU goes under the load: py-spy (carried to /tmp/pyspy by the unpack call, when
# it was) samples the first daemon started after PROFILE_AT s through its whole life, in consecutive
# chunks of PROFILE_CHUNK s (its start round, then its kept round), with its threads' CPU from /proc at
# every chunk's start. Without py-spy, the threads' CPU alone.
prof=/tmp/kvw-daemon-profile
mkdir -p "$prof"
threads_cpu() {  # tid, utime+stime ticks, name
    for t in /proc/$1/task/*; do printf '%s %s %s\n' "${t##*/}" "$(awk '{print $14+$15}' "$t/stat")" "$(tr ' ' _ < "$t/comm")"; done 2>/dev/null
}
profile_daemon() {
    local pid="" age k=0
    sleep "${PROFILE_AT:-150}"
    for _ in $(seq 200); do  # a daemon younger than 6 s: its life from the start
        pid=$(pgrep -nf -- '-m kvwatch[.]daemon' || true)
        age=$( [ -n "$pid" ] && ps -o etimes= -p "$pid" | tr -d ' ')
        [ -n "$pid" ] && [ -n "$age" ] && [ "$age" -lt 6 ] && break
        pid=""; sleep 1
    done
    [ -n "$pid" ] || { echo "no daemon" > "$prof/none.txt"; return; }
    while [ -d "/proc/$pid" ] && [ "$k" -lt 12 ]; do
        { echo "chunk $k at $(date +%s.%N) age $(ps -o etimes= -p "$pid")"; threads_cpu "$pid"; } >> "$prof/threads.txt"
        python3 -c "import sys, urllib.request as u; sys.stdout.buffer.write(u.urlopen('http://127.0.0.1:9740/metrics', timeout=2).read())" \
            > "$prof/metrics_$k.txt" 2>/dev/null
        if [ -x /tmp/pyspy/py-spy ]; then
            [ "$k" = 2 ] && /tmp/pyspy/py-spy dump -p "$pid" > "$prof/dump.txt" 2>&1
            /tmp/pyspy/py-spy record -p "$pid" -d "${PROFILE_CHUNK:-6}" -r 67 --threads --nonblocking -f raw \
                -o "$prof/chunk_$k.txt" > /dev/null 2>&1
        else
            sleep "${PROFILE_CHUNK:-6}"
        fi
        k=$((k + 1))
    done
}
( profile_daemon ) > /dev/null 2>&1 &
profiler=$!
wait "$bench"
echo "bench exit $?"
pkill -P "$profiler" 2>/dev/null; kill "$profiler" 2>/dev/null
tar -C "$prof" -czf "$out/daemon_profile.tar.gz" . # at most 8 files come back from $OUT
tail -c 9000 /tmp/engine_cost.log
