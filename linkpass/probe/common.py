"""What both probe engines share: a NIC's sockets, a probed path's spec, a completed exchange,
the path ids in use.

Per local NIC an engine owns two sockets, opened inside the host's namespace:

- a UDP socket bound to NIC:4791 that receives both requests from peers and replies to our
  own probes, with kernel RX timestamps (SO_TIMESTAMPNS);
- a raw IPv4 socket bound to the NIC (IP_HDRINCL) that sends requests and replies with any
  source port: the source port is what picks the fabric path. Headers are built as the kernel
  builds an unconnected DF datagram (IP id 0), which is what the RoCEv2 ICRC covers.

A request goes NIC_a:sport -> NIC_b:4791; the reply goes NIC_b:sport -> NIC_a:4791, so both
directions are RoCEv2 (destination port 4791) and the reverse path is fixed by the same port.
"""
from __future__ import annotations

import errno
import heapq
import socket
from dataclasses import dataclass

from ..core import wire
from ..core.telemetry import PathTelemetry
from ..kernel import netns as ns_io

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)


def check_engine_args(agent_id: int, jitter: float) -> None:
    if not 0 < agent_id < 2**32:
        raise ValueError(f"agent_id must be 1..{2**32 - 1}, got {agent_id}")
    if not 0 <= jitter < 1:
        raise ValueError("jitter must be in [0, 1): a fraction of the interval")


class ProbePortBusy(RuntimeError):
    """A NIC's RoCEv2 port is taken, so the sockets engine cannot receive there: the message says
    by what it likely is and what to set instead."""


def open_nic_sockets(netns: str | None, ifname: str, addr: str) -> tuple[socket.socket, socket.socket]:
    """(rx, tx) for one NIC, opened inside `netns`: UDP NIC:4791 with kernel RX timestamps, and
    a raw socket bound to the NIC for sending with any source port."""
    def make(*args) -> socket.socket:
        return ns_io.socket_in_netns(netns, *args) if netns else socket.socket(*args)

    rx = make(socket.AF_INET, socket.SOCK_DGRAM)
    tx = make(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    try:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            rx.bind((addr, wire.ROCE_PORT))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ProbePortBusy(
                f"UDP {addr}:{wire.ROCE_PORT} on {ifname} is taken: another LinkPass agent on this host, or a "
                f"kernel RoCE driver that receives RoCEv2 itself (Soft-RoCE, rdma_rxe, holds it once loaded); "
                f"on an RDMA host set probe.engine: verbs, else stop what holds it (ss -lunp sport = "
                f":{wire.ROCE_PORT})") from None
        rx.setblocking(False)
        tx.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, ifname.encode())
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        tx.setblocking(False)
    except OSError:
        rx.close()
        tx.close()
        raise
    return rx, tx


@dataclass(frozen=True, slots=True)
class ExchangeRecord:
    """One completed exchange as the engine hands it on (times in the agent's clock, ns)."""

    path_id: int
    peer_id: int
    seq: int
    t1: int
    t2: int
    t3: int
    t4: int


@dataclass(frozen=True)
class PathSpec:
    path_id: int
    nic: str  # local NIC name (the engine's key for it)
    peer_id: int  # agent id of the reflector
    peer_addr: str  # its NIC address
    sport: int
    interval_s: float = 0.001
    pad: int = 0  # padding for full-size probes
    pair_gap_s: float = 0.0  # > 0: coded pairs, a second probe this long after each (clock sync); C core only


@dataclass
class ProbedPath:
    """A path an engine probes: its spec and the telemetry its replies feed."""

    spec: PathSpec
    telemetry: PathTelemetry


class PathIds:
    """The path ids of one engine. A new id is the lowest free one: each peer's reflector keeps an
    entry per (agent, path id), so ids that grew with every plan change would fill its table with
    paths long gone. (A reused id is safe on the wire: the C core starts a new path's sequence
    above any the id carried before, which the reflector's replay window accepts.)"""

    MAX = 2**32 - 1

    def __init__(self):
        self._used: set[int] = set()
        self._free: list[int] = []  # heap of released ids below _next
        self._next = 1

    def lowest_free(self) -> int:
        """The lowest id not in use (not taken: claim() it)."""
        while self._free and self._free[0] in self._used:
            heapq.heappop(self._free)
        if self._free:
            return self._free[0]
        while self._next in self._used:
            self._next += 1
        if self._next > self.MAX:
            raise ValueError(f"all {self.MAX} path ids are in use")
        return self._next

    def claim(self, pid: int) -> None:
        """Mark an id chosen by the caller as in use."""
        if not 1 <= pid <= self.MAX:
            raise ValueError(f"path id must be 1..{self.MAX}, got {pid}")
        if pid in self._used:
            raise ValueError(f"path {pid} exists")
        self._used.add(pid)

    def release(self, pid: int) -> None:
        if pid in self._used:
            self._used.discard(pid)
            if pid < self._next:
                heapq.heappush(self._free, pid)

    def __len__(self) -> int:
        return len(self._used)
