"""RDMA on this host: finding pyverbs, lazily, and the RDMA device of a NIC address.

pyverbs is not a PyPI dependency: the PyPI sdist bundles rdma-core, fails to build with
Cython >= 3.1 and then needs matching rdma-core libraries at run time. It comes from the
operating system's rdma-core instead (Debian: `apt-get install python3-pyverbs`), which
installs it for the system Python under /usr/lib/python3/dist-packages. LinkPass runs in its
own venv, so `load_pyverbs()` first tries a normal import and then loads *only* the pyverbs
package from the system directories (never the rest of dist-packages).

Nothing imports this module unless an RDMA feature is used; on hosts without RDMA the rest of
LinkPass works unchanged.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import sys
from types import ModuleType

SYSFS = "/sys/class/infiniband"
ROCE_V2 = "RoCE v2"
SYSTEM_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")


class RdmaUnavailable(RuntimeError):
    """pyverbs or an RDMA device is missing; the message says how to get it."""


def load_pyverbs(search_dirs: tuple[str, ...] = SYSTEM_DIRS) -> ModuleType:
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    tried = []
    for base in search_dirs:
        pkg = os.path.join(base, "pyverbs", "__init__.py")
        tried.append(os.path.dirname(pkg))
        if not os.path.exists(pkg):
            continue
        spec = importlib.util.spec_from_file_location("pyverbs", pkg,
                                                      submodule_search_locations=[os.path.dirname(pkg)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules["pyverbs"]
            raise RdmaUnavailable(f"found pyverbs in {base} but it does not load into Python "
                                  f"{sys.version_info.major}.{sys.version_info.minor} ({exc}); the system "
                                  "package must be built for this Python version") from exc
        return module
    raise RdmaUnavailable("pyverbs is not installed: install the OS package (Debian/Ubuntu: "
                          "`apt-get install python3-pyverbs`, from rdma-core); looked in " + ", ".join(tried))


def device_names() -> list[str]:
    """Names of the RDMA devices, or RdmaUnavailable saying why there are none."""
    pv = load_pyverbs()
    device = importlib.import_module("pyverbs.device")
    try:
        devices = device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError when the kernel has no RDMA subsystem
        raise RdmaUnavailable(f"no RDMA devices: {exc} (kernel without RDMA support, or no rdma_rxe/mlx5 device)") from exc
    del pv
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def ipv4_gid(addr: str) -> str:
    """The RoCEv2 GID of an IPv4 address (::ffff:a.b.c.d), in the kernel's sysfs spelling."""
    b = socket.inet_aton(addr)
    return f"0000:0000:0000:0000:0000:ffff:{b[0]:02x}{b[1]:02x}:{b[2]:02x}{b[3]:02x}"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


# an RDMA port's packet counters, sent and received, in the order they are tried: the port's
# PMA counters (InfiniBand and mlx5 RoCE ports), then the driver's own (Soft-RoCE, rxe)
PORT_PACKETS = (("counters", "port_xmit_packets", "port_rcv_packets"),
                ("hw_counters", "sent_pkts", "rcvd_pkts"))
COUNTER_BYTES = 32  # a counter file holds one decimal number; more is not a counter


def _counter(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(COUNTER_BYTES + 1)
    except OSError:
        return None
    text = raw.strip()
    if len(raw) > COUNTER_BYTES or not text.isdigit():
        return None
    return int(text)


def port_packets(device: str, port: int = 1, sysfs: str = SYSFS) -> int | None:
    """Packets an RDMA port sent plus received so far, from sysfs; None when the device shows
    neither set of counters (or is gone)."""
    base = os.path.join(sysfs, device, "ports", str(port))
    for group, sent, received in PORT_PACKETS:
        a, b = _counter(os.path.join(base, group, sent)), _counter(os.path.join(base, group, received))
        if a is not None and b is not None:
            return a + b
    return None


class Device:
    """An RDMA device and the GID index of one of its IPv4 addresses (RoCE v2)."""

    def __init__(self, name: str, gid_index: int, addr: str, port: int = 1):
        self.name, self.gid_index, self.addr, self.port = name, gid_index, addr, port

    @classmethod
    def for_address(cls, addr: str, sysfs: str = SYSFS) -> "Device":
        want = ipv4_gid(addr)
        try:
            names = sorted(os.listdir(sysfs))
        except FileNotFoundError:
            raise RdmaUnavailable(f"no RDMA devices ({sysfs} is missing): this host has no RDMA driver; "
                                  "on a Soft-RoCE host run `rdma link add rxe0 type rxe netdev IFACE`") from None
        for name in names:
            gids = os.path.join(sysfs, name, "ports", "1", "gids")
            try:
                indices = sorted(int(i) for i in os.listdir(gids))
            except (FileNotFoundError, ValueError):
                continue
            for i in indices:
                if _read(os.path.join(gids, str(i))) == want and \
                        _read(os.path.join(sysfs, name, "ports", "1", "gid_attrs", "types", str(i))) == ROCE_V2:
                    return cls(name, i, addr)
        raise RdmaUnavailable(f"no RDMA device has a RoCE v2 GID for {addr} (looked at {', '.join(names) or 'none'})")
