#!/usr/bin/env bash
# SoftRoCE VM harness: run a command next to real `rxe0` and `rxe1` verbs devices.
#
# The host kernel has no InfiniBand support, so the SoftRoCE driver (rdma_rxe) cannot load
# here. This script boots a stock Debian kernel in a small emulated VM with virtme-ng (`vng`),
# which shares the host's root file system (read-only) with the guest: binaries built on the
# host under target/ run unchanged inside the VM. Inside, it loads rdma_rxe, creates rxe0 on a
# dummy network device dummy0 (10.200.0.1) and rxe1 on a second one, dummy1 (10.201.0.1); both
# addresses exist only inside the VM. Then it runs the command.
#
# Usage: tools/softroce/run.sh [--] CMD [ARGS...]
#        tools/softroce/run.sh --prepare    # installs and fetches what a boot needs, boots nothing
#
# CMD runs in the repository root with KVLINK_SOFTROCE=1, KVLINK_RDMA_DEVICE=rxe0,
# KVLINK_RDMA_DEVICES=rxe0,rxe1 and the SOFTROCE_* variables below exported; the script exits
# with CMD's exit status, or with 125 when the VM or the rxe0 setup failed (124 when the time
# limit was hit). rxe1 is optional: when its setup fails the script logs why and runs CMD with
# rxe0 only, without KVLINK_RDMA_DEVICES.
#
# Must run as root (it installs Debian packages and puts the guest kernel's modules under
# /lib/modules). Everything else is cached under <repo>/.vm (git-ignored); a second run only
# boots the VM. Build test binaries on the host first: do not compile inside the emulated VM.
#
# Environment (all optional):
#   SOFTROCE_MEMORY     guest memory (default 2G)
#   SOFTROCE_CPUS       guest CPUs (default 2)
#   SOFTROCE_TIMEOUT    time limit for the whole VM run in seconds (default 1200)
#   SOFTROCE_BOOT_TIMEOUT  seconds the guest has to reach its own script (default 180); an
#                       emulated boot hangs now and then (about one boot in ten on these
#                       machines): such a VM is killed and booted again
#   SOFTROCE_BOOT_TRIES how many boots to try (default 2)
#   SOFTROCE_VM_DIR     cache directory (default <repo>/.vm)
#   SOFTROCE_VNG_VERSION  virtme-ng version installed from PyPI (default 1.42)
#   SOFTROCE_PASS_ENV   extra host variable names to pass into the VM (space separated);
#                       KVLINK_* and RUST_* variables are always passed
#   SOFTROCE_VERBOSE    set to 1 to show the guest kernel's boot log (vng --verbose)
#   SOFTROCE_RWDIRS     host directories the guest may write to (space separated); everything
#                       else except /tmp (a throw-away overlay) is read-only in the guest
set -euo pipefail

SCRIPT_PATH=$(readlink -f "${BASH_SOURCE[0]}")
SCRIPT_DIR=$(dirname "$SCRIPT_PATH")
REPO=$(cd "$SCRIPT_DIR/../.." && pwd)

VM_DIR=${SOFTROCE_VM_DIR:-$REPO/.vm}
VM_MEMORY=${SOFTROCE_MEMORY:-2G}
VM_CPUS=${SOFTROCE_CPUS:-2}
VM_TIMEOUT=${SOFTROCE_TIMEOUT:-1200}
BOOT_TIMEOUT=${SOFTROCE_BOOT_TIMEOUT:-180}
BOOT_TRIES=${SOFTROCE_BOOT_TRIES:-2}
VNG_VERSION=${SOFTROCE_VNG_VERSION:-1.42}

# The guest side of the RoCE setup: one rxe device per dummy netdev. GID index 1 is the
# IPv4-mapped RoCE v2 GID of the device's address. rxe0 is required, rxe1 is optional.
RXE_DEVICE=rxe0
RXE_NETDEV=dummy0
RXE_ADDR=10.200.0.1
RXE1_DEVICE=rxe1
RXE1_NETDEV=dummy1
RXE1_ADDR=10.201.0.1
RXE_GID_INDEX=1

# Exit status when the harness itself (not the command) failed.
EXIT_HARNESS=125

APT_PACKAGES=(
    qemu-system-x86 busybox-static kmod iproute2 file
    rdma-core ibverbs-providers libibverbs1 ibverbs-utils perftest
    python3 python3-venv
)

log() { echo "softroce: $*" >&2; }
die() { log "error: $*"; exit "$EXIT_HARNESS"; }

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT_PATH"
}

# ---------------------------------------------------------------------------------------------
# Host side: installation (idempotent, quick when everything is already there)
# ---------------------------------------------------------------------------------------------

APT_UPDATED=0
apt_update_once() {
    if [[ $APT_UPDATED == 0 ]]; then
        log "apt-get update"
        apt-get update -q -o DPkg::Lock::Timeout=600 >/dev/null || die "apt-get update failed"
        APT_UPDATED=1
    fi
}

is_installed() {
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

ensure_packages() {
    local pkg missing=()
    for pkg in "${APT_PACKAGES[@]}"; do
        is_installed "$pkg" || missing+=("$pkg")
    done
    [[ ${#missing[@]} == 0 ]] && return
    apt_update_once
    log "installing ${missing[*]}"
    # The test command installs into the venvs meanwhile; another apt-get may hold the lock.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 \
        --no-install-recommends "${missing[@]}" \
        >"$VM_DIR/apt-install.log" 2>&1 \
        || { tail -n 20 "$VM_DIR/apt-install.log" >&2; die "apt-get install failed (log: $VM_DIR/apt-install.log)"; }
}

# virtme-ng from PyPI, in a venv under the cache directory.
ensure_vng() {
    local venv=$VM_DIR/venv python=python3
    [[ -x /usr/bin/python3 ]] && python=/usr/bin/python3   # Debian's, which has venv support
    if ! [[ -x $venv/bin/vng ]] || [[ $("$venv/bin/vng" --version 2>/dev/null) != "virtme-ng $VNG_VERSION" ]]; then
        log "installing virtme-ng $VNG_VERSION into $venv"
        "$python" -m venv --clear "$venv" || die "cannot create a python venv at $venv"
        "$venv/bin/pip" install -q --disable-pip-version-check "virtme-ng==$VNG_VERSION" \
            || die "pip install virtme-ng==$VNG_VERSION failed"
    fi
    # vng calls virtme-run by name.
    PATH=$venv/bin:$PATH
}

# The Debian kernel that linux-image-amd64 points to (pinned in $VM_DIR/kernel/version on first
# use; delete $VM_DIR/kernel to move to a newer one). Its image is kept in $VM_DIR/kernel and its
# modules go to /lib/modules/<version> on the host, where the guest (which sees the host's root
# file system) finds them. Sets KERNEL_VERSION and KERNEL_IMAGE.
ensure_kernel() {
    local kdir=$VM_DIR/kernel ver="" pkg deb unpack mods
    mkdir -p "$kdir"
    [[ -f $kdir/version ]] && ver=$(<"$kdir/version")
    if [[ -n $ver && -f $kdir/vmlinuz-$ver && -f /lib/modules/$ver/modules.dep ]]; then
        KERNEL_VERSION=$ver
        KERNEL_IMAGE=$kdir/vmlinuz-$ver
        return
    fi

    if [[ -z $ver ]]; then
        apt_update_once
        pkg=$(apt-cache depends linux-image-amd64 \
            | awk '$1 ~ /Depends:$/ && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
        [[ -n $pkg ]] || die "cannot find the kernel package that linux-image-amd64 depends on"
        ver=${pkg#linux-image-}
    fi
    pkg=linux-image-$ver

    deb=$(find "$kdir" -maxdepth 1 -name "${pkg}_*.deb" | head -n 1)
    if [[ -z $deb ]]; then
        apt_update_once
        log "downloading $pkg"
        # apt warns that it downloads as root ("unsandboxed"): expected here.
        (cd "$kdir" && apt-get download -q "$pkg" 2>&1 | grep -v unsandboxed >&2) || true
        deb=$(find "$kdir" -maxdepth 1 -name "${pkg}_*.deb" | head -n 1)
        [[ -n $deb ]] || die "apt-get download $pkg failed"
    fi

    # Unpack without installing (a real install would run boot-loader hooks).
    log "unpacking $(basename "$deb")"
    unpack=$(mktemp -d "$kdir/unpack.XXXXXX")
    dpkg-deb -x "$deb" "$unpack" || die "dpkg-deb -x $deb failed"
    cp "$unpack/boot/vmlinuz-$ver" "$kdir/vmlinuz-$ver" || die "no vmlinuz-$ver in $deb"
    if ! [[ -f /lib/modules/$ver/modules.dep ]]; then
        mods=$unpack/lib/modules/$ver
        [[ -d $mods ]] || mods=$unpack/usr/lib/modules/$ver
        [[ -d $mods ]] || die "no modules for $ver in $deb"
        log "installing modules into /lib/modules/$ver"
        mkdir -p /lib/modules
        rm -rf "/lib/modules/$ver"   # left over from an interrupted run
        mv "$mods" "/lib/modules/$ver"
        depmod "$ver" || die "depmod $ver failed"
    fi
    # The unpacked tree must go: vng looks for lib/modules near the kernel image and would
    # use that instead of /lib/modules.
    rm -rf "$unpack"
    modinfo -k "$ver" rdma_rxe >/dev/null 2>&1 || die "kernel $ver has no rdma_rxe module"
    echo "$ver" >"$kdir/version"

    KERNEL_VERSION=$ver
    KERNEL_IMAGE=$kdir/vmlinuz-$ver
}

# ---------------------------------------------------------------------------------------------
# Host side: boot the VM
# ---------------------------------------------------------------------------------------------

# Writes the files the guest reads from RUN_DIR: env.sh (variables to export) and cmd.sh (the
# command as a bash array, so that any quoting survives).
write_guest_files() {
    local name
    {
        # Variables passed through from the host.
        while read -r name; do
            printf 'export %s=%q\n' "$name" "${!name}"
        done < <(compgen -e | grep -E '^(KVLINK_|RUST_)' || true)
        for name in HOME ${SOFTROCE_PASS_ENV:-}; do
            if [[ -v $name ]]; then printf 'export %s=%q\n' "$name" "${!name}"; fi
        done
        # The guest's PATH: the usual system directories first, then the host's.
        printf 'export PATH=%q\n' "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"
        # What the tests need to find the device (these win over host values).
        printf 'export KVLINK_SOFTROCE=1\n'
        printf 'export KVLINK_RDMA_DEVICE=%s\n' "$RXE_DEVICE"
        printf 'export SOFTROCE_ADDR=%s\n' "$RXE_ADDR"
        printf 'export SOFTROCE_GID_INDEX=%s\n' "$RXE_GID_INDEX"
        printf 'export SOFTROCE_DIR=%q\n' "$SCRIPT_DIR"
    } >"$RUN_DIR/env.sh"
    local -a GUEST_CMD=("$@")
    declare -p GUEST_CMD >"$RUN_DIR/cmd.sh"
}

# Forwarded to the VM on Ctrl-C / SIGTERM (timeout runs it in its own process group).
VM_PID=""
INTERRUPTED=0
forward_signal() {
    log "interrupted, stopping the VM"
    INTERRUPTED=1
    [[ -n $VM_PID ]] && kill -TERM "$VM_PID" 2>/dev/null
}

# Boots the VM and runs this script's guest side in it. Sets VNG_STATUS to the exit status of
# `timeout vng ...`, and BOOT_HUNG to 1 when the guest did not reach its script within
# BOOT_TIMEOUT seconds (the VM is then killed).
boot_vm() {
    local vng_args=(
        --run "$KERNEL_IMAGE"
        --disable-kvm            # KVM guests hang at boot on these machines
        --force-9p               # no virtiofsd here; skips vng's wait for it
        --memory "$VM_MEMORY" --cpus "$VM_CPUS"
        --name softroce
        --cwd "$REPO"
        --rwdir "$RUN_DIR"       # where the guest writes its status file
    )
    [[ ${SOFTROCE_VERBOSE:-0} == 1 ]] && vng_args+=(--verbose)
    local dir
    for dir in ${SOFTROCE_RWDIRS:-}; do
        vng_args+=(--rwdir "$(readlink -f "$dir")")
    done
    # Kept short: vng passes it on the kernel command line.
    vng_args+=(--exec "bash $SCRIPT_PATH --in-vm $RUN_DIR")

    # qemu opens /proc/self/fd/1 and /proc/self/fd/2 by name several times; when they are
    # regular files (CI logs) the opens truncate and overwrite each other. Give it a pipe.
    local out cat_pid
    exec {out}> >(cat)
    cat_pid=$!

    # timeout runs vng (and qemu) in a process group of its own and kills all of it at the
    # limit. vng gets no stdin: CI has none, and the guest command should not need one.
    timeout --kill-after=30 "$VM_TIMEOUT" vng "${vng_args[@]}" </dev/null >&"$out" 2>&1 &
    VM_PID=$!
    exec {out}>&-
    trap forward_signal INT TERM HUP

    # The boot watchdog: the guest's first step writes RUN_DIR/booted.
    BOOT_HUNG=0
    local boot_start=$SECONDS
    while kill -0 "$VM_PID" 2>/dev/null; do
        if [[ $BOOT_HUNG == 0 && ! -f $RUN_DIR/booted ]] && ((SECONDS - boot_start > BOOT_TIMEOUT)); then
            log "the VM did not boot within ${BOOT_TIMEOUT}s (SOFTROCE_BOOT_TIMEOUT); killing it"
            BOOT_HUNG=1
            kill -TERM "$VM_PID" 2>/dev/null || true
        fi
        sleep 1
    done
    VNG_STATUS=0
    while true; do
        wait "$VM_PID" && VNG_STATUS=0 || VNG_STATUS=$?
        # wait returns early (status > 128) when a trapped signal arrives; wait again.
        kill -0 "$VM_PID" 2>/dev/null || break
    done
    trap - INT TERM HUP
    wait "$cat_pid" || true
}

host_main() {
    [[ $(id -u) == 0 ]] || die "must run as root (installs packages, writes /lib/modules)"
    [[ $# -gt 0 ]] || { usage >&2; exit 2; }

    local start=$SECONDS
    mkdir -p "$VM_DIR"
    ensure_packages
    ensure_vng
    ensure_kernel

    mkdir -p "$VM_DIR/run"
    RUN_DIR=$(mktemp -d "$VM_DIR/run/XXXXXX")
    trap 'rm -rf "$RUN_DIR"' EXIT
    write_guest_files "$@"

    local boot_start try
    for ((try = 1; ; try++)); do
        log "booting kernel $KERNEL_VERSION (memory $VM_MEMORY, $VM_CPUS CPUs, limit ${VM_TIMEOUT}s, try $try of $BOOT_TRIES)"
        rm -f "$RUN_DIR/booted" "$RUN_DIR/status"
        boot_start=$SECONDS
        boot_vm
        [[ $BOOT_HUNG == 1 && $INTERRUPTED == 0 ]] || break
        ((try < BOOT_TRIES)) || die "the VM did not boot in $BOOT_TRIES tries of ${BOOT_TIMEOUT}s each; rerun with SOFTROCE_VERBOSE=1 for the kernel log"
    done
    local took=$((SECONDS - boot_start))

    if [[ $INTERRUPTED == 1 ]]; then
        log "error: stopped by a signal after ${took}s"
        exit 130
    fi
    local status=""
    [[ -f $RUN_DIR/status ]] && status=$(<"$RUN_DIR/status")
    if [[ $VNG_STATUS == 124 || $VNG_STATUS == 137 ]]; then
        log "error: the VM hit the time limit of ${VM_TIMEOUT}s (SOFTROCE_TIMEOUT) and was killed"
        exit 124
    fi
    case $status in
        '')
            die "the VM did not run the command (vng exited with $VNG_STATUS after ${took}s); see the output above, rerun with SOFTROCE_VERBOSE=1 for the kernel log" ;;
        setup-failed)
            die "rxe0 setup failed inside the VM; see the output above" ;;
        *[!0-9]*)
            die "unexpected status '$status' from the VM" ;;
    esac
    log "command exited with $status (VM run ${took}s, total $((SECONDS - start))s)"
    exit "$status"
}

# ---------------------------------------------------------------------------------------------
# Guest side (run inside the VM by host_main through `vng --exec`)
# ---------------------------------------------------------------------------------------------

# Creates rxe device DEVICE on a new dummy netdev NETDEV with address ADDR/24 and waits until
# it is usable. Logs why and returns 1 when a step fails.
add_rxe() {
    local dev=$1 netdev=$2 addr=$3
    ip link add "$netdev" type dummy || { log "ip link add $netdev type dummy failed"; return 1; }
    ip addr add "$addr/24" dev "$netdev" || { log "ip addr add $addr/24 dev $netdev failed"; return 1; }
    ip link set "$netdev" up || { log "ip link set $netdev up failed"; return 1; }
    rdma link add "$dev" type rxe netdev "$netdev" \
        || { log "rdma link add $dev type rxe netdev $netdev failed"; return 1; }

    # The IPv4-mapped GID shows up shortly after the link is created.
    local gid_file=/sys/class/infiniband/$dev/ports/1/gids/$RXE_GID_INDEX gid="" i
    for ((i = 0; i < 100; i++)); do
        gid=$(cat "$gid_file" 2>/dev/null || true)
        [[ -n $gid && $gid != 0000:0000:0000:0000:0000:0000:0000:0000 ]] && break
        gid=""
        sleep 0.1
    done
    [[ -n $gid ]] || { log "$dev has no GID at index $RXE_GID_INDEX"; return 1; }
    # Fails when the user-space rxe provider (ibverbs-providers) is missing.
    ibv_devinfo -d "$dev" >/dev/null || { log "ibv_devinfo cannot open $dev"; return 1; }

    local uptime
    read -r uptime _ </proc/uptime
    log "$dev up (gid $gid, index $RXE_GID_INDEX, $addr on $netdev; guest up ${uptime}s)"
}

# rxe0 (required). Returns 1 when it cannot be set up.
setup_rxe() {
    modprobe rdma_rxe || { log "modprobe rdma_rxe failed"; return 1; }
    add_rxe "$RXE_DEVICE" "$RXE_NETDEV" "$RXE_ADDR"
}

# rxe1 (optional): exports KVLINK_RDMA_DEVICES when it is up; otherwise logs why and unsets it
# (a value passed in from the host would name a device that is not there).
setup_rxe1() {
    if add_rxe "$RXE1_DEVICE" "$RXE1_NETDEV" "$RXE1_ADDR"; then
        export KVLINK_RDMA_DEVICES=$RXE_DEVICE,$RXE1_DEVICE
    else
        log "$RXE1_DEVICE setup failed (see above); going on with $RXE_DEVICE only, KVLINK_RDMA_DEVICES not set"
        unset KVLINK_RDMA_DEVICES
    fi
}

guest_main() {
    local run_dir=$1
    [[ -d $run_dir ]] || die "guest: no run directory $run_dir"
    : >"$run_dir/booted"
    # shellcheck source=/dev/null
    source "$run_dir/env.sh"
    if ! setup_rxe; then
        echo setup-failed >"$run_dir/status"
        exit "$EXIT_HARNESS"
    fi
    setup_rxe1
    # shellcheck source=/dev/null
    source "$run_dir/cmd.sh"   # defines GUEST_CMD
    cd "$REPO"
    log "running: ${GUEST_CMD[*]@Q}"
    local rc=0
    "${GUEST_CMD[@]}" || rc=$?
    echo "$rc" >"$run_dir/status"
    exit "$rc"
}

# ---------------------------------------------------------------------------------------------

# Everything a boot needs, installed and fetched, and no boot: the test command runs it while
# it compiles, so that the VM part only boots.
prepare_main() {
    [[ $(id -u) == 0 ]] || die "must run as root (installs packages, writes /lib/modules)"
    mkdir -p "$VM_DIR"
    ensure_packages
    ensure_vng
    ensure_kernel
    log "ready to boot kernel $KERNEL_VERSION"
}

case ${1:-} in
    --in-vm) guest_main "$2" ;;
    --prepare) prepare_main ;;
    -h | --help) usage ;;
    --) shift; host_main "$@" ;;
    *) host_main "$@" ;;
esac
