"""Soft-RoCE guests as testbed hosts: QEMU VMs whose NICs are TAPs in the fabric's leaves.

This kernel has no RDMA, so a host that must run real verbs is a QEMU guest (TCG emulation)
with the `rdma_rxe` driver: one virtio NIC per plane, each backed by a TAP that sits in that
plane's leaf namespace under the leaf port's name, so the guest's RoCEv2 packets cross the same
leaves and spines (ECMP on the 5-tuple) as a namespace host's and every fault applies unchanged;
one more NIC on the management bridge. The image (Debian kernel + a minimal root with rdma-core
and pyverbs) is built by rdma/guest/build-image.sh and cached by a key of its inputs.

The host talks to a guest over two channels, both local to this machine and root-only:
  * a 9p share (the guest's /lp): the network setup script the guest runs at boot, logs of the
    processes it spawns, files a test exchanges with it; the project's source is shared
    read-only as /opt/linkpass;
  * a virtio-serial control port (a unix socket here): one JSON request per line, one reply per
    line (run a command, spawn or kill a background process, power off).

A guest is judged by markers it prints on its serial console (READY with its RDMA devices, or
FAIL naming the step), never by QEMU's exit code: QEMU exits 0 even when the guest panics.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..core.names import host_name
from ..kernel.tap import open_tap
from . import state
from .topology import Fabric, TestbedError, mac_of, nic_ifname

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE_SCRIPT = os.path.join(REPO, "rdma", "guest", "build-image.sh")
IMAGE_CACHE = os.path.abspath(os.environ.get("LINKPASS_GUEST_CACHE", "/var/cache/linkpass/guest"))
QEMU = "qemu-system-x86_64"
READY, FAIL = "LINKPASS-GUEST-READY", "LINKPASS-GUEST-FAIL"
PANIC = ("Kernel panic", "end Kernel panic")
CTL_PORT = "org.linkpass.ctl"
GUEST_MEM_MB = 768  # the whole root lives in RAM (an initramfs of ~60 MB unpacks to ~180 MB)
# the systemd guest takes the fleet package and, for the coordinator's unit, Ray (~250 MB
# unpacked) into that RAM, and runs a local Ray instance: on one emulated CPU its raylet misses
# the 30 s Ray gives it to register (measured), on two the coordinator is ready in ~50 s
SYSTEMD_GUEST_MEM_MB = 2048
SYSTEMD_GUEST_CPUS = 2
BOOT_TIMEOUT_S = 120.0  # TCG boots in 9-14 s on an idle core; two guests and a test suite share two
MGMT_IF = "mgmt"

Progress = Callable[[str], None]


class GuestError(TestbedError):
    """A guest could not be built, booted or reached; the message says which and where its log is
    (a testbed error: the CLI reports it with the testbed's exit code)."""


@dataclass(frozen=True)
class Image:
    directory: str
    kernel: str
    initrd: str
    manifest: dict
    profile: str = "rdma"  # topology.GUEST_IMAGES

    @property
    def cmdline(self) -> str:
        """The kernel's command line: the systemd image boots systemd from the initramfs (with
        udev's interface naming off: setup.sh names the NICs), the other one its own ./init."""
        base = "console=ttyS0 panic=-1 quiet"
        return base + " rdinit=/lib/systemd/systemd net.ifnames=0" if self.profile == "systemd" else base

    @property
    def mem_mb(self) -> int:
        return SYSTEMD_GUEST_MEM_MB if self.profile == "systemd" else GUEST_MEM_MB

    @property
    def cpus(self) -> int:
        return SYSTEMD_GUEST_CPUS if self.profile == "systemd" else 1

    @property
    def soft_roce(self) -> bool:
        """Whether the guest's plane NICs get Soft-RoCE devices: not in the systemd image, whose
        agent probes through sockets (rxe would take every RoCEv2 packet before them)."""
        return self.profile != "systemd"

    @property
    def shares_source(self) -> bool:
        """Whether the guest gets the project's source at /opt/linkpass: not where the fleet
        package installs itself there."""
        return self.profile != "systemd"


def ensure_image(progress: Progress = lambda _: None, cache: str = IMAGE_CACHE, profile: str = "rdma") -> Image:
    """The guest image of `profile` for the current inputs, built first if the cache lacks it
    (minutes, once)."""
    if not os.path.exists(IMAGE_SCRIPT):
        raise GuestError(f"{IMAGE_SCRIPT} is missing: the Soft-RoCE guest image is built from the source tree")
    proc = subprocess.Popen(["bash", IMAGE_SCRIPT, cache, profile], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    tail: list[str] = []

    def relay() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip()
            tail.append(line)
            del tail[:-20]
            if line:
                progress(f"guest image: {line}")

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    out = proc.stdout.read() if proc.stdout else ""
    rc = proc.wait()
    t.join(timeout=5)
    if rc != 0:
        raise GuestError(f"building the Soft-RoCE guest image failed (exit {rc}): "
                         + (" | ".join(tail[-5:]) or "no output"))
    directory = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise GuestError(f"the guest image builder named {directory!r}, which has no readable manifest ({exc})") from None
    # the uncompressed kernel boots through QEMU's PVH entry, skipping decompression under emulation
    kernel = os.path.join(directory, "vmlinux")
    if not os.path.exists(kernel):
        kernel = os.path.join(directory, "vmlinuz")
    return Image(directory, kernel, os.path.join(directory, "initrd.img"), manifest, profile)


# ---- what a guest is told to be (pure) ----------------------------------------------------

def guest_dir(prefix: str, host: int) -> str:
    return os.path.join(state.STATE_DIR, f"{prefix}-guests", host_name(host))


def guests_root(prefix: str) -> str:
    return os.path.join(state.STATE_DIR, f"{prefix}-guests")


def nic_macs(fab: Fabric, host: int) -> list[tuple[str, str]]:
    """(guest interface name, MAC) in NIC order: one per plane, then the management NIC. The
    plane MACs are the ones the leaves' permanent neighbour entries already expect."""
    out = []
    for p in range(fab.spec.planes):
        lk = fab.links[fab.uplinks[(host_name(host), p)]]
        out.append((nic_ifname(p), mac_of(lk.a_addr)))
    out.append((MGMT_IF, mac_of(fab.mgmt_addr(host) + "/24")))
    return out


def setup_script(fab: Fabric, host: int, soft_roce: bool = True) -> str:
    """The shell script the guest runs at boot: the same addresses, neighbours, routes and sysctls
    as a namespace host gets from build.py, then (`soft_roce`) one Soft-RoCE device per plane NIC."""
    node = host_name(host)
    q = shlex.quote
    lines = ["set -eu",
             # a NIC another renamer (udev) moves under the loop is looked for again, for up to 5 s
             'rename() { for _ in $(seq 50); do for d in /sys/class/net/*; do '
             'if [ "$(cat "$d/address" 2>/dev/null)" = "$1" ]; then ip link set "$(basename "$d")" name "$2" && return 0; fi; '
             'done; sleep 0.1; done; echo "no NIC with MAC $1" >&2; return 1; }']
    for ifname, mac in nic_macs(fab, host):
        lines.append(f"rename {mac} {ifname}")
    for key, value in fab.nodes[node].sysctls:
        lines.append(f"echo {q(value)} > /proc/sys/{key}")
    lines += ["ip link set lo up", f"ip addr add {fab.service_addr(host)}/32 dev lo"]
    for lk in fab.links_of(node):
        ifname, addr = lk.end(node)
        lines += [f"ip addr add {addr} dev {ifname}", f"ip link set {ifname} mtu {fab.spec.mtu} up"]
    for ifname, ip, mac in fab.neighbors(node):
        lines.append(f"ip neigh replace {ip} lladdr {mac} dev {ifname} nud permanent")
    for route in fab.routes.get(node, []):
        words = ["ip", "route", "replace", route.dst, "proto", "static"]
        if route.src:
            words += ["src", route.src]
        if len(route.via) == 1:
            words += ["via", route.via[0][0], "dev", route.via[0][1]]
        else:
            for gw, dev in route.via:
                words += ["nexthop", "via", gw, "dev", dev]
        lines.append(" ".join(words))
    plen = fab.mgmt_subnet.split("/")[1]
    lines += [f"ip addr add {fab.mgmt_addr(host)}/{plen} dev {MGMT_IF}", f"ip link set {MGMT_IF} up"]
    for p in range(fab.spec.planes) if soft_roce else ():
        lines.append(f"rdma link add rxe_{nic_ifname(p)} type rxe netdev {nic_ifname(p)}")
    return "\n".join(lines) + "\n"


def qemu_argv(name: str, image: Image, workdir: str, tap_fds: list[int], macs: list[str],
              mem_mb: int | None = None) -> list[str]:
    argv = [QEMU, "-name", name, "-accel", "tcg", "-cpu", "max", "-m", str(mem_mb or image.mem_mb), "-smp", str(image.cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", image.kernel, "-initrd", image.initrd, "-append", image.cmdline,
            "-serial", f"file:{os.path.join(workdir, 'console.log')}",
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=ctl,path={os.path.join(workdir, 'ctl.sock')},server=on,wait=off",
            "-device", f"virtserialport,chardev=ctl,name={CTL_PORT}",
            "-fsdev", f"local,id=cfg,path={os.path.join(workdir, 'lp')},security_model=none",
            "-device", "virtio-9p-pci,fsdev=cfg,mount_tag=lpcfg"]
    if image.shares_source:
        argv += ["-fsdev", f"local,id=src,path={REPO},security_model=none,readonly=on",
                 "-device", "virtio-9p-pci,fsdev=src,mount_tag=lpsrc"]
    for i, (fd, mac) in enumerate(zip(tap_fds, macs)):
        argv += ["-netdev", f"tap,id=n{i},fd={fd},vhost=off", "-device", f"virtio-net-pci,netdev=n{i},mac={mac}"]
    return argv


# ---- running guests --------------------------------------------------------------------

def open_taps(fab: Fabric, host: int) -> list[int]:
    """The guest's TAPs, created now: each plane's in its leaf namespace under the leaf port's
    name, the management one in the root namespace. They live as long as the returned fds."""
    fds = []
    try:
        for p in range(fab.spec.planes):
            lk = fab.links[fab.uplinks[(host_name(host), p)]]
            fds.append(open_tap(lk.b_if, fab.netns(lk.b)))
        fds.append(open_tap(fab.guest_tap(host)))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def launch(fab: Fabric, host: int, image: Image, tap_fds: list[int]) -> subprocess.Popen:
    """Start the guest (detached: it outlives the process that built the testbed; `testbed down`
    reaps it). QEMU runs inside the plane-0 leaf's namespace, so teardown finds it there."""
    workdir = guest_dir(fab.prefix, host)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(os.path.join(workdir, "lp"), mode=0o700)
    os.chmod(workdir, 0o700)
    with open(os.path.join(workdir, "lp", "setup.sh"), "w") as f:
        f.write(setup_script(fab, host, image.soft_roce))
    macs = [mac for _, mac in nic_macs(fab, host)]
    leaf0 = fab.links[fab.uplinks[(host_name(host), 0)]].b
    argv = ["ip", "netns", "exec", fab.netns(leaf0)] + qemu_argv(f"{fab.prefix}-{host_name(host)}", image, workdir,
                                                                  tap_fds, macs)
    with open(os.path.join(workdir, "qemu.log"), "wb") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=tap_fds, start_new_session=True)


def read_console(prefix: str, host: int) -> str:
    try:
        with open(os.path.join(guest_dir(prefix, host), "console.log"), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def wait_ready(prefix: str, host: int, proc: subprocess.Popen | None = None,
               timeout_s: float = BOOT_TIMEOUT_S) -> dict:
    """The guest's READY record once it printed it; GuestError on FAIL, a panic, QEMU exiting or
    the timeout, with the console's last lines."""
    deadline = time.monotonic() + timeout_s
    where = os.path.join(guest_dir(prefix, host), "console.log")
    while True:
        text = read_console(prefix, host)
        for line in text.splitlines():
            if READY in line:  # anywhere: another writer to the console may have left a line open
                line = line[line.index(READY):]
                try:
                    return json.loads(line[len(READY):].strip() or "{}")
                except ValueError:
                    return {"raw": line}
        problem = None
        if FAIL in text:
            problem = "it reported a failed step: " + text[text.index(FAIL):].splitlines()[0]
        elif any(p in text for p in PANIC):
            problem = "its kernel panicked"
        elif proc is not None and proc.poll() is not None:
            qlog = os.path.join(guest_dir(prefix, host), "qemu.log")
            with contextlib.suppress(OSError):
                problem = f"QEMU exited ({proc.returncode}): " + open(qlog, errors="replace").read()[-400:].strip()
            problem = problem or f"QEMU exited ({proc.returncode})"
        elif time.monotonic() > deadline:
            problem = f"it printed no {READY} within {timeout_s:.0f} s"
        if problem:
            tail = " | ".join(text.strip().splitlines()[-6:])
            raise GuestError(f"guest {host_name(host)} did not come up: {problem} (console {where}: {tail})")
        time.sleep(0.2)


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str
    timed_out: bool = False


class Control:
    """The guest's control port: run commands in it, spawn and kill background processes."""

    def __init__(self, prefix: str, host: int, connect_timeout_s: float = 10.0):
        self.host = host
        self.lp_dir = os.path.join(guest_dir(prefix, host), "lp")
        path = os.path.join(guest_dir(prefix, host), "ctl.sock")
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.connect(path)
                break
            except OSError as exc:
                self._sock.close()
                if time.monotonic() > deadline:
                    raise GuestError(f"guest {host_name(host)}: cannot reach its control socket {path} ({exc})") from None
                time.sleep(0.2)
        self._file = self._sock.makefile("rwb")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _call(self, request: dict, timeout_s: float) -> dict:
        with self._lock:
            rid = next(self._ids)
            self._sock.settimeout(timeout_s)
            self._file.write(json.dumps(dict(request, id=rid)).encode() + b"\n")
            self._file.flush()
            while True:
                try:
                    line = self._file.readline()
                except TimeoutError:
                    raise GuestError(f"guest {host_name(self.host)}: no answer to {request.get('op')} "
                                     f"within {timeout_s:.0f} s") from None
                if not line:
                    raise GuestError(f"guest {host_name(self.host)}: control port closed (guest gone?)")
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue  # a partial line left by an earlier client
                if reply.get("id") == rid:
                    if "error" in reply:
                        raise GuestError(f"guest {host_name(self.host)}: {reply['error']}")
                    return reply

    def run(self, argv: list[str], timeout_s: float = 60.0, env: dict | None = None) -> Result:
        reply = self._call({"op": "run", "argv": argv, "timeout": timeout_s, "env": env or {}}, timeout_s + 15)
        return Result(reply["rc"], reply.get("stdout", ""), reply.get("stderr", ""), bool(reply.get("timed_out")))

    def check(self, argv: list[str], timeout_s: float = 60.0, env: dict | None = None) -> str:
        """run(), raising GuestError with its stderr unless it exits 0; returns stdout."""
        res = self.run(argv, timeout_s, env)
        if res.rc != 0:
            raise GuestError(f"guest {host_name(self.host)}: {' '.join(argv)} exited {res.rc}: "
                             f"{(res.stderr or res.stdout).strip()[-600:]}")
        return res.stdout

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> int:
        return self._call({"op": "spawn", "name": name, "argv": argv, "env": env or {}}, 30)["pid"]

    def kill(self, name: str, signal: int = 15) -> int | None:
        return self._call({"op": "kill", "name": name, "signal": signal}, 30).get("rc")

    def log(self, name: str) -> str:
        """What a spawned process wrote (its /lp/<name>.log, read through the share)."""
        try:
            with open(os.path.join(self.lp_dir, f"{name}.log"), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self._sock.close()

    def __enter__(self) -> "Control":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_dirs(prefix: str) -> None:
    shutil.rmtree(guests_root(prefix), ignore_errors=True)
