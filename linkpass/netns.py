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


def netns_path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, name)


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


def read_sysctl(name: str, key: str) -> str:
    return run_in_netns(name, lambda: open(f"/proc/sys/{key}").read().strip())


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
