"""The entropy table's layout and codec: the healthy UDP source ports per (peer, plane), as the
bytes that live in shared memory. Pure: no files, no mappings, no clock.

Transports that choose their own source ports (RDMA QPs, the NCCL net plugin) read the table to
pick a port whose fabric path is healthy. The layout and both protocols are specified in
docs/entropy-table.md. The single writer is `linkpass.agent.entropy_writer.EntropyWriter`; the
readers are `linkpass_rdma.entropy` (Python) and `rdma/entropy_reader.c` (plain C).

    table_size, encode_header / decode_header, encode_entry / decode_entry, decode_snapshot,
    normalize (validation; every error names the field)
"""
from __future__ import annotations

import functools
import ipaddress
import stat
import struct
from dataclasses import dataclass
from typing import Iterable

from .constants import ENTROPY_PATH

DEFAULT_PATH = ENTROPY_PATH
# the system user the packaged agent runs as (deploy/systemd): readers trust a table it owns
AGENT_USER = "linkpass"

MAGIC = b"LPENTRPY"
VERSION = 1
HEADER_SIZE = 128
ENTRY_SIZE = 192
MAX_PORTS = 16
MAX_CAPACITY = 65536
DEFAULT_CAPACITY = 1024
MAX_PLANE = 0xFFFF

# header.table_flags
TABLE_RETIRED = 0x1  # this file was replaced by a new one at the same path: re-open it
# entry.flags
ENTRY_FAIL_STATIC = 0x1  # no path is healthy; these are the last usable ports (fail static)
ENTRY_FLAGS = ENTRY_FAIL_STATIC
# port_flags[i]
PORT_VERIFIED = 0x1  # answered probes in the current window
PORT_DEGRADED = 0x2  # usable but degraded (gray loss, latency): prefer others (the agent does not set it yet)
PORT_FLAGS = PORT_VERIFIED | PORT_DEGRADED

FAMILY_EMPTY, FAMILY_IPV4, FAMILY_IPV6 = 0, 4, 6

# header field offsets (docs/entropy-table.md is the specification; keep the two in step)
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_HEADER_SIZE = 10
OFF_ENTRY_SIZE = 12
OFF_MAX_PORTS = 14
OFF_CAPACITY = 16
OFF_TABLE_FLAGS = 20
OFF_FILE_SIZE = 24
OFF_WRITER_PID = 32
OFF_WRITER_PIDNS = 40
OFF_HEARTBEAT = 48
OFF_WRITE_BEGIN = 56
OFF_SEQ = 64
OFF_GENERATION = 72
OFF_COUNT = 80
OFF_UPDATE_REALTIME = 88
OFF_UPDATE_MONO = 96

_HEADER = struct.Struct("<8sHHHHIIQIIQQQQQI4xQQ24x")
_ENTRY = struct.Struct("<BBHI16sQ16H16I16s48x")
assert _HEADER.size == HEADER_SIZE and _ENTRY.size == ENTRY_SIZE

# reader defaults (the C reader uses the same numbers)
DEFAULT_RETRIES = 20000  # seqlock attempts before giving up
DEFAULT_STALE_NS = 1_000_000_000  # a write section open this long means its writer is gone


class EntropyError(Exception):
    """Base of every entropy-table error."""


class EntryError(EntropyError, ValueError):
    """An entry handed to the writer is invalid (the caller's mistake); the message names the field."""


class TableMissing(EntropyError):
    """No table file at the path (no writer has run): use default port selection."""


class TableBad(EntropyError):
    """The file is not a table this code understands (magic, version, sizes, truncated)."""


class TableUntrusted(TableBad):
    """The file, or its directory, could have been written by someone other than the agent: its
    ports would steer this host's traffic, so it is not read."""


class TableStale(EntropyError):
    """The writer died inside a write section (seq stays odd): the contents cannot be trusted."""


class TableBusy(EntropyError):
    """No consistent copy within the retry bound, but the writer looks alive: try again later."""


# ---- pure: whom a reader trusts -----------------------------------------------------------------


def trust_problem(mode: int, uid: int, trusted_uids: tuple[int, ...]) -> str | None:
    """Why a reader must not trust a table file or directory with this mode and owner, or None.
    Trusted: owned by one of `trusted_uids` (by default root, the reader's own uid and the agent's
    system user, AGENT_USER) and writable by no group or other user."""
    if uid not in trusted_uids:
        return (f"belongs to uid {uid}, not to root, this process's uid or the agent's user {AGENT_USER} "
                f"(trusted: {', '.join(map(str, trusted_uids))})")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by its group or others (mode {stat.S_IMODE(mode):04o})"
    return None


# ---- pure: layout and encoding -----------------------------------------------------------------


def table_size(capacity: int) -> int:
    """File size for `capacity` entry slots."""
    if not 1 <= capacity <= MAX_CAPACITY:
        raise EntryError(f"capacity must be 1..{MAX_CAPACITY}, got {capacity}")
    return HEADER_SIZE + capacity * ENTRY_SIZE


@dataclass(frozen=True)
class Entry:
    """Healthy source ports from this host's NIC `plane` to `peer`, best first."""

    peer: str  # IPv4 or IPv6 address, text
    plane: int  # local NIC / plane index, 0..65535
    ports: tuple[int, ...]  # up to MAX_PORTS UDP source ports, 1..65535
    path_ids: tuple[int, ...] = ()  # per port: the path id (u32, linkpass.core.paths.path_id as int); () = all 0
    port_flags: tuple[int, ...] = ()  # per port: PORT_* bits; () = all 0
    flags: int = 0  # ENTRY_* bits
    generation: int = 0  # table generation when the entry was last written (set by the writer)

    @property
    def key(self) -> tuple[int, bytes, int]:
        version, packed, _ = pack_addr(self.peer)
        return (version, packed, self.plane)


@functools.lru_cache(maxsize=1 << 16)
def pack_addr(text: str) -> tuple[int, bytes, str]:
    """(4 or 6, address bytes, canonical text); cached: an agent publishes the same peers again and again.
    Raises ValueError for anything that is not an IPv4 or IPv6 address."""
    a = ipaddress.ip_address(text)
    return a.version, a.packed, str(a)


@dataclass(frozen=True)
class Header:
    magic: bytes
    version: int
    header_size: int
    entry_size: int
    max_ports: int
    capacity: int
    table_flags: int
    file_size: int
    writer_pid: int
    writer_pidns: int
    heartbeat_mono_ns: int
    write_begin_mono_ns: int
    seq: int
    generation: int
    count: int
    update_realtime_ns: int
    update_mono_ns: int


@dataclass(frozen=True)
class Snapshot:
    """One consistent copy of the table."""

    header: Header
    entries: tuple[Entry, ...]

    def get(self, peer: str, plane: int) -> Entry | None:
        key = Entry(peer, plane, ()).key
        for e in self.entries:
            if e.key == key:
                return e
        return None


def check_entry(e: Entry, where: str) -> Entry:
    try:
        canonical = pack_addr(e.peer)[2]
    except (ValueError, TypeError):
        raise EntryError(f"{where}.peer: {e.peer!r} is not an IPv4 or IPv6 address") from None
    if not isinstance(e.plane, int) or not 0 <= e.plane <= MAX_PLANE:
        raise EntryError(f"{where}.plane: {e.plane!r} is not a plane index 0..{MAX_PLANE}")
    ports = tuple(e.ports)
    if len(ports) > MAX_PORTS:
        raise EntryError(f"{where}.ports: {len(ports)} ports, at most {MAX_PORTS} fit in an entry")
    for i, p in enumerate(ports):
        if not isinstance(p, int) or not 1 <= p <= 65535:
            raise EntryError(f"{where}.ports[{i}]: {p!r} is not a UDP port 1..65535")
    if len(set(ports)) != len(ports):
        raise EntryError(f"{where}.ports: duplicate ports in {list(ports)}")
    path_ids = tuple(e.path_ids) or (0,) * len(ports)
    if len(path_ids) != len(ports):
        raise EntryError(f"{where}.path_ids: {len(path_ids)} ids for {len(ports)} ports (one per port, or none)")
    for i, pid in enumerate(path_ids):
        if not isinstance(pid, int) or not 0 <= pid <= 0xFFFFFFFF:
            raise EntryError(f"{where}.path_ids[{i}]: {pid!r} is not a u32")
    port_flags = tuple(e.port_flags) or (0,) * len(ports)
    if len(port_flags) != len(ports):
        raise EntryError(f"{where}.port_flags: {len(port_flags)} flags for {len(ports)} ports (one per port, or none)")
    for i, f in enumerate(port_flags):
        if not isinstance(f, int) or f & ~PORT_FLAGS or f < 0:
            raise EntryError(f"{where}.port_flags[{i}]: {f!r} has bits outside PORT_VERIFIED|PORT_DEGRADED")
    if not isinstance(e.flags, int) or e.flags < 0 or e.flags & ~ENTRY_FLAGS:
        raise EntryError(f"{where}.flags: {e.flags!r} has bits outside ENTRY_FAIL_STATIC")
    return Entry(canonical, e.plane, ports, path_ids, port_flags, e.flags, e.generation)


def normalize(entries: Iterable[Entry], capacity: int = MAX_CAPACITY) -> list[Entry]:
    """Validate and sort by key (family, address bytes, plane); one entry per (peer, plane)."""
    out: dict[tuple, Entry] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, Entry):
            raise EntryError(f"entries[{i}]: expected an Entry, got {type(e).__name__}")
        e = check_entry(e, f"entries[{i}]")
        if e.key in out:
            raise EntryError(f"entries[{i}]: duplicate key (peer {e.peer}, plane {e.plane})")
        out[e.key] = e
    if len(out) > capacity:
        raise EntryError(f"entries: {len(out)} entries, the table holds {capacity} (capacity)")
    return [out[k] for k in sorted(out)]


def encode_entry(e: Entry, generation: int) -> bytes:
    """The 192 bytes of one slot (the entry must have passed normalize)."""
    version, packed, _ = pack_addr(e.peer)
    n = len(e.ports)
    pad = MAX_PORTS - n
    return _ENTRY.pack(version, n, e.plane, e.flags, packed.ljust(16, b"\0"), generation,
                       *e.ports, *(0,) * pad, *(e.path_ids or (0,) * n), *(0,) * pad,
                       bytes(e.port_flags or (0,) * n).ljust(16, b"\0"))


def decode_entry(buf: bytes, where: str = "entry") -> Entry | None:
    """One slot back to an Entry; None for an empty slot. Raises TableBad on garbage."""
    v = _ENTRY.unpack(buf)
    family, n, plane, flags, addr, gen = v[:6]
    if family == FAMILY_EMPTY:
        return None
    if family not in (FAMILY_IPV4, FAMILY_IPV6):
        raise TableBad(f"{where}.family: {family} (expected 0, 4 or 6)")
    if n > MAX_PORTS:
        raise TableBad(f"{where}.nports: {n} > {MAX_PORTS}")
    ports = v[6:6 + n]
    path_ids = v[22:22 + n]
    port_flags = tuple(v[38][:n])
    peer = str(ipaddress.IPv4Address(addr[:4]) if family == FAMILY_IPV4 else ipaddress.IPv6Address(addr))
    return Entry(peer, plane, tuple(ports), tuple(path_ids), port_flags, flags, gen)


def encode_header(capacity: int, *, writer_pid: int = 0, writer_pidns: int = 0, seq: int = 0,
                  generation: int = 0, count: int = 0, now_mono_ns: int = 0, now_realtime_ns: int = 0,
                  table_flags: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, ENTRY_SIZE, MAX_PORTS, capacity, table_flags,
                        table_size(capacity), writer_pid, 0, writer_pidns, now_mono_ns, now_mono_ns, seq,
                        generation, count, now_realtime_ns, now_mono_ns)


def decode_header(buf: bytes, file_size: int | None = None) -> Header:
    """Parse and check the fixed part of the header; TableBad names the field that is wrong."""
    if len(buf) < HEADER_SIZE:
        raise TableBad(f"file: {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header (truncated)")
    v = _HEADER.unpack(buf[:HEADER_SIZE])
    h = Header(magic=v[0], version=v[1], header_size=v[2], entry_size=v[3], max_ports=v[4], capacity=v[5],
               table_flags=v[6], file_size=v[7], writer_pid=v[8], writer_pidns=v[10], heartbeat_mono_ns=v[11],
               write_begin_mono_ns=v[12], seq=v[13], generation=v[14], count=v[15], update_realtime_ns=v[16],
               update_mono_ns=v[17])
    if h.magic != MAGIC:
        raise TableBad(f"magic: {h.magic!r}, expected {MAGIC!r} (not an entropy table)")
    if h.version != VERSION:
        raise TableBad(f"version: {h.version}, this reader knows layout version {VERSION}")
    if h.header_size != HEADER_SIZE or h.entry_size != ENTRY_SIZE or h.max_ports != MAX_PORTS:
        raise TableBad(f"header_size/entry_size/max_ports: {h.header_size}/{h.entry_size}/{h.max_ports}, "
                       f"expected {HEADER_SIZE}/{ENTRY_SIZE}/{MAX_PORTS}")
    if not 1 <= h.capacity <= MAX_CAPACITY:
        raise TableBad(f"capacity: {h.capacity}, expected 1..{MAX_CAPACITY}")
    if h.file_size != table_size(h.capacity):
        raise TableBad(f"file_size: {h.file_size}, expected {table_size(h.capacity)} for capacity {h.capacity}")
    if file_size is not None and file_size < h.file_size:
        raise TableBad(f"file: {file_size} bytes, header says {h.file_size} (truncated)")
    return h


def decode_snapshot(head: bytes, body: bytes) -> Snapshot:
    """One table from a copy of its header and of its first `count` slots (taken between two equal,
    even `seq` reads by a reader; under the writer's lock by a writer taking over)."""
    hdr = decode_header(head)
    if hdr.count > hdr.capacity:
        raise TableBad(f"count: {hdr.count} > capacity {hdr.capacity}")
    entries = []
    for i in range(hdr.count):
        e = decode_entry(body[i * ENTRY_SIZE:(i + 1) * ENTRY_SIZE], f"entries[{i}]")
        if e is None:
            raise TableBad(f"entries[{i}].family: 0 (empty) inside count {hdr.count}")
        entries.append(e)
    return Snapshot(hdr, tuple(entries))
