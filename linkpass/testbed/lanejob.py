"""A job's lanes on the testbed: TCP streams between two hosts' plane addresses, one per plane,
each reported in a lane report (docs/lanes.md) the way the NCCL plugin reports its lanes, so the
agent sees which paths the job uses and whether they progress.

The sender writes a chunk on every lane each `every_s`; a lane's acknowledged bytes are the ones
the peer's TCP has acknowledged (what it sent less what its send queue still holds, SIOCOUTQ), as
a NIC's transport acknowledges an RDMA lane's bytes: the peer's kernel answers, not the job, so
the count moves while the job's own thread waits for the CPU (the receivers ask for quick
acknowledgements after each read, as an RDMA NIC acknowledges at once: TCP's delayed
acknowledgement, whose timer starts at 40 ms, held them past the 4 ms progress window). A stalled
path stops the acknowledgements while bytes wait: what the agent watches for. Two threads, as the
NCCL plugin has its progress thread beside the job: one writes the chunks and drains the
receivers (non-blocking sockets; a send here also forwards the bytes through the testbed's
software routers, which can take milliseconds), the other reads every lane's acknowledgements
each millisecond and writes the report's heartbeat after each such look. Everything is bounded and
closed.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass

from ..core.lanes import KIND_TCP
from ..core.names import host_name
from ..kernel import netns as ns_io
from .tcpflow import close_with_reset
from .topology import Fabric

LANE_PORT = 45100
LOOK_S = 0.001  # the acknowledgements are read this often
MAX_SECONDS = 600.0
_INT = struct.Struct("i")
RECV_BYTES = 1 << 18  # drained per receiver per tick, at most


@dataclass
class _Lane:
    plane: int
    dst: int
    tx: socket.socket  # the sender's end
    rx: socket.socket  # the receiver's end
    report: object  # linkpass_rdma.lanes.Lane, or None
    sent: int = 0
    received: int = 0  # receiver: bytes so far
    acked: int = 0  # sender: bytes the peer's TCP acknowledged


class LaneJob:
    """start() connects a lane per (destination, plane) and starts moving data; stop() ends it."""

    def __init__(self, fab: Fabric, src: int, dsts: list[int], planes: list[int], lanes_dir: str,
                 chunk: int = 16384, every_s: float = 0.002, max_seconds: float = 120.0):
        if not 0 < max_seconds <= MAX_SECONDS:
            raise ValueError(f"max_seconds must be in (0, {MAX_SECONDS:.0f}], got {max_seconds}")
        self.fab, self.src, self.dsts, self.planes = fab, src, dsts, planes
        self.lanes_dir, self.chunk, self.every_s, self.max_seconds = lanes_dir, chunk, every_s, max_seconds
        self.lanes: list[_Lane] = []
        self.report = None
        self.error = ""
        self.paused = threading.Event()  # set: the sender hands no new bytes (the job computes)
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread: threading.Thread | None = None
        self._looker: threading.Thread | None = None

    def start(self) -> LaneJob:
        from linkpass_rdma.lanes import LaneReport

        try:
            self.report = LaneReport.open(self.lanes_dir)
            for dst in self.dsts:
                for plane in self.planes:
                    self.lanes.append(self._connect(dst, plane))
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._run, name="lanejob", daemon=True)
        self._looker = threading.Thread(target=self._look, name="lanejob-acks", daemon=True)
        self._thread.start()
        self._looker.start()
        return self

    def _connect(self, dst: int, plane: int) -> _Lane:
        daddr, saddr = self.fab.nic_addr(dst, plane), self.fab.nic_addr(self.src, plane)
        srv = ns_io.socket_in_netns(self.fab.netns(host_name(dst)), type=socket.SOCK_STREAM)
        self._socks.append(srv)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((daddr, LANE_PORT))
        srv.listen(1)
        srv.settimeout(5.0)
        cli = ns_io.socket_in_netns(self.fab.netns(host_name(self.src)), type=socket.SOCK_STREAM)
        self._socks.append(cli)
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cli.bind((saddr, 0))
        cli.settimeout(5.0)
        cli.connect((daddr, LANE_PORT))
        conn, _ = srv.accept()
        self._socks.append(conn)
        srv.close()
        for s in (cli, conn):
            s.setblocking(False)
        lane = self.report.claim(daddr, plane, 0, KIND_TCP) if self.report is not None else None
        return _Lane(plane, dst, cli, conn, lane)

    def _run(self) -> None:
        payload = bytes(self.chunk)
        deadline = time.monotonic() + self.max_seconds
        due = time.monotonic()
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                wait = due - time.monotonic()
                if wait > 0:
                    self._stop.wait(wait)
                    continue
                due += self.every_s
                if due <= time.monotonic():  # a tick or more late: carry on from now, no catch-up burst
                    due = time.monotonic() + self.every_s
                for lane in self.lanes:
                    if not self.paused.is_set():
                        self._send(lane, payload)
                    self._drain(lane)
        except OSError as exc:
            self.error = f"{exc!r}"

    def _look(self) -> None:
        """The acknowledgements' thread: every LOOK_S, every lane's, then the heartbeat."""
        try:
            while not self._stop.wait(LOOK_S) and self._thread is not None and self._thread.is_alive():
                looked = time.monotonic_ns()
                for lane in self.lanes:
                    self._ack(lane)
                if self.report is not None:
                    self.report.beat(looked)  # every lane's acknowledgements read since `looked`
        except OSError as exc:
            self.error = f"{exc!r}"

    def _send(self, lane: _Lane, payload: bytes) -> None:
        try:
            n = lane.tx.send(payload)
        except BlockingIOError:
            return  # the window is full (a stalled path): the bytes already sent wait
        lane.sent += n
        if lane.report is not None:
            lane.report.sent(n)

    def _drain(self, lane: _Lane) -> None:
        """The receiver reads what arrived (its window stays open); bounded per tick."""
        got = 0
        while got < RECV_BYTES:
            try:
                data = lane.rx.recv(RECV_BYTES)
            except BlockingIOError:
                break
            if not data:
                break
            got += len(data)
        lane.received += got
        if got:  # quick acknowledgement is not sticky: the kernel falls back to delayed ones
            lane.rx.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def _ack(self, lane: _Lane) -> None:
        """What the peer's TCP acknowledged so far: sent less the bytes still in the send queue.
        `sent` is read first: a send between the two reads makes the count low, never high."""
        sent = lane.sent
        queued = _INT.unpack(fcntl.ioctl(lane.tx.fileno(), termios.TIOCOUTQ, b"\0" * _INT.size))[0]
        count = sent - queued
        if count > lane.acked:
            if lane.report is not None:
                lane.report.acked(count - lane.acked)
            lane.acked = count

    def stop(self) -> dict:
        """End the job; what each lane moved, {(dst, plane): (sent, acked)}."""
        self._stop.set()
        for thread in (self._thread, self._looker):
            if thread is not None:
                thread.join(5.0)
        out = {(lane.dst, lane.plane): (lane.sent, lane.acked) for lane in self.lanes}
        self._close()
        return out

    def _close(self) -> None:
        close_with_reset(self._socks)
        if self.report is not None:
            self.report.close()
            self.report = None
