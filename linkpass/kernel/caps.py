"""This process's capabilities and real-time limit, as the kernel reports them.

The agent does not need root, only what it does with it: raw sockets, receive buffers above the
system's maximum and route changes (CAP_NET_RAW, CAP_NET_ADMIN), and SCHED_FIFO for the probe
thread, which either CAP_SYS_NICE or an RLIMIT_RTPRIO at least as high as the priority allows
(the systemd unit grants the limit, LimitRTPRIO=, rather than the capability).
"""
from __future__ import annotations

import resource

CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_NICE = 12, 13, 23  # <linux/capability.h>
NAMES = {CAP_NET_ADMIN: "CAP_NET_ADMIN", CAP_NET_RAW: "CAP_NET_RAW", CAP_SYS_NICE: "CAP_SYS_NICE"}


def cap_eff_of(status_text: str) -> int | None:
    """The CapEff mask in the text of /proc/<pid>/status, or None if it has none."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            try:
                return int(line.split()[1], 16)
            except (IndexError, ValueError):
                return None
    return None


def read_cap_eff(path: str = "/proc/self/status") -> int | None:
    """This process's effective capabilities, or None when they cannot be read."""
    try:
        with open(path) as fh:
            return cap_eff_of(fh.read())
    except OSError:
        return None


def has(mask: int, cap: int) -> bool:
    return bool(mask >> cap & 1)


def rtprio_limit() -> int:
    """The soft RLIMIT_RTPRIO: the highest SCHED_FIFO priority allowed without CAP_SYS_NICE."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_RTPRIO)
    return 99 if soft == resource.RLIM_INFINITY else int(soft)
