"""Doing things inside a named network namespace without moving the calling thread.

setns(2) changes only the calling thread's namespace, so each helper runs its work in a
short-lived thread that enters the namespace, does the work and ends. Sockets and /proc/sys
files opened there stay bound to that namespace after the thread is gone.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
from typing import Callable, TypeVar

NETNS_RUN_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)


MS_BIND, MS_REC, MS_SHARED, MNT_DETACH = 0x1000, 0x4000, 0x100000, 0x2


def netns_path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, name)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _ensure_shared_run_dir() -> None:
    """Make /run/netns a shared mount, as `ip netns add` does, so namespace mounts propagate."""
    os.makedirs(NETNS_RUN_DIR, exist_ok=True)
    if _libc.mount(b"none", NETNS_RUN_DIR.encode(), None, MS_SHARED | MS_REC, None) == 0:
        return
    if ctypes.get_errno() != 22:  # EINVAL: not a mount point yet
        _check(-1, f"mount --make-shared {NETNS_RUN_DIR}")
    _check(_libc.mount(NETNS_RUN_DIR.encode(), NETNS_RUN_DIR.encode(), b"none", MS_BIND | MS_REC, None),
           f"mount --bind {NETNS_RUN_DIR}")
    _check(_libc.mount(b"none", NETNS_RUN_DIR.encode(), None, MS_SHARED | MS_REC, None),
           f"mount --make-shared {NETNS_RUN_DIR}")


def create_netns(name: str) -> None:
    """Create a named network namespace (like `ip netns add`), without spawning a process:
    a short-lived thread unshares its network namespace and bind-mounts it to /run/netns/NAME."""
    _ensure_shared_run_dir()
    path = netns_path(name)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))

    def make() -> None:
        _check(_libc.unshare(CLONE_NEWNET), f"unshare a network namespace for {name}")
        src = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        _check(_libc.mount(src.encode(), path.encode(), b"none", MS_BIND, None), f"bind-mount namespace {name}")

    box: dict[str, BaseException] = {}

    def worker() -> None:
        try:
            make()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=worker, name=f"netns-create-{name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        os.unlink(path)
        raise box["error"]


def remove_netns(name: str) -> None:
    path = netns_path(name)
    _libc.umount2(path.encode(), MNT_DETACH)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_in_netns(name: str, fn: Callable[[], T]) -> T:
    """Run fn() in a fresh thread that has entered namespace `name`; return its result."""
    box: dict[str, object] = {}

    def worker() -> None:
        try:
            fd = os.open(netns_path(name), os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["result"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            box["error"] = exc

    t = threading.Thread(target=worker, name=f"netns-{name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def socket_in_netns(name: str, family: int = socket.AF_INET, type: int = socket.SOCK_DGRAM,
                    proto: int = 0) -> socket.socket:
    return run_in_netns(name, lambda: socket.socket(family, type, proto))


def write_sysctls(name: str, settings: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> None:
    """Write /proc/sys/<key> = value inside namespace `name` (keys use '/' separators)."""
    def apply() -> None:
        for key, value in settings:
            with open(f"/proc/sys/{key}", "w") as f:
                f.write(value)

    run_in_netns(name, apply)


def exec_in_netns(name: str, argv: list[str], input: str | None = None, timeout: float = 10.0,
                  check: bool = True) -> subprocess.CompletedProcess:
    """Run a program inside namespace `name` (via `ip netns exec`)."""
    proc = subprocess.run(["ip", "netns", "exec", name, *argv], input=input, text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` in namespace {name} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def netns_inode(name: str) -> int | None:
    try:
        return os.stat(netns_path(name)).st_ino
    except FileNotFoundError:
        return None


def pids_in_netns(inodes: set[int]) -> list[int]:
    """PIDs of processes whose network namespace is one of `inodes` (never our own)."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                found.append(int(entry))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found
