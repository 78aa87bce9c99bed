"""Lane reports' layout and codec: which fabric paths a transport process's lanes use and how far
their acknowledged bytes have come, as the bytes of the file it writes. Pure: no files, no clock.

The specification is docs/lanes.md. Writers: the NCCL plugin (rdma/nccl/lp_lanes.c) and the RDMA
library (`linkpass_rdma.lanes`); the reader is the agent (`linkpass.agent.lanes_reader`).

    decode_header, decode_lanes (what a reader trusts), encode_header, encode_lane (writers, tests)
"""
from __future__ import annotations

import functools
import ipaddress
import struct
from dataclasses import dataclass
from typing import NamedTuple

MAGIC = b"LPLANES1"
VERSION = 1
HEADER_SIZE = 64
LANE_SIZE = 64
MAX_CAPACITY = 1024
FILE_PREFIX = "lanes."  # lanes.<pid>

STATE_FREE, STATE_OPEN = 0, 1
KIND_TCP, KIND_VERBS = 1, 2
KINDS = {KIND_TCP: "tcp", KIND_VERBS: "verbs"}

# header field offsets (docs/lanes.md)
OFF_USED = 20
OFF_HEARTBEAT = 24
# lane field offsets
OFF_SEQ = 0
OFF_BYTES_SENT = 32
OFF_BYTES_ACKED = 40
OFF_PROGRESS = 48

_HEADER = struct.Struct("<8sHHHHIIQ32x")
_LANE = struct.Struct("<IBBHHB5x16sQQQ8x")
assert _HEADER.size == HEADER_SIZE and _LANE.size == LANE_SIZE


class LanesBad(ValueError):
    """A report that is not a lane report of this version, or is damaged: ignored whole."""


@dataclass(frozen=True)
class Header:
    capacity: int
    pid: int
    used: int
    heartbeat_ns: int


class Lane(NamedTuple):  # a tuple: built for every lane at every look, every 2 ms
    slot: int
    peer: str
    family: int
    plane: int
    sport: int  # 0: the lane's path is not one the agent probes (every path of (peer, plane) is its)
    kind: int
    bytes_sent: int
    bytes_acked: int
    progress_ns: int  # CLOCK_MONOTONIC when bytes_acked last advanced; 0: never
    looked_ns: int = 0  # the report's heartbeat: when its writer last looked for acknowledgements


def file_size(capacity: int) -> int:
    return HEADER_SIZE + LANE_SIZE * capacity


def decode_header(buf: bytes, size: int) -> Header:
    """The header of a report whose file is `size` bytes; LanesBad names what is wrong."""
    if len(buf) < HEADER_SIZE:
        raise LanesBad(f"{len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, hsize, lsize, capacity, pid, used, heartbeat = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise LanesBad(f"magic {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise LanesBad(f"version {version}, this reader knows {VERSION}")
    if hsize != HEADER_SIZE or lsize != LANE_SIZE:
        raise LanesBad(f"header/lane sizes {hsize}/{lsize}, expected {HEADER_SIZE}/{LANE_SIZE}")
    if not 1 <= capacity <= MAX_CAPACITY:
        raise LanesBad(f"capacity {capacity} outside 1..{MAX_CAPACITY}")
    if size != file_size(capacity):
        raise LanesBad(f"file is {size} bytes, capacity {capacity} needs {file_size(capacity)}")
    return Header(capacity, pid, min(used, capacity), heartbeat)


def decode_lanes(copy: bytes, live: bytes | None = None, size: int | None = None) -> list[Lane]:
    """The open lanes of a report: `copy` is the file as read once from its start (the whole
    file, or at least the header and its `used` slots when `size` gives the file's size); `live`
    (same length or None), the same bytes read again after, whose `seq` words must equal the
    copy's for a lane to count: a lane whose identity changed in between is left for the next look."""
    head = decode_header(copy, len(copy) if size is None else size)
    if live is not None and len(live) != len(copy):
        raise LanesBad("the file changed size between two reads")
    out = []
    for slot in range(min(head.used, (len(copy) - HEADER_SIZE) // LANE_SIZE)):
        off = HEADER_SIZE + slot * LANE_SIZE
        seq, state, family, plane, sport, kind, peer, sent, acked, progress = _LANE.unpack_from(copy, off)
        if state != STATE_OPEN or seq & 1:
            continue
        if live is not None and live[off:off + 4] != copy[off:off + 4]:
            continue
        addr = _address(family, peer)
        if addr is None or kind not in KINDS:
            continue  # an unknown family or kind, or a damaged address: not a lane this reader can place
        out.append(Lane(slot, addr, family, plane, sport, kind, sent, min(acked, sent), progress, head.heartbeat_ns))
    return out


@functools.lru_cache(maxsize=4096)
def _address(family: int, raw: bytes) -> str | None:
    """The text of a lane's peer address (cached: a report names the same few peers every look)."""
    if family == 4 and not any(raw[4:]):
        return str(ipaddress.IPv4Address(raw[:4]))
    if family == 6:
        return str(ipaddress.IPv6Address(raw))
    return None


def encode_header(capacity: int, pid: int, used: int = 0, heartbeat_ns: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, LANE_SIZE, capacity, pid, used, heartbeat_ns)


def encode_lane(peer: str, plane: int, sport: int, kind: int, *, seq: int = 2, state: int = STATE_OPEN,
                bytes_sent: int = 0, bytes_acked: int = 0, progress_ns: int = 0) -> bytes:
    ip = ipaddress.ip_address(peer)
    raw = ip.packed.ljust(16, b"\0")
    return _LANE.pack(seq, state, ip.version, plane, sport, kind, raw, bytes_sent, bytes_acked, progress_ns)
