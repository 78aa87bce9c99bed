#!/usr/bin/env bash
# build-image.sh CACHE_DIR [PROFILE] — builds a guest image from Debian bookworm packages.
#
# PROFILE `rdma` (the default): the Soft-RoCE guest, whose PID 1 is ./init. PROFILE `systemd`: the
# same root plus systemd, systemd-sysv and dbus, booted with systemd as PID 1 (rdinit=), where
# ./init runs as the unit linkpass-guest.service: the fleet packages' units are tried there under
# the init system they are written for.
#
# Prints one line on stdout, the result directory CACHE_DIR/<key>/ (CACHE_DIR/systemd-<key>/ for
# the systemd profile), holding
#   vmlinuz       the Debian 6.1 kernel (the newest linux-image-6.1.0-*-amd64 apt offers)
#   vmlinux       the same kernel uncompressed, for qemu's PVH boot (faster; absent if the
#                 payload could not be extracted)
#   initrd.img    the whole root (debootstrap minbase + rdma-core, pyverbs, iproute2, python3, ...)
#                 as a newc cpio compressed with zstd; the kernel unpacks it and runs ./init from it
#   manifest.json {"key", "profile", "kernel", "packages": {name: version}, "built_in_s", "sizes"}
# <key> is the first 16 hex digits of a sha256 over this script, init, guestctl.py and the package
# list, so a change to any of them builds a new image and an unchanged one is found again without
# the network. Progress goes to stderr; a missing package or a failed step ends with one line
# naming it and exit status 2. Run as root (debootstrap, chroot and device nodes need it).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SUITE=bookworm
MIRROR=${LINKPASS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# iproute2, procps and python3 are also what the fleet package depends on: it installs in both
# images (dpkg into this root; apt inside the systemd guest, which has no network to fetch them)
# perftest (ib_write_bw) and ibverbs-utils (ibv_rc_pingpong): verbs programs no one here wrote, which
# the steering shim (rdma/steer/) is tested under
REQUIRED_PACKAGES=(rdma-core ibverbs-providers ibverbs-utils perftest python3-pyverbs iproute2 procps kmod tcpdump python3)
# What the LinkPass agent imports when it runs inside a guest; left out (and said so) where the
# suite lacks one.
OPTIONAL_PACKAGES=(python3-pyroute2 python3-prometheus-client python3-yaml)
# The systemd profile's init system and its bus (systemd-analyze asks the manager over D-Bus).
SYSTEMD_PACKAGES=(systemd systemd-sysv dbus)
# Timers of the packages above that would wake under emulation for work a test guest never needs,
# and the gettys.
SYSTEMD_MASKED=(apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer systemd-tmpfiles-clean.timer
                dpkg-db-backup.timer
                # no login prompt on the console, whose lines the host reads (READY/FAIL)
                serial-getty@ttyS0.service getty@tty1.service)
# Modules init loads (and the crc32 the kernel asks for when rxe computes its ICRC); the build
# fails if the kernel has none of one of them. Their dependencies come along.
REQUIRED_MODULES=(virtio_pci virtio_net virtio_console 9pnet_virtio 9p rdma_rxe ib_uverbs crc32_generic)
# Kept when the kernel has them: RDMA CM and MAD access, the faster crc32, and qdiscs for faults
# made inside a guest. Every other module is dropped: the whole tree is 390 MB, and the initramfs
# lives in the guest's RAM.
OPTIONAL_MODULES=(rdma_ucm ib_umad crc32_pclmul sch_netem sch_tbf sch_htb)
TRIM=(usr/share/doc usr/share/man usr/share/info usr/share/locale usr/share/i18n usr/share/lintian
      usr/share/common-licenses var/cache/apt var/cache/debconf/templates.dat-old var/lib/apt/lists
      var/log boot usr/lib/udev/hwdb.d usr/lib/udev/hwdb.bin)   # hwdb: 22 MB for a udev that never runs

say() { printf 'build-image: %s\n' "$*" >&2; }

LOG=/dev/null
fail() {
    # The step's last output, then the one line that names what failed.
    if [[ -s $LOG ]]; then
        tail -n 15 "$LOG" | sed 's/^/  | /' >&2
    fi
    say "FAILED: $*"
    exit 2
}

[[ ($# -eq 1 || $# -eq 2) && -n $1 && $1 != -* ]] || { echo "usage: build-image.sh CACHE_DIR [rdma|systemd]" >&2; exit 2; }
CACHE=$(realpath -m -- "$1")
PROFILE=${2:-rdma}
case $PROFILE in
    rdma) NAME_PREFIX= ;;
    systemd) NAME_PREFIX=systemd-; REQUIRED_PACKAGES+=("${SYSTEMD_PACKAGES[@]}") ;;
    *) echo "build-image.sh: unknown profile $PROFILE (rdma or systemd)" >&2; exit 2 ;;
esac
for f in build-image.sh init guestctl.py; do
    [[ -f $HERE/$f ]] || fail "$HERE/$f is missing (the image is built from it)"
done
KEY=$( { cat "$HERE/build-image.sh" "$HERE/init" "$HERE/guestctl.py"
         printf '%s\n' "$PROFILE" "${REQUIRED_PACKAGES[@]}" -- "${OPTIONAL_PACKAGES[@]}"; } | sha256sum | cut -c1-16)
OUT=$CACHE/$NAME_PREFIX$KEY

if [[ -f $OUT/manifest.json ]]; then
    echo "$OUT"
    exit 0
fi

[[ $EUID -eq 0 ]] || fail "run as root: debootstrap, chroot and the root's device nodes need it"
mkdir -p "$CACHE"
# One builder per cache dir: a second one waits, then finds the first one's image.
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
    say "another build is running in $CACHE; waiting for it"
    flock 9
fi
if [[ -f $OUT/manifest.json ]]; then
    echo "$OUT"
    exit 0
fi
# Under the lock no other build is running, so any temp dir left here is a killed build's.
for stale in "$CACHE"/.tmp-*; do
    [[ -d $stale ]] || continue
    grep -F " $stale/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l || true
    rm -rf --one-file-system "$stale"
done

START=$(date +%s)
TMP=$(mktemp -d "$CACHE/.tmp-XXXXXX")
cleanup() {
    # debootstrap mounts proc and sys inside the root; an interrupted run can leave them there,
    # and rm must never walk into them.
    if [[ -n ${TMP:-} && -d $TMP ]]; then
        grep -F " $TMP/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l || true
        rm -rf --one-file-system "$TMP"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
LOG=$TMP/build.log
: >"$LOG"
ROOT=$TMP/root
RESULT=$TMP/out
mkdir -p "$RESULT" "$TMP/kernel"

# --- host tools -----------------------------------------------------------------------------------
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v zstd >/dev/null || need+=(zstd)
command -v cpio >/dev/null || need+=(cpio)
command -v xz >/dev/null || need+=(xz-utils)
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
    || fail "apt-get and dpkg-deb are needed (a Debian host); this host has neither"
if ((${#need[@]})); then
    say "installing missing host tools with apt-get: ${need[*]}"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >>"$LOG" 2>&1; then
        apt-get update -q >>"$LOG" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >>"$LOG" 2>&1 \
            || fail "apt-get install ${need[*]} (host tools)"
    fi
fi

# --- which packages -------------------------------------------------------------------------------
# Whole outputs are captured before matching: `... | grep -q` under pipefail fails at random when
# grep exits before the writer is done.
in_suite() { local m; m=$(apt-cache madison "$1" 2>/dev/null || true); [[ $m == *" $SUITE/main "* ]]; }
if ! in_suite linux-image-amd64; then
    say "apt knows no $SUITE packages yet: apt-get update"
    apt-get update -q >>"$LOG" 2>&1 || fail "apt-get update"
fi
packages=()
for p in "${REQUIRED_PACKAGES[@]}"; do
    in_suite "$p" || fail "package $p is not in Debian $SUITE main (apt-cache madison $p lists no $SUITE/main version)"
    packages+=("$p")
done
for p in "${OPTIONAL_PACKAGES[@]}"; do
    if in_suite "$p"; then packages+=("$p"); else say "$p is not in $SUITE main: left out"; fi
done

# --- kernel ---------------------------------------------------------------------------------------
deps=$(apt-cache depends linux-image-amd64 2>>"$LOG" || true)
KPKG=$(awk '$1 == "Depends:" && $2 ~ /^linux-image-6\.1\.0-[0-9]+-amd64$/ && !found {print $2; found = 1}' <<<"$deps")
[[ -n $KPKG ]] || fail "kernel: linux-image-amd64 depends on no linux-image-6.1.0-*-amd64 here (is apt pointed at Debian $SUITE?)"
say "downloading the kernel ($KPKG)"
(cd "$TMP/kernel" && apt-get download -q "$KPKG") >>"$LOG" 2>&1 || fail "apt-get download $KPKG"
KDEB=$(ls "$TMP"/kernel/*.deb)
KVER=${KPKG#linux-image-}
KPKG_VERSION=$(dpkg-deb -f "$KDEB" Version)

# --- root -----------------------------------------------------------------------------------------
say "debootstrap $SUITE minbase with ${#packages[@]} packages (about 1 min)"
debootstrap --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
    "$SUITE" "$ROOT" "$MIRROR" >>"$LOG" 2>&1 || fail "debootstrap $SUITE (mirror $MIRROR)"

say "kernel $KVER: vmlinuz and the modules the guest loads"
dpkg -x "$KDEB" "$TMP/kernel/x" >>"$LOG" 2>&1 || fail "dpkg -x $KDEB"
cp "$TMP/kernel/x/boot/vmlinuz-$KVER" "$RESULT/vmlinuz"
# The same kernel uncompressed: qemu boots an ELF vmlinux through its PVH entry, which skips the
# BIOS and the in-guest xz decompression, 6-10 s of TCG emulation per boot here. Optional: the
# payload is found as scripts/extract-vmlinux finds it, and without it vmlinuz still boots.
extract_vmlinux() {
    local off
    for off in $(LC_ALL=C grep -abo $'\xfd7zXZ' "$1" | cut -d: -f1 | head -n 5); do
        tail -c +$((off + 1)) "$1" | xz -dc --single-stream >"$2" 2>/dev/null || true
        [[ $(head -c 4 "$2" | od -An -tx1 | tr -d ' \n') == 7f454c46 ]] && return 0
    done
    rm -f "$2"
    return 1
}
extract_vmlinux "$RESULT/vmlinuz" "$RESULT/vmlinux" \
    || say "no xz-compressed ELF found in vmlinuz: vmlinux left out (vmlinuz boots, more slowly)"
mkdir -p "$ROOT/lib/modules"
mv "$TMP/kernel/x/lib/modules/$KVER" "$ROOT/lib/modules/$KVER"
chroot "$ROOT" depmod -a "$KVER" >>"$LOG" 2>&1 || fail "depmod $KVER (in the root)"
keep=$TMP/modules.keep
: >"$keep"
show_depends() {
    chroot "$ROOT" modprobe -S "$KVER" --show-depends "$1" 2>>"$LOG" \
        | awk '$1 == "insmod" {sub("^/lib/modules/[^/]*/", "", $2); print $2}' >>"$keep"
}
for m in "${REQUIRED_MODULES[@]}"; do
    show_depends "$m" || fail "kernel $KVER has no module $m"
done
for m in "${OPTIONAL_MODULES[@]}"; do
    show_depends "$m" || say "kernel $KVER has no module $m: left out"
done
sort -u -o "$keep" "$keep"
(cd "$ROOT/lib/modules/$KVER" && find kernel -name '*.ko*' | sort | comm -23 - "$keep" | xargs -r rm -f)
find "$ROOT/lib/modules/$KVER/kernel" -depth -type d -empty -delete
chroot "$ROOT" depmod -a "$KVER" >>"$LOG" 2>&1 || fail "depmod $KVER after pruning"

say "guest files: /init, guestctl, trimming docs/man/locales"
install -m 0755 "$HERE/init" "$ROOT/init"
install -D -m 0755 "$HERE/guestctl.py" "$ROOT/usr/local/lib/guestctl.py"
mkdir -p "$ROOT/lp" "$ROOT/opt/linkpass" "$ROOT/dev" "$ROOT/run" "$ROOT/tmp"
chmod 1777 "$ROOT/tmp"
# The kernel opens /dev/console for init before anything is mounted: it must be in the archive.
[[ -c $ROOT/dev/console ]] || { rm -f "$ROOT/dev/console"; mknod -m 600 "$ROOT/dev/console" c 5 1; }
[[ -c $ROOT/dev/null ]] || { rm -f "$ROOT/dev/null"; mknod -m 666 "$ROOT/dev/null" c 1 3; }
echo linkpass-guest >"$ROOT/etc/hostname"
if [[ $PROFILE == systemd ]]; then
    say "systemd profile: linkpass-guest.service runs init; timers masked"
    cat >"$ROOT/etc/systemd/system/linkpass-guest.service" <<'UNIT'
[Unit]
Description=LinkPass guest setup (shares, addresses, Soft-RoCE) and its control port
DefaultDependencies=no
After=systemd-udevd.service systemd-udev-trigger.service systemd-journald.socket
Before=multi-user.target

[Service]
Type=simple
Environment=LINKPASS_GUEST_SOFT_ROCE=0
# setup.sh renames the NICs by MAC: udev must have handled their add events first, or it renames
# them again after us (the kernel's net.ifnames=0 keeps it from naming them at all)
ExecStartPre=-/bin/udevadm settle --timeout=60
ExecStart=/init
KillMode=process

[Install]
WantedBy=multi-user.target
UNIT
    mkdir -p "$ROOT/etc/systemd/system/multi-user.target.wants"
    ln -sf ../linkpass-guest.service "$ROOT/etc/systemd/system/multi-user.target.wants/linkpass-guest.service"
    for u in "${SYSTEMD_MASKED[@]}"; do ln -sf /dev/null "$ROOT/etc/systemd/system/$u"; done
    # a machine id made at each boot (the root is new each boot); the journal stays in /run
    : >"$ROOT/etc/machine-id"
fi
for d in "${TRIM[@]}"; do
    rm -rf --one-file-system "${ROOT:?}/$d"
done
mkdir -p "$ROOT/var/log" "$ROOT/var/cache/apt" "$ROOT/var/lib/apt/lists"

# The versions, read before packing (dpkg's database is part of the root).
declare -A versions=()
while IFS=$'\t' read -r name version; do
    versions[$name]=$version
done < <(dpkg-query --admindir="$ROOT/var/lib/dpkg" -W -f '${Package}\t${Version}\n')
versions[$KPKG]=$KPKG_VERSION
ROOT_BYTES=$(du -sb "$ROOT" | cut -f1)

say "packing initrd.img ($((ROOT_BYTES / 1048576)) MB of root; zstd)"
(cd "$ROOT" && find . -mindepth 1 -print0 | LC_ALL=C sort -z \
    | cpio --null --create --format=newc --owner=0:0 --quiet) \
    | zstd -q -T0 -10 -o "$RESULT/initrd.img" 2>>"$LOG" || fail "packing initrd.img (cpio | zstd)"

BUILT=$(( $(date +%s) - START ))
VMLINUZ_BYTES=$(stat -c %s "$RESULT/vmlinuz")
VMLINUX_BYTES=$(stat -c %s "$RESULT/vmlinux" 2>/dev/null || echo 0)
INITRD_BYTES=$(stat -c %s "$RESULT/initrd.img")
{
    printf '{\n  "key": "%s",\n  "profile": "%s",\n  "kernel": "%s",\n  "kernel_package": "%s",\n' "$KEY" "$PROFILE" "$KVER" "$KPKG"
    printf '  "packages": {'
    sep=
    # Package names and Debian versions are [A-Za-z0-9.+~:-]: no JSON escaping needed.
    while read -r name; do
        printf '%s\n    "%s": "%s"' "$sep" "$name" "${versions[$name]}"
        sep=,
    done < <(printf '%s\n' "${!versions[@]}" | LC_ALL=C sort)
    printf '\n  },\n  "requested": ['
    sep=
    for p in "${packages[@]}"; do printf '%s"%s"' "$sep" "$p"; sep=', '; done
    printf '],\n  "built_in_s": %d,\n' "$BUILT"
    printf '  "sizes": {"vmlinuz": %d, "vmlinux": %d, "initrd.img": %d, "root_unpacked": %d}\n}\n' \
        "$VMLINUZ_BYTES" "$VMLINUX_BYTES" "$INITRD_BYTES" "$ROOT_BYTES"
} >"$RESULT/manifest.json"

mv -T "$RESULT" "$OUT" || fail "renaming the build to $OUT"
# Keep only the current image of this profile: older keys are dead once their sources changed.
for old in "$CACHE"/*; do
    [[ -d $old && $old != "$OUT" && $(basename "$old") =~ ^$NAME_PREFIX[0-9a-f]{16}$ ]] || continue
    rm -rf --one-file-system "$old"
    say "removed the older image $(basename "$old")"
done
say "done in ${BUILT} s: vmlinuz $((VMLINUZ_BYTES / 1048576)) MB, initrd.img $((INITRD_BYTES / 1048576)) MB"
echo "$OUT"
