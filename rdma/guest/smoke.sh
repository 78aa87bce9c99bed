#!/usr/bin/env bash
# smoke.sh CACHE_DIR — boots one Soft-RoCE guest and talks to it, with nothing but qemu.
#
# Builds (or finds) the image with build-image.sh, boots it under TCG with user-mode networking,
# waits for LINKPASS-GUEST-READY on the serial log, runs `ibv_devices` and `import pyverbs`
# through the control port, and powers the guest off. The commands it runs show how a host
# drives a guest; it is a smoke check, not a test. Run as root (9p passthrough of the config
# dir); installs qemu-system-x86 with apt-get if qemu-system-x86_64 is missing.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ $# -eq 1 && -n $1 && $1 != -* ]] || { echo "usage: smoke.sh CACHE_DIR" >&2; exit 2; }
say() { printf 'smoke: %s\n' "$*" >&2; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }

if ! command -v qemu-system-x86_64 >/dev/null; then
    say "qemu-system-x86_64 is missing: installing qemu-system-x86 with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends qemu-system-x86 >&2
fi
IMAGE=$(bash "$HERE/build-image.sh" "$1")

WORK=$(mktemp -d /tmp/linkpass-smoke.XXXXXX)
QEMU_PID=
cleanup() {
    if [[ -n $QEMU_PID ]] && kill -0 "$QEMU_PID" 2>/dev/null; then
        kill "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# What a host writes for its guest: the NIC's address (slirp's guest address in a testbed range).
mkdir "$WORK/cfg"
cat >"$WORK/cfg/setup.sh" <<'EOF'
ip link set eth0 up
ip addr add 198.18.254.15/24 dev eth0
EOF

CMDLINE="console=ttyS0 panic=-1 quiet"
# vmlinux boots through qemu's PVH entry, 6-10 s faster under TCG than vmlinuz (no BIOS, no
# in-guest decompression); SMOKE_KERNEL=vmlinuz boots the compressed one.
KERNEL=$IMAGE/${SMOKE_KERNEL:-vmlinux}
[[ -f $KERNEL ]] || KERNEL=$IMAGE/vmlinuz
QEMU=(qemu-system-x86_64 -accel tcg -cpu max -m 768 -smp 1 -nographic -no-reboot
      -kernel "$KERNEL" -initrd "$IMAGE/initrd.img" -append "$CMDLINE"
      -serial "file:$WORK/console.log" -monitor none
      -device virtio-serial
      -chardev "socket,id=ctl,path=$WORK/ctl.sock,server=on,wait=off"
      -device virtserialport,chardev=ctl,name=org.linkpass.ctl
      -fsdev "local,id=cfg,path=$WORK/cfg,security_model=none"
      -device virtio-9p-pci,fsdev=cfg,mount_tag=lpcfg
      -netdev user,id=n0,net=198.18.254.0/24,restrict=on
      -device virtio-net-pci,netdev=n0)
say "booting $KERNEL"
printf '  %q' "${QEMU[@]}" >&2
echo >&2
T0=$(date +%s.%N)
"${QEMU[@]}" </dev/null >"$WORK/qemu.out" 2>&1 &
QEMU_PID=$!

dump() {
    say "console log:"
    sed 's/^/  | /' "$WORK/console.log" >&2 || true
    sed 's/^/  qemu: /' "$WORK/qemu.out" >&2 || true
}

# The guest's verdict is what it prints: qemu exits 0 even when the guest panics.
ready=
for _ in $(seq 1 1200); do  # up to 120 s
    if grep -a -q '^LINKPASS-GUEST-FAIL' "$WORK/console.log" 2>/dev/null; then
        dump; say "FAILED: the guest reported $(grep -a -m1 '^LINKPASS-GUEST-FAIL' "$WORK/console.log")"; exit 1
    fi
    ready=$(grep -a -m1 '^LINKPASS-GUEST-READY' "$WORK/console.log" 2>/dev/null || true)
    [[ -n $ready ]] && break
    kill -0 "$QEMU_PID" 2>/dev/null || { dump; say "FAILED: qemu ended before READY"; exit 1; }
    sleep 0.1
done
[[ -n $ready ]] || { dump; say "FAILED: no READY within 120 s"; exit 1; }
say "READY after $(since "$T0") s: ${ready#LINKPASS-GUEST-READY }"

if ! python3 - "$WORK/ctl.sock" <<'EOF'
import json, socket, sys, time

sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
reader = sock.makefile("rb")

def call(req, wait=120):
    sock.sendall((json.dumps(req) + "\n").encode())
    sock.settimeout(wait)
    while True:
        reply = json.loads(reader.readline())
        if reply.get("id") == req["id"]:
            return reply

ok = True
r = call({"id": 1, "op": "run", "argv": ["ibv_devices"], "timeout": 60})
print("ibv_devices ->", json.dumps(r), file=sys.stderr)
ok &= r.get("rc") == 0 and "rxe0" in r.get("stdout", "")
r = call({"id": 2, "op": "run", "argv": ["python3", "-c", "import pyverbs.device as d; "
          "print([x.name.decode() for x in d.get_device_list()])"], "timeout": 60})
print("pyverbs    ->", json.dumps(r), file=sys.stderr)
ok &= r.get("rc") == 0 and "rxe0" in r.get("stdout", "")
r = call({"id": 3, "op": "poweroff"})
print("poweroff   ->", json.dumps(r), file=sys.stderr)
ok &= r.get("poweroff") is True
sys.exit(0 if ok else 1)
EOF
then
    dump; say "FAILED: a control request (above)"; exit 1
fi
T2=$(date +%s.%N)
for _ in $(seq 1 300); do  # up to 30 s for the power-off to end qemu
    kill -0 "$QEMU_PID" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$QEMU_PID" 2>/dev/null; then
    dump; say "FAILED: qemu still running 30 s after poweroff"; exit 1
fi
wait "$QEMU_PID" || true
QEMU_PID=
say "qemu ended $(since "$T2") s after poweroff; $(since "$T0") s in all"
say "ok"
