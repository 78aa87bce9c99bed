"""The testbed: prefixes unique to this pytest run (conftest's fixtures use them too), the
default fabric with some hosts as QEMU guests, and LinkPass's routes in a testbed host's
namespace; A, B: the failover tests' two hosts."""
from __future__ import annotations

import contextlib
import os


RUN_TAG = f"{os.getpid() % 10000:04d}"


def prefix_for(letter: str) -> str:
    """A testbed prefix unique to this run: one letter + 4 digits (e.g. 'd0412')."""
    return f"{letter}{RUN_TAG}"


@contextlib.contextmanager
def guest_fabric(letter: str, hosts: tuple[int, ...], image: str = "rdma"):
    """The default fabric with `hosts` as QEMU guests booting `image`; on exit, down, and
    nothing of the guests left: no QEMU, no TAP, no work directory."""
    import dataclasses
    import subprocess

    from linkpass.testbed import build, guests, topology

    prefix = prefix_for(letter)
    build.clean(prefix)
    spec = dataclasses.replace(topology.preset("default"), rdma_hosts=hosts, guest_image=image)
    fab = build.up(spec, prefix, progress=print)
    try:
        yield fab
    finally:
        build.down(prefix)
        left = subprocess.run(["pgrep", "-f", f"-name {prefix}-h"], capture_output=True, text=True).stdout.split()
        assert not left, left
        assert not build.root_links_with_prefix(prefix)
        assert not os.path.exists(guests.guests_root(prefix))


A, B = 0, 2  # the failover tests' hosts: different leaves, so every link kind lies on some path between them


def routes_of(fab, host: int) -> dict[str, tuple[int, ...]]:
    """LinkPass's routes in a host's namespace: service address -> planes (by device)."""
    from pyroute2 import IPRoute

    from linkpass.agent.routes import RTPROT_LINKPASS

    with IPRoute(netns=fab.netns(f"h{host}")) as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        out = {}
        for r in ipr.get_routes(family=2, proto=RTPROT_LINKPASS):
            mp = r.get_attr("RTA_MULTIPATH")
            oifs = [h["oif"] for h in mp] if mp else [r.get_attr("RTA_OIF")]
            out[r.get_attr("RTA_DST")] = tuple(sorted(int(names[o][1:]) for o in oifs))
        return out
