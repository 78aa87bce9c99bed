"""A TCP stall meter: how long a real TCP connection between two service addresses stops.

A client in the source host's namespace, bound to its service address (and, if asked, a chosen
source port, which picks the plane of the host's multipath route), sends a small timestamped
message every millisecond with TCP_NODELAY to a server in the destination host's namespace.
The receiver notes when each message arrives; the longest gap between consecutive arrivals is
the stall a fault caused (TCP delivers in order, so a lost segment holds back everything after
it until it is retransmitted). The ACKs take the destination's route back, hashed on their own
(`plane_for_flow(fab, dst, src, dport, sport)` tells their plane), so a cut on that plane
stalls the flow as well once the sender runs out of window. Both ends are threads of the calling process; everything is
bounded (duration, joins with timeouts) and every socket is closed.
"""
from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..kernel import netns as ns_io
from ..core.names import host_name
from .topology import Fabric

TCP_PORT = 45000
MAX_SECONDS = 600.0
_MSG = struct.Struct("!QQ")  # sequence, sender CLOCK_MONOTONIC ns


@dataclass
class StallResult:
    sport: int
    sent: int
    received: int
    max_gap_ms: float  # longest time between consecutive arrivals
    gap_start_ns: int  # CLOCK_MONOTONIC of the arrival before that gap
    gap_end_ns: int  # ... and of the one after it
    max_delay_ms: float  # longest send -> arrival time of a message (a pause of the sender does not count)
    broken: bool  # an error, a reset, or not everything delivered by the end of the drain
    error: str = ""
    arrivals_ns: list[int] = field(default_factory=list, repr=False)  # per received message

    @property
    def lost(self) -> int:
        return self.sent - self.received


def plane_for_flow(fab: Fabric, src_host: int, dst_host: int, sport: int, dport: int = TCP_PORT) -> int:
    """The plane the source host's route picks for this TCP 5-tuple (`ip route get`, which hashes
    the flow the way connect() does once the source port is bound)."""
    out = subprocess.run(["ip", "-n", fab.netns(host_name(src_host)), "route", "get", fab.service_addr(dst_host),
                          "from", fab.service_addr(src_host), "ipproto", "tcp", "sport", str(sport),
                          "dport", str(dport)], capture_output=True, text=True, check=True, timeout=5).stdout
    m = re.search(r"\bdev p(\d+)\b", out)
    if not m:
        raise RuntimeError(f"no plane device in `ip route get`: {out.strip()}")
    return int(m.group(1))


def sport_for_plane(fab: Fabric, src_host: int, dst_host: int, plane: int, dport: int = TCP_PORT,
                    first: int = 40000, tries: int = 64) -> int:
    """A source port whose flow the source host's route sends over `plane`."""
    for sport in range(first, first + tries):
        if plane_for_flow(fab, src_host, dst_host, sport, dport) == plane:
            return sport
    raise RuntimeError(f"no source port in {first}..{first + tries - 1} hashes onto plane {plane}")


class TcpFlow:
    """start() connects and starts sending; stop() ends the flow and returns the StallResult."""

    def __init__(self, fab: Fabric, src_host: int, dst_host: int, sport: int = 0, dport: int = TCP_PORT,
                 interval_s: float = 0.001, max_seconds: float = 60.0):
        if not 0 < max_seconds <= MAX_SECONDS:
            raise ValueError(f"max_seconds must be in (0, {MAX_SECONDS:.0f}], got {max_seconds}")
        self.fab, self.src, self.dst = fab, src_host, dst_host
        self.sport, self.dport, self.interval_s, self.max_seconds = sport, dport, interval_s, max_seconds
        self.sent = 0
        self.arrivals: list[int] = []
        self.max_delay_ns = 0
        self.error = ""
        self._stop = threading.Event()  # sender: stop sending
        self._abort = threading.Event()  # receiver: stop waiting for the rest
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._eof = False

    def start(self) -> TcpFlow:
        try:
            srv = ns_io.socket_in_netns(self.fab.netns(host_name(self.dst)), type=socket.SOCK_STREAM)
            self._socks.append(srv)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((self.fab.service_addr(self.dst), self.dport))
            srv.listen(1)
            srv.settimeout(5.0)
            cli = ns_io.socket_in_netns(self.fab.netns(host_name(self.src)), type=socket.SOCK_STREAM)
            self._socks.append(cli)
            cli.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cli.bind((self.fab.service_addr(self.src), self.sport))  # bound before connect: the route hashes it
            self.sport = cli.getsockname()[1]
            cli.settimeout(5.0)
            cli.connect((self.fab.service_addr(self.dst), self.dport))
            conn, _ = srv.accept()
            self._socks.append(conn)
            conn.settimeout(0.05)  # the receiver checks for the end this often
        except BaseException:
            self._close()
            raise
        self._threads = [threading.Thread(target=self._send, args=(cli,), name="tcpflow-tx", daemon=True),
                         threading.Thread(target=self._recv, args=(conn,), name="tcpflow-rx", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def _send(self, cli: socket.socket) -> None:
        deadline = time.monotonic() + self.max_seconds
        due = time.monotonic()
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                cli.sendall(_MSG.pack(self.sent, time.monotonic_ns()))
                self.sent += 1
                due += self.interval_s
                # late (a busy VM): carry on from now rather than sending a catch-up burst
                due = max(due, time.monotonic())
                time.sleep(max(0.0, due - time.monotonic()))
            cli.shutdown(socket.SHUT_WR)  # the receiver's EOF: everything sent has arrived
        except OSError as exc:
            self.error = self.error or f"send: {exc!r}"

    def _recv(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while not self._abort.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                now = time.monotonic_ns()
                if not data:
                    self._eof = True
                    return
                buf += data
                n = len(buf) // _MSG.size
                for k in range(n):
                    seq, sent_ns = _MSG.unpack_from(buf, k * _MSG.size)
                    if seq != len(self.arrivals):  # TCP is in order: anything else is a bug here
                        raise RuntimeError(f"message {seq} arrived as number {len(self.arrivals)}")
                    self.arrivals.append(now)
                    self.max_delay_ns = max(self.max_delay_ns, now - sent_ns)  # one clock for all namespaces
                buf = buf[n * _MSG.size:]
        except (OSError, RuntimeError) as exc:
            self.error = self.error or f"recv: {exc!r}"

    def stop(self, drain_s: float = 3.0) -> StallResult:
        """End sending, wait up to `drain_s` for the rest to arrive, close everything."""
        self._stop.set()
        tx, rx = self._threads or (None, None)
        if tx:
            tx.join(drain_s)
        if rx:
            rx.join(drain_s)  # until EOF: everything sent has arrived
            self._abort.set()
            rx.join(1.0)
        self._close()
        gaps = [(b - a, a, b) for a, b in zip(self.arrivals, self.arrivals[1:])]
        gap, start, end = max(gaps) if gaps else (0, 0, 0)
        broken = bool(self.error) or not self._eof or len(self.arrivals) != self.sent
        return StallResult(self.sport, self.sent, len(self.arrivals), gap / 1e6, start, end, self.max_delay_ns / 1e6,
                           broken, self.error, list(self.arrivals))

    def _close(self) -> None:
        close_with_reset(self._socks)


def close_with_reset(socks: list[socket.socket]) -> None:
    """Close every socket with a reset rather than a FIN: no TIME_WAIT, so the same source port
    can be used again at once; empties the list."""
    for s in socks:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        s.close()
    socks.clear()


def measure_stall(fab: Fabric, src_host: int, dst_host: int, seconds: float, sport: int = 0,
                  dport: int = TCP_PORT, on_start: Callable[[TcpFlow], None] | None = None) -> StallResult:
    """Run a flow for `seconds` (counted from connect); `on_start(flow)` runs meanwhile, e.g. to
    inject a fault, and its time counts towards `seconds`."""
    flow = TcpFlow(fab, src_host, dst_host, sport, dport, max_seconds=seconds + 1.0).start()
    t0 = time.monotonic()
    try:
        if on_start:
            on_start(flow)
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    finally:
        result = flow.stop()
    return result
