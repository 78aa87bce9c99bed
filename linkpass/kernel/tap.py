"""TAP devices for emulated hosts: open one by name, in a given network namespace.

A TAP opened without IFF_PERSIST exists exactly as long as its file descriptor: the process
that holds it (QEMU, for a Soft-RoCE guest) takes the device with it when it dies, so a crashed
guest leaves no interface behind. The descriptor can be passed to another process; the device
stays in the namespace it was created in, so one process can hold TAPs in several namespaces.
"""
from __future__ import annotations

import fcntl
import os
import struct

from . import netns as ns_io

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFNAMSIZ = 16


def open_tap(ifname: str, netns: str | None = None) -> int:
    """A new TAP named `ifname` (in `netns`, or the caller's namespace); returns its fd (not
    inheritable: pass it on explicitly, e.g. with subprocess's pass_fds)."""
    if not 0 < len(ifname.encode()) < IFNAMSIZ:
        raise ValueError(f"TAP name {ifname!r}: 1-{IFNAMSIZ - 1} bytes")

    def make() -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), IFF_TAP | IFF_NO_PI))
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, f"create TAP {ifname!r}{f' in {netns}' if netns else ''}: "
                                     f"{os.strerror(exc.errno)}") from None
        return fd

    return ns_io.run_in_netns(netns, make) if netns else make()
