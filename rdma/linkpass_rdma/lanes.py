"""A transport's lane report (docs/lanes.md), the Python writer: `LaneReport` keeps this process's
file in the lanes directory, one slot per lane, so the LinkPass agent knows which paths the lanes
use and whether their acknowledged bytes advance. Used by `linkpass_rdma.channel`; any Python
transport can use it the same way:

    with LaneReport.open() as report:          # None-safe: no directory, no report, no error
        lane = report.claim("198.18.64.3", plane=0, sport=49153, kind=KIND_VERBS)
        lane.sent(4096)
        looked = time.monotonic_ns(); ...; lane.acked(4096); report.beat(looked)
        lane.release()

`beat(looked)` after every look for acknowledgements, with the time the look began: the agent
judges a stall at that time (docs/lanes.md), so it must not be written before the look is done.

A single writer (this process); each counter, the heartbeat and the seq words are single aligned
word stores (never struct.pack_into, which zeroes its target before filling it byte by byte: an
agent reading meanwhile would see a heartbeat of 0, a writer gone, or no bytes ever acknowledged,
a stall); a lane's identity goes through the slot's seq word, as the specification says, with a
CPU barrier (`linkpass.kernel._barrier.fence`, as the entropy table's Python writer) between the
steps, and progress before the acknowledged count, so a weakly ordered CPU keeps them in order.
"""
from __future__ import annotations

import errno
import ipaddress
import mmap
import os
import struct
import sys
import time

from linkpass.core.lanes import (FILE_PREFIX, HEADER_SIZE, KIND_TCP, KIND_VERBS, LANE_SIZE, OFF_BYTES_ACKED,
                                 OFF_BYTES_SENT, OFF_HEARTBEAT, OFF_PROGRESS, OFF_SEQ, OFF_USED, STATE_FREE,
                                 STATE_OPEN, encode_header, file_size)
from linkpass.kernel._barrier import fence

__all__ = ["LaneReport", "Lane", "KIND_TCP", "KIND_VERBS", "DEFAULT_DIR"]

DEFAULT_DIR = "/run/linkpass/lanes"
DEFAULT_CAPACITY = 64
_U32 = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"  # the report is little-endian; word stores are native
_IDENTITY = struct.Struct("<BBHHB5x16s")  # state .. peer, after the seq word


class Lane:
    """One claimed slot: count bytes handed to the lane and bytes the peer acknowledged."""

    def __init__(self, report: "LaneReport", slot: int):
        self.report, self.slot = report, slot
        self.off = HEADER_SIZE + slot * LANE_SIZE
        self.bytes_sent = self.bytes_acked = 0

    def sent(self, n: int) -> None:
        self.bytes_sent += n
        self.report.put64(self.off + OFF_BYTES_SENT, self.bytes_sent)

    def acked(self, n: int) -> None:
        if n <= 0:
            return
        self.bytes_acked += n
        # progress first, then the count: a reader that sees the count also sees when it moved
        self.report.put64(self.off + OFF_PROGRESS, time.monotonic_ns())
        fence()  # in this order on a weakly ordered CPU too (aarch64)
        self.report.put64(self.off + OFF_BYTES_ACKED, self.bytes_acked)

    def release(self) -> None:
        self.report._release(self)


class LaneReport:
    def __init__(self, path: str, fd: int, mm: mmap.mmap, capacity: int):
        self.path, self.fd, self.mm, self.capacity = path, fd, mm, capacity
        self._u64, self._u32 = memoryview(mm).cast("Q"), memoryview(mm).cast("I")
        self.free = list(range(capacity - 1, -1, -1))
        self.used = 0
        self._last_beat = 0
        self.beat(force=True)

    @classmethod
    def open(cls, directory: str | None = None, capacity: int = DEFAULT_CAPACITY) -> "LaneReport | None":
        """This process's report in `directory` ($LINKPASS_LANES_DIR, else the default), or None
        (said once on stderr) when the directory is missing or not writable: the transport runs
        exactly as before, only unreported."""
        directory = directory or os.environ.get("LINKPASS_LANES_DIR") or DEFAULT_DIR
        path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for attempt in (0, 1):
            try:
                fd = os.open(path, flags, 0o644)
                break
            except FileExistsError:
                try:
                    if attempt:
                        raise
                    os.unlink(path)  # an earlier process with this pid left it
                except OSError as exc:  # not ours to remove (another user's, or not a file): unreported
                    print(f"linkpass lanes: not reporting lanes ({path} exists and cannot be replaced: "
                          f"{exc.strerror or 'it came back'}); the agent probes this job's paths as it would "
                          "without reports", file=sys.stderr)
                    return None
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
                    print(f"linkpass lanes: not reporting lanes ({directory}: {exc.strerror}); "
                          "the agent probes this job's paths as it would without reports", file=sys.stderr)
                    return None
                raise
        try:
            os.ftruncate(fd, file_size(capacity))
            mm = mmap.mmap(fd, file_size(capacity), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        mm[:HEADER_SIZE] = encode_header(capacity, os.getpid())
        return cls(path, fd, mm, capacity)

    def beat(self, looked_ns: int | None = None, force: bool = False) -> None:
        """The heartbeat: `looked_ns`, when the writer's latest look at its lanes'
        acknowledgements began (None: now, a sign of life with nothing waiting), written once that
        look is done; at most one store per millisecond, however often it is called, and never
        backwards."""
        at = time.monotonic_ns() if looked_ns is None else looked_ns
        if at > self._last_beat and (force or at - self._last_beat >= 1_000_000):
            self._last_beat = at
            self.put64(OFF_HEARTBEAT, at)

    def claim(self, peer: str, plane: int, sport: int, kind: int) -> Lane | None:
        """A slot for a lane to `peer` (its address on `plane`) on ECMP source port `sport` (0: not
        a path the agent probes); None when every slot is taken (that lane goes unreported)."""
        if not self.free:
            return None
        slot = self.free.pop()
        lane = Lane(self, slot)
        if slot >= self.used:
            self.used = slot + 1
            self.put32(OFF_USED, self.used)
        ip = ipaddress.ip_address(peer)
        seq = _U32.unpack_from(self.mm, lane.off + OFF_SEQ)[0]
        self.put32(lane.off + OFF_SEQ, seq + 1)  # odd: identity changing (the reader skips the slot)
        fence()  # the odd seq is visible before any identity store
        for off in (OFF_BYTES_SENT, OFF_BYTES_ACKED, OFF_PROGRESS):
            self.put64(lane.off + off, 0)
        _IDENTITY.pack_into(self.mm, lane.off + 4, STATE_OPEN, ip.version, plane, sport, kind, ip.packed.ljust(16, b"\0"))
        fence()  # ... and every identity store before seq turns even
        self.put32(lane.off + OFF_SEQ, seq + 2)
        self.beat()
        return lane

    def _release(self, lane: Lane) -> None:
        seq = _U32.unpack_from(self.mm, lane.off + OFF_SEQ)[0]
        self.put32(lane.off + OFF_SEQ, seq + 1)
        fence()
        self.mm[lane.off + 4] = STATE_FREE
        fence()
        self.put32(lane.off + OFF_SEQ, seq + 2)
        self.free.append(lane.slot)

    def put64(self, off: int, value: int) -> None:
        """One aligned 8-byte store (`off` a multiple of 8): a reader sees the old value or this one."""
        self._u64[off >> 3] = value if _LITTLE else int.from_bytes(value.to_bytes(8, "little"), "big")

    def put32(self, off: int, value: int) -> None:
        """One aligned 4-byte store (`off` a multiple of 4)."""
        self._u32[off >> 2] = value if _LITTLE else int.from_bytes(value.to_bytes(4, "little"), "big")

    def close(self) -> None:
        """Remove the report: the agent stops counting these lanes at its next look."""
        if self.mm.closed:
            return
        self._u64.release()  # the map cannot close while views of it are held
        self._u32.release()
        self.mm.close()
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "LaneReport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
