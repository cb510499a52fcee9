#!/usr/bin/env bash
# kvwatch set-up for a fresh Debian/Ubuntu machine, then an action.
#
#   sudo deploy/setup.sh run  [kvwatch run flags...]   set up, then `kvwatch run` in the foreground
#   sudo deploy/setup.sh test [pytest args...]         set up (with test tools), then lint + the whole test suite
#   sudo deploy/setup.sh install                        set up in /opt/kvwatch/venv, install the systemd unit
#   sudo deploy/setup.sh                                set up only
#
# Idempotent: a second call only checks. Installs bcc from the distribution
# (python3-bpfcc), kernel headers (matching, or the distribution's generic tree
# linked in), mounts tracefs, builds .venv on /usr/bin/python3 with system site
# packages (bcc imports only there) and installs kvwatch into it.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
action=${1:-setup}
[ $# -gt 0 ] && shift
venv="$here/.venv"
[ "$action" = install ] && venv=/opt/kvwatch/venv  # the path deploy/systemd/kvwatch.service runs
say() { printf 'kvwatch-setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (BPF, tracefs and apt need it): sudo $0 $action"
command -v apt-get >/dev/null || die "this script knows apt (Debian/Ubuntu); install python3-bpfcc and kernel headers by hand"

export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_install() {
    local missing=()
    for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ $apt_updated = 0 ]; then apt-get update -qq; apt_updated=1; fi
    say "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# --- bcc and the interpreter it imports under --------------------------------
apt_install python3-bpfcc python3-venv python3-pip ca-certificates kmod
/usr/bin/python3 -c 'import bcc' 2>/dev/null || die "python3-bpfcc is installed but 'import bcc' fails under /usr/bin/python3"

# --- kernel headers ------------------------------------------------------------
kver=$(uname -r)
build="/lib/modules/$kver/build"
if [ ! -e "$build/include/linux/kconfig.h" ]; then
    if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
        apt_install "linux-headers-$kver"
    else
        meta=linux-headers-amd64
        . /etc/os-release
        [ "${ID:-}" = ubuntu ] && meta=linux-headers-generic
        [ "$(uname -m)" = aarch64 ] && { [ "${ID:-}" = ubuntu ] && meta=linux-headers-generic || meta=linux-headers-arm64; }
        apt_install "$meta"
        tree=$(ls -d /usr/src/linux-headers-*-"${meta#linux-headers-}" 2>/dev/null | sort -V | tail -n1)
        [ -n "$tree" ] || tree=$(ls -d /usr/src/linux-headers-*-generic 2>/dev/null | sort -V | tail -n1)
        [ -n "$tree" ] || die "no kernel header tree under /usr/src after installing $meta"
        common="${tree%-*}-common"
        [ -d "$common" ] || common=$tree
        mkdir -p "/lib/modules/$kver"
        ln -sfn "$tree" "$build"
        ln -sfn "$common" "/lib/modules/$kver/source"
        say "warning: no headers package matches kernel $kver; linked $(basename "$tree") instead." \
            "Safe for kvwatch: its BPF code reads only tracepoint fields and probe arguments, never kernel struct layouts."
    fi
fi

# --- tracefs ---------------------------------------------------------------------
if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null \
        || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null \
        || die "cannot mount tracefs at /sys/kernel/tracing"
    say "mounted tracefs"
fi

# --- test-only tools -------------------------------------------------------------
if [ "$action" = test ]; then
    # prometheus + alertmanager (promtool checks, the alert path end to end), tmux (top in a
    # real terminal), iproute2 (namespaces, tc tbf), gcc (stub CUDA/NIXL/verbs/NCCL libraries),
    # libibverbs1 (a real verbs library to resolve), systemd (systemd-analyze verify on the unit),
    # bpftool (the kernel's own per-program statistics, ground truth for skipped probe runs)
    apt_install prometheus prometheus-alertmanager iproute2 tmux gcc libc6-dev binutils libibverbs1 systemd bpftool
fi

# --- virtualenv --------------------------------------------------------------------
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import bcc' 2>/dev/null; then
    rm -rf "$venv"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    say "created $venv on /usr/bin/python3 (system site packages, for bcc)"
fi
extras=""
[ "$action" = test ] && extras="[test]"
stamp="$venv/.kvwatch-installed"
want="$(sha256sum < "$here/pyproject.toml" | cut -c1-16)$extras"  # editable: only the metadata needs a reinstall
[ "$action" = install ] && rm -f "$stamp"  # a copy: always refresh it
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip setuptools >/dev/null
    # editable: src/ on the path (src/kvwatch links to daemon/, probes/, exporters/), so the tests,
    # mypy and the daemon read the checkout's files and a new module needs no reinstall
    if [ "$action" = install ]; then  # a service gets a copy, not links into this checkout
        "$venv/bin/python" -m pip install -q --disable-pip-version-check "$here" >/dev/null
    else
        "$venv/bin/python" -m pip install -q --disable-pip-version-check \
            -e "$here$extras" >/dev/null
    fi
    if [ "$action" = test ]; then
        # real transfer libraries, no GPU needed: NIXL with its bundled UCX and libibverbs, and
        # NCCL. --no-deps: nixl-cu12 declares torch, which these tests do not use.
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
            nixl-cu12==1.5.1 numpy==2.4.6 nvidia-nccl-cu12==2.32.3 >/dev/null
    fi
    echo "$want" > "$stamp"
    say "installed kvwatch into $venv"
fi

case "$action" in
    setup) say "ready: $venv/bin/kvwatch" ;;
    install)
        install -d -m 0755 /etc/kvwatch
        [ -e /etc/kvwatch/kvwatch.toml ] || install -m 0644 "$here/deploy/kvwatch.example.toml" /etc/kvwatch/kvwatch.toml
        install -m 0644 "$here/deploy/systemd/kvwatch.service" /etc/systemd/system/kvwatch.service
        if [ -d /run/systemd/system ]; then
            systemctl daemon-reload
            systemctl enable --now kvwatch
            say "kvwatch enabled and started: systemctl status kvwatch; journalctl -u kvwatch -o cat"
        else
            say "installed /etc/systemd/system/kvwatch.service; systemd is not running here: start $venv/bin/kvwatch run yourself"
        fi
        ;;
    run) exec "$venv/bin/kvwatch" run "$@" ;;
    test)
        cd "$here"
        "$venv/bin/ruff" check .
        "$venv/bin/mypy" -p kvwatch  # from src/ (pyproject's mypy_path)
        exec "$venv/bin/python" -m pytest "$@"
        ;;
    *) die "unknown action '$action' (setup | run | test)" ;;
esac
