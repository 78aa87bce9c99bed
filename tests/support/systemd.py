"""Running LinkPass as systemd runs it: a $NOTIFY_SOCKET listener, and the seccomp sandbox
emulated from a unit's SystemCallFilter=, RestrictAddressFamilies= and MemoryDenyWriteExecute=."""
from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).parents[2]
UNITS = ROOT / "deploy" / "systemd"
LINKPASS = ["-m", "linkpass.cli"]
# the sandbox's emulation needs libseccomp, and systemd-analyze to expand the unit's groups
EMULATE = ctypes.util.find_library("seccomp") is not None and shutil.which("systemd-analyze") is not None


class NotifyListener:
    """A datagram socket bound where $NOTIFY_SOCKET points, as systemd binds its own, read by a
    thread (a datagram socket queues only a few messages for a sender that does not wait)."""

    def __init__(self, path: str):
        self.path = path
        self.messages: list[str] = []
        self._cond = threading.Condition()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        os.chmod(path, 0o777)  # a sender of another uid needs write permission on the socket
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._cond:
                self.messages.append(data)
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float, after: int = 0) -> int:
        """The index of the first message from `after` on that matches `pattern` (a regex)."""
        with self._cond:
            found = self._cond.wait_for(lambda: next((i for i in range(after, len(self.messages))
                                                      if re.search(pattern, self.messages[i])), None) is not None,
                                        timeout_s)
            assert found, f"no message matching {pattern!r} in {timeout_s} s: {self.messages}"
            return next(i for i in range(after, len(self.messages)) if re.search(pattern, self.messages[i]))

    def count(self, text: str, after: int = 0) -> int:
        with self._cond:
            return sum(m == text for m in self.messages[after:])

    def wait_count(self, text: str, n: int, timeout_s: float, after: int = 0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: sum(m == text for m in self.messages[after:]) >= n, timeout_s), \
                f"fewer than {n} {text!r} in {timeout_s} s: {self.messages}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


# Run as `python -c SANDBOX SPEC.json COMMAND...`: loads the seccomp filter SPEC describes (an
# allow list; socket() only for the allowed families; everything else fails with EPERM, as
# SystemCallErrorNumber=EPERM does) and, for MemoryDenyWriteExecute=, a second filter with the
# rules systemd 252 adds for it (no W+X mmap, no mprotect/pkey_mprotect to PROT_EXEC, no
# SHM_EXEC), then execs COMMAND, which inherits both.
SANDBOX = r"""
import ctypes, errno, json, os, sys
spec = json.load(open(sys.argv[1]))
lib = ctypes.CDLL("libseccomp.so.2")
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                       ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ALLOW, EPERM = 0x7fff0000, 0x00050000 | errno.EPERM
ctx = lib.seccomp_init(EPERM)
sock = lib.seccomp_syscall_resolve_name(b"socket")
for name in spec["allow"]:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0 and nr != sock:
        assert lib.seccomp_rule_add_array(ctx, ALLOW, nr, 0, None) == 0, name
for family in spec["families"]:
    assert lib.seccomp_rule_add_array(ctx, ALLOW, sock, 1, (Cmp * 1)(Cmp(0, 4, family, 0))) == 0  # SCMP_CMP_EQ
if spec["mdwe"]:  # first: the allow list does not allow loading another filter
    wx = lib.seccomp_init(ALLOW)
    for name, mask in ((b"mmap", 6), (b"mprotect", 4), (b"pkey_mprotect", 4), (b"shmat", 0o100000)):
        nr = lib.seccomp_syscall_resolve_name(name)  # argument 2 masked with `mask` equal to it: SCMP_CMP_MASKED_EQ
        assert lib.seccomp_rule_add_array(wx, EPERM, nr, 1, (Cmp * 1)(Cmp(2, 7, mask, mask))) == 0
    assert lib.seccomp_load(wx) == 0
assert lib.seccomp_load(ctx) == 0
os.execv(sys.argv[2], sys.argv[2:])
"""


def syscall_group(name: str, seen: set | None = None) -> set[str]:
    """The system calls a SystemCallFilter= group names, nested groups expanded."""
    seen = set() if seen is None else seen
    text = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", name], capture_output=True, text=True,
                          timeout=60).stdout
    out = set()
    for word in (w.strip() for w in text.splitlines()):
        if not word or word.startswith("#") or word == name:
            continue
        if word.startswith("@"):
            if word not in seen:
                seen.add(word)
                out |= syscall_group(word, seen)
        else:
            out.add(word)
    return out


def sandbox_spec(unit: str) -> dict:
    """What the unit's SystemCallFilter= lines (an allow list, then removals and additions, in
    order), RestrictAddressFamilies= and MemoryDenyWriteExecute= allow."""
    allow: set[str] = set()
    families: list[int] = []
    mdwe = False
    for line in (UNITS / f"{unit}.service").read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "SystemCallFilter":
            deny = value.startswith("~")
            names = set()
            for item in value.lstrip("~").split():
                names |= syscall_group(item) if item.startswith("@") else {item}
            allow = allow - names if deny else allow | names
        elif key == "RestrictAddressFamilies":
            families = [int(getattr(socket, f)) for f in value.split()]
        elif key == "MemoryDenyWriteExecute":
            mdwe = value == "yes"
    assert allow and families and mdwe, unit
    return {"allow": sorted(allow), "families": families, "mdwe": mdwe}
