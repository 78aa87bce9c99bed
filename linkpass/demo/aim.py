"""Which fabric links the training job's TCP connections cross, so each scripted fault hits them.

Each established connection between two service addresses is two flows, one per direction. A
flow's path is what the kernel would do with its 5-tuple: the sending host's route picks the
plane (`ip route get ... ipproto tcp sport dport`), the leaf's ECMP route picks the spine (the
same query with `iif`, which hashes a forwarded packet). A fault is then aimed at the link of the
asked tier that carries the most of the job's flows, so no fault in the demo misses the job.
"""
from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass

from ..testbed.topology import Fabric


@dataclass(frozen=True)
class Flow:
    """One direction of one TCP connection, and the directed links it crosses: (link, from-node)."""

    src: int
    dst: int
    sport: int
    dport: int
    links: tuple[tuple[str, str], ...]
    bytes_acked: int = 0  # acknowledged while sampled: the ring all-reduce loads some flows only


def _route_dev(netns: str, dst: str, src: str, sport: int, dport: int, iif: str | None = None) -> str:
    cmd = ["ip", "-n", netns, "route", "get", dst, "from", src, *(["iif", iif] if iif else []),
           "ipproto", "tcp", "sport", str(sport), "dport", str(dport)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=5).stdout
    m = re.search(r"\bdev (\S+)", out)
    if not m:
        raise RuntimeError(f"no output device in `{' '.join(cmd)}`: {out.strip()}")
    return m.group(1)


def flow_links(fab: Fabric, src: int, dst: int, sport: int, dport: int) -> tuple[tuple[str, str], ...]:
    """The directed links a TCP flow from host `src` to host `dst` crosses, in order."""
    a, b = fab.service_addr(src), fab.service_addr(dst)
    plane = int(_route_dev(fab.netns(f"h{src}"), b, a, sport, dport).removeprefix("p"))
    up, down = fab.uplink(src, plane), fab.uplink(dst, plane)
    leaf, far_leaf = fab.leaf_of(src, plane), fab.leaf_of(dst, plane)
    if leaf == far_leaf:
        return (up.name, f"h{src}"), (down.name, leaf)
    out_if = _route_dev(fab.netns(leaf), b, a, sport, dport, iif=up.end(leaf)[0])
    spine_link = next(lk for lk in fab.links_of(leaf) if lk.kind == "leaf-spine" and lk.end(leaf)[0] == out_if)
    spine = spine_link.other(leaf)
    back = next(lk for lk in fab.links_of(spine) if lk.other(spine) == far_leaf)
    return (up.name, f"h{src}"), (spine_link.name, leaf), (back.name, spine), (down.name, far_leaf)


_SOCKET = re.compile(r"^\S*\s*\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)")


def _tcp_bytes_acked(fab: Fabric, hosts: list[int]) -> dict[tuple[int, int, str, int], int]:
    """bytes_acked of every established TCP socket on the hosts' service addresses, from `ss -ti`
    in each host's namespace: (host, local port, peer address, peer port) -> bytes."""
    out: dict[tuple[int, int, str, int], int] = {}
    for h in hosts:
        text = subprocess.run(["ip", "netns", "exec", fab.netns(f"h{h}"), "ss", "-tinH", "state", "established"],
                              capture_output=True, text=True, check=True, timeout=5).stdout
        sock = None
        for line in text.splitlines():
            m = _SOCKET.match(line)
            if m:  # a socket line; its counters follow on the next line
                sock = m.groups()
                continue
            if sock is None:
                continue
            la, lp, pa, pp = sock
            sock = None
            acked = re.search(r"\bbytes_acked:(\d+)", line)
            if la == fab.service_addr(h):
                out[(h, int(lp), pa, int(pp))] = int(acked.group(1)) if acked else 0
    return out


def job_flows(fab: Fabric, hosts: list[int], exclude_ports: set[int] = frozenset(), sample_s: float = 0.3,
              min_bytes: int = 1 << 20) -> list[Flow]:
    """The job's TCP flows between two hosts' service addresses that carry data now: at least
    `min_bytes` acknowledged over `sample_s`. A ring all-reduce sends data one way round the
    ring; the other directions carry ACKs, and a fault there would hit nothing. Connections on
    `exclude_ports` (the rendezvous store) are left out."""
    by_addr = {fab.service_addr(h): h for h in hosts}
    before = _tcp_bytes_acked(fab, hosts)
    time.sleep(sample_s)
    after = _tcp_bytes_acked(fab, hosts)
    flows = []
    for (h, lp, pa, pp), acked in sorted(after.items()):
        sent = acked - before.get((h, lp, pa, pp), acked)
        if pa not in by_addr or {lp, pp} & set(exclude_ports) or sent < min_bytes:
            continue
        dst = by_addr[pa]
        flows.append(Flow(h, dst, lp, pp, flow_links(fab, h, dst, lp, pp), sent))
    return flows


def link_load(flows: list[Flow]) -> Counter:
    """Flows per directed link (link, from-node)."""
    return Counter(dl for f in flows for dl in f.links)


def busiest(fab: Fabric, flows: list[Flow], kind: str, directed: bool) -> tuple[str, str | None, int]:
    """The link of `kind` ("host-leaf" / "leaf-spine") carrying the most flows: (link, from-node or
    None, flows). With `directed`, the busiest single direction. Ties go to the first name."""
    load = link_load(flows)
    best: tuple[int, str, str | None] | None = None
    for lk in sorted(fab.links.values(), key=lambda lk: lk.name):
        if lk.kind != kind:
            continue
        options = [(load[(lk.name, lk.a)], lk.a), (load[(lk.name, lk.b)], lk.b)] if directed else \
            [(load[(lk.name, lk.a)] + load[(lk.name, lk.b)], None)]
        for n, frm in options:
            if best is None or n > best[0]:
                best = (n, lk.name, frm)
    if best is None:
        raise RuntimeError(f"this testbed has no {kind} link")
    return best[1], best[2], best[0]
