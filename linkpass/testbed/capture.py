"""Seeing traffic on the wire: which UDP flows cross which testbed interfaces.

A RoCEv2 queue pair's path is decided by its packets' 5-tuple, so the proof that steering works
is on the wire: the packets of a QP steered to port X carry X and cross the spine X hashes to.
`Capture` reads every frame of some interfaces of one namespace (an AF_PACKET socket each, in a
thread) and keeps the UDP ones that match; `udp_of` is the pure frame parser.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..kernel import netns as ns_io

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_8021Q = 0x8100
IPPROTO_UDP = 17


@dataclass(frozen=True)
class UdpPacket:
    ifname: str
    src: str
    dst: str
    sport: int
    dport: int
    length: int  # of the IP packet
    outgoing: bool  # sent by this interface (else received on it)


def udp_of(frame: bytes) -> tuple[str, str, int, int, int] | None:
    """(src, dst, sport, dport, ip_length) of an Ethernet frame carrying IPv4/UDP; None for
    anything else, and for a frame too short for the headers it claims."""
    if len(frame) < 14:
        return None
    off, ethertype = 14, struct.unpack_from("!H", frame, 12)[0]
    if ethertype == ETH_P_8021Q:
        if len(frame) < 18:
            return None
        off, ethertype = 18, struct.unpack_from("!H", frame, 16)[0]
    if ethertype != ETH_P_IP or len(frame) < off + 20:
        return None
    vihl = frame[off]
    ihl = (vihl & 0x0F) * 4
    if vihl >> 4 != 4 or ihl < 20 or frame[off + 9] != IPPROTO_UDP or len(frame) < off + ihl + 8:
        return None
    frag = struct.unpack_from("!H", frame, off + 6)[0]
    if frag & 0x1FFF:
        return None  # a later fragment has no UDP header
    total = struct.unpack_from("!H", frame, off + 2)[0]
    src, dst = socket.inet_ntoa(frame[off + 12:off + 16]), socket.inet_ntoa(frame[off + 16:off + 20])
    sport, dport = struct.unpack_from("!HH", frame, off + ihl)
    return src, dst, sport, dport, total


class Capture:
    """UDP packets (to `dport`, if given) on `ifnames` of namespace `netns`, from start() to stop()."""

    def __init__(self, netns: str, ifnames: list[str], dport: int | None = None, limit: int = 200_000):
        self.netns, self.ifnames, self.dport, self.limit = netns, list(ifnames), dport, limit
        self.packets: list[UdpPacket] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []

    def start(self) -> "Capture":
        for ifname in self.ifnames:
            s = ns_io.socket_in_netns(self.netns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((ifname, 0))
            s.setblocking(False)
            self._socks.append(s)
            t = threading.Thread(target=self._read, args=(s, ifname), daemon=True, name=f"capture-{ifname}")
            t.start()
            self._threads.append(t)
        return self

    def _read(self, s: socket.socket, ifname: str) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([s], [], [], 0.05)
            if not ready:
                continue
            for _ in range(256):
                try:
                    frame, addr = s.recvfrom(65535)
                except BlockingIOError:
                    break
                got = udp_of(frame)
                if got is None or (self.dport is not None and got[3] != self.dport):
                    continue
                if len(self.packets) < self.limit:
                    self.packets.append(UdpPacket(ifname, *got, outgoing=addr[2] == socket.PACKET_OUTGOING))

    def stop(self) -> list[UdpPacket]:
        time.sleep(0.1)  # what is in flight lands in the socket buffers
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for s in self._socks:
            s.close()
        return self.packets

    def __enter__(self) -> "Capture":
        return self.start()

    def __exit__(self, *exc) -> None:
        if not self._stop.is_set():
            self.stop()

    def by_flow(self, outgoing: bool | None = None) -> Counter:
        """Packets per (ifname, src, dst, sport)."""
        return Counter((p.ifname, p.src, p.dst, p.sport) for p in self.packets
                       if outgoing is None or p.outgoing == outgoing)
