"""Real UDP traffic across the testbed, from one process: reachability, counted flows, ECMP paths.

Sockets are opened inside the host namespaces (see linkpass.kernel.netns) and driven from the
calling thread, so a check needs no helper processes. Receivers record the kernel RX
timestamp (SO_TIMESTAMPNS) and the ingress interface (IP_PKTINFO) of every packet.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass, field

from ..kernel.rtnl import IPRoute

from ..kernel import netns as ns_io
from ..core.constants import ROCE_PORT  # flows hash like RDMA traffic
from ..core.names import LEAF_SPINE, host_name
from .build import TestbedError
from .topology import Fabric, nic_ifname

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
_HDR = struct.Struct("!IIQ")  # flow id, sequence, sender TX time (ns, CLOCK_REALTIME)
MAX_PACKETS = 200_000  # bound on any single flow


@dataclass
class FlowResult:
    sent: int
    received: int
    tx_ns: list[int] = field(default_factory=list)  # per received packet, in arrival order
    rx_ns: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # IP packet size of each received packet
    ingress: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)

    @property
    def loss_pct(self) -> float:
        return 100.0 * (self.sent - self.received) / self.sent if self.sent else 0.0

    @property
    def one_way_ms(self) -> list[float]:
        return [(r - t) / 1e6 for t, r in zip(self.tx_ns, self.rx_ns)]

    def rate_bps(self) -> float:
        """Arrival rate of the received bytes (IP sizes), first to last packet."""
        if self.received < 2:
            return 0.0
        span = (self.rx_ns[-1] - self.rx_ns[0]) / 1e9
        return 8 * sum(self.sizes[1:]) / span if span > 0 else 0.0


def _receiver(ns: str, port: int) -> socket.socket:
    sock = ns_io.socket_in_netns(ns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
    sock.bind(("0.0.0.0", port))
    sock.setblocking(False)
    return sock


def _sender(ns: str, src: str, sport: int, device: str | None) -> socket.socket:
    sock = ns_io.socket_in_netns(ns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    if device:
        sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, device.encode())
    sock.bind((src, sport))
    sock.setblocking(False)
    return sock


def _ifnames(ns: str) -> dict[int, str]:
    with IPRoute(netns=ns) as ipr:
        return {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}


def _drain(sock: socket.socket, flow_id: int, out: FlowResult, names: dict[int, str]) -> int:
    got = 0
    while True:
        try:
            data, anc, _flags, _addr = sock.recvmsg(65535, 256)
        except BlockingIOError:
            return got
        if len(data) < _HDR.size:
            continue
        fid, seq, tx = _HDR.unpack_from(data)
        if fid != flow_id:
            continue
        rx = None
        ifname = "?"
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", payload[:16])
                rx = sec * 1_000_000_000 + nsec
            elif level == socket.IPPROTO_IP and kind == IP_PKTINFO:
                ifname = names.get(struct.unpack("i", payload[:4])[0], "?")
        out.received += 1
        out.seqs.append(seq)
        out.tx_ns.append(tx)
        out.rx_ns.append(rx if rx is not None else time.time_ns())
        out.sizes.append(len(data) + 28)
        out.ingress.append(ifname)
        got += 1


_flow_ids = iter(range(1, 1 << 31))


def send_flow(fab: Fabric, src_host: int, dst_host: int, *, plane: int | None = None,
              target: str = "nic", sport: int = 40000, dport: int = ROCE_PORT, count: int = 100,
              size: int = 128, interval_s: float = 0.0, settle_s: float = 0.3) -> FlowResult:
    """Send `count` UDP packets of `size` IP bytes from host `src_host` to `dst_host`.

    target="nic": to the destination's NIC address on `plane` (from ours on that plane).
    target="service": between service addresses; with `plane` set, pinned to that plane's
    NIC (SO_BINDTODEVICE), otherwise the host's ECMP route chooses by the 5-tuple.
    Both hosts must be namespace hosts (a Soft-RoCE guest is driven through testbed.guests).
    """
    for h in (src_host, dst_host):
        if fab.is_guest(h):
            raise TestbedError(f"{host_name(h)} is a Soft-RoCE guest: this traffic tool runs in namespace hosts; "
                               f"drive a guest with linkpass.testbed.guests.Control")
    if not 1 <= count <= MAX_PACKETS:
        raise ValueError(f"count must be 1..{MAX_PACKETS}, got {count}")
    if not 28 + _HDR.size <= size <= fab.spec.mtu:
        raise ValueError(f"size must be {28 + _HDR.size}..{fab.spec.mtu} bytes (IP packet), got {size}")
    if target == "nic":
        if plane is None:
            raise ValueError("target='nic' needs a plane")
        src, dst = fab.nic_addr(src_host, plane), fab.nic_addr(dst_host, plane)
    elif target == "service":
        src, dst = fab.service_addr(src_host), fab.service_addr(dst_host)
    else:
        raise ValueError(f"target must be 'nic' or 'service', got {target!r}")
    flow_id = next(_flow_ids)
    dst_ns = fab.netns(host_name(dst_host))
    names = _ifnames(dst_ns)
    rx = _receiver(dst_ns, dport)
    tx = _sender(fab.netns(host_name(src_host)), src, sport, nic_ifname(plane) if plane is not None else None)
    out = FlowResult(sent=0, received=0)
    pad = b"\0" * (size - 28 - _HDR.size)
    try:
        next_send = time.perf_counter()
        for seq in range(count):
            if interval_s:
                while True:
                    wait = next_send - time.perf_counter()
                    if wait <= 0:
                        break
                    select.select([rx], [], [], wait)
                    _drain(rx, flow_id, out, names)
                next_send += interval_s
            while True:
                try:
                    tx.sendto(_HDR.pack(flow_id, seq, time.time_ns()) + pad, (dst, dport))
                    break
                except BlockingIOError:  # local queue full (e.g. a rate limit): wait, bounded
                    select.select([], [tx], [], 0.05)
                except OSError:  # e.g. ENETUNREACH while a link is down: counts as lost
                    break
            out.sent += 1
            if seq % 64 == 0:
                _drain(rx, flow_id, out, names)
        deadline = time.perf_counter() + settle_s
        while time.perf_counter() < deadline and out.received < out.sent:
            select.select([rx], [], [], max(0.0, deadline - time.perf_counter()))
            _drain(rx, flow_id, out, names)
    finally:
        rx.close()
        tx.close()
    order = sorted(range(out.received), key=lambda k: out.rx_ns[k])
    for name in ("tx_ns", "rx_ns", "sizes", "ingress", "seqs"):
        values = getattr(out, name)
        setattr(out, name, [values[k] for k in order])
    return out


def reachability(fab: Fabric, tries: int = 3) -> list[dict]:
    """Every host to every other host, over every plane, to NIC and service addresses.

    A row is ok when a packet arrived on the destination's NIC of that plane.
    """
    rows = []
    H, P = fab.spec.hosts, fab.spec.planes
    for i in range(H):
        for j in range(H):
            if i == j or fab.is_guest(i) or fab.is_guest(j):
                continue  # guests: tests/root/test_rdma_guests.py checks their reachability
            for p in range(P):
                for target in ("nic", "service"):
                    res = send_flow(fab, i, j, plane=p, target=target, sport=41000 + p, count=tries,
                                    settle_s=0.5)
                    ok = res.received > 0 and all(name == nic_ifname(p) for name in res.ingress)
                    rows.append({"src": host_name(i), "dst": host_name(j), "plane": p, "target": target,
                                 "ok": ok, "received": res.received, "sent": res.sent,
                                 "ingress": sorted(set(res.ingress))})
    return rows


def link_counters(fab: Fabric, node: str) -> dict[str, dict[str, int]]:
    with IPRoute(netns=fab.netns(node)) as ipr:
        out = {}
        for link in ipr.get_links():
            stats = link.get_attr("IFLA_STATS64")
            out[link.get_attr("IFLA_IFNAME")] = {
                "tx_packets": stats["tx_packets"], "rx_packets": stats["rx_packets"],
                "tx_bytes": stats["tx_bytes"], "rx_bytes": stats["rx_bytes"],
            }
        return out


def spine_for_sport(fab: Fabric, src_host: int, dst_host: int, plane: int, sport: int,
                    packets: int = 20, target: str = "nic", dport: int = ROCE_PORT) -> str | None:
    """Which spine a flow with this source port takes (by the source leaf's TX counters).

    None when both hosts hang off the same leaf (no spine on the way).
    """
    leaf = fab.leaf_of(src_host, plane)
    if leaf == fab.leaf_of(dst_host, plane):
        return None
    uplinks = {lk.end(leaf)[0]: lk.b for lk in fab.links_of(leaf) if lk.kind == LEAF_SPINE}  # ifname -> spine
    before = link_counters(fab, leaf)
    res = send_flow(fab, src_host, dst_host, plane=plane, target=target, sport=sport, dport=dport, count=packets)
    after = link_counters(fab, leaf)
    deltas = {s: after[s]["tx_packets"] - before[s]["tx_packets"] for s in uplinks}
    best = max(deltas, key=deltas.get)
    if deltas[best] < packets or res.received < packets // 2:
        raise RuntimeError(f"could not tell the spine of sport {sport}: uplink deltas {deltas}, "
                           f"{res.received}/{packets} delivered")
    return uplinks[best]
