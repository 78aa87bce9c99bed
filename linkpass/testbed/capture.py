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
    qpn: int | None = None  # RoCEv2 (UDP 4791): the destination queue pair in its BTH
    t: float = 0.0  # time.monotonic() when it was read
    opcode: int | None = None  # RoCEv2: the BTH opcode (0x00-0x1f reliable connected, 0x64 a UD SEND)


ROCE_V2_DPORT = 4791
BTH_LEN = 12


def udp_of(frame: bytes) -> tuple[str, str, int, int, int] | None:
    """(src, dst, sport, dport, ip_length) of an Ethernet frame carrying IPv4/UDP; None for
    anything else, and for a frame too short for the headers it claims."""
    got = _udp(frame)
    return got[:5] if got else None


def roce_bth(frame: bytes) -> tuple[int, int] | None:
    """(opcode, destination QP) from the BTH of a RoCEv2 frame (UDP to 4791); None for anything
    else or a frame too short for a BTH."""
    got = _udp(frame)
    if got is None or got[3] != ROCE_V2_DPORT or len(frame) < got[5] + BTH_LEN:
        return None
    return frame[got[5]], int.from_bytes(frame[got[5] + 5:got[5] + 8], "big")


def _udp(frame: bytes) -> tuple[str, str, int, int, int, int] | None:
    """udp_of's fields and the offset of the UDP payload in the frame."""
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
    return src, dst, sport, dport, total, off + ihl + 8


class Capture:
    """UDP packets (to `dport`, and from `sources`, if given) on `ifnames` of namespace `netns`,
    from start() to stop(); at most `limit` are kept."""

    def __init__(self, netns: str, ifnames: list[str], dport: int | None = None, limit: int = 200_000,
                 sources: set[str] | None = None):
        self.netns, self.ifnames, self.dport, self.limit = netns, list(ifnames), dport, limit
        self.sources = set(sources) if sources is not None else None
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
                if got is None or (self.dport is not None and got[3] != self.dport) or \
                        (self.sources is not None and got[0] not in self.sources):
                    continue
                if len(self.packets) < self.limit:
                    bth = roce_bth(frame)
                    self.packets.append(UdpPacket(ifname, *got, outgoing=addr[2] == socket.PACKET_OUTGOING,
                                                  qpn=bth[1] if bth else None, t=time.monotonic(),
                                                  opcode=bth[0] if bth else None))

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
