"""Process identity across PID namespaces: whether the writer of a shared-memory table is alive."""
from __future__ import annotations

import os


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 if it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_dead(pid: int, pidns: int) -> bool:
    """True only when we can tell: same pid namespace and kill(pid, 0) says no such process."""
    if pid == 0:
        return True  # writer detached (close) or never recorded
    if pidns and pidns != pid_namespace():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
