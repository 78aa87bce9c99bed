"""Entropy table: the healthy UDP source ports per (peer, plane), in shared memory, for C readers.

Transports that choose their own source ports (RDMA QPs, the NCCL net plugin) read this table to
pick a port whose fabric path is healthy. The layout and both protocols are specified in
docs/entropy-table.md; `rdma/entropy_reader.c` is a reader in plain C that proves it.

    pure     table_size, encode_header / decode_header, encode_entry / decode_entry,
             normalize (validation; every error names the field), entries_from_paths
    I/O      EntropyWriter (the single writer: create / take over, publish, update, remove,
             heartbeat, close) and EntropyReader / read_table / lookup (seqlock readers)

On memory ordering (what Python does and does not guarantee). Python has no fences and no
atomics. The writer relies on three facts, and refuses to run where they do not hold:
  1. Counters (seq, generation, heartbeat, ...) are stored through a memoryview cast to 'Q'. CPython
     packs such an item with a fixed-size 8-byte memcpy, which the compiler emits as one 8-byte
     store; the fields are 8-byte aligned in a page-aligned mapping, so the store is single-copy
     atomic on x86-64. (A plain `mm[a:b] = bytes` of 8 bytes would go through a general memcpy,
     which promises nothing about store width.)
  2. x86-64 is TSO: stores become visible to other cores in program order, and loads are not
     reordered with other loads. The interpreter executes our statements in order and each one
     finishes its stores before the next begins, so "seq odd ; data ; seq even" reaches a reader
     in that order, and a reader's "seq ; copy ; seq" loads happen in that order. The one x86
     exception, non-temporal stores (glibc memcpy uses them for very large copies), is closed by
     the sfence glibc issues at the end of such a copy, and our slot writes are 192 bytes anyway.
  3. Nothing here is guaranteed by the Python language: it is CPython on x86-64 (checked at
     writer open: on other architectures, e.g. aarch64, stores can be reordered and a writer
     needs real barriers -- write it in C with __atomic builtins like the reader).
The C reader does use acquire loads and an acquire fence, which is what a reader needs on any
architecture.
"""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import mmap
import os
import platform
import struct
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

DEFAULT_PATH = "/dev/shm/linkpass-entropy"

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
PORT_DEGRADED = 0x2  # usable but degraded (gray loss, latency); prefer others
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


class TableStale(EntropyError):
    """The writer died inside a write section (seq stays odd): the contents cannot be trusted."""


class TableBusy(EntropyError):
    """No consistent copy within the retry bound, but the writer looks alive: try again later."""


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
        version, packed, _ = _addr(self.peer)
        return (version, packed, self.plane)


@functools.lru_cache(maxsize=1 << 16)
def _addr(text: str) -> tuple[int, bytes, str]:
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


def _check_entry(e: Entry, where: str) -> Entry:
    try:
        canonical = _addr(e.peer)[2]
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
        e = _check_entry(e, f"entries[{i}]")
        if e.key in out:
            raise EntryError(f"entries[{i}]: duplicate key (peer {e.peer}, plane {e.plane})")
        out[e.key] = e
    if len(out) > capacity:
        raise EntryError(f"entries: {len(out)} entries, the table holds {capacity} (capacity)")
    return [out[k] for k in sorted(out)]


def encode_entry(e: Entry, generation: int) -> bytes:
    """The 192 bytes of one slot (the entry must have passed normalize)."""
    version, packed, _ = _addr(e.peer)
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


def entries_from_paths(table, plane_of: Mapping[str, int], healthy: Callable[[str, str, str], bool],
                       max_ports: int = MAX_PORTS) -> list[Entry]:
    """Entries from a linkpass.core.paths.PathTable: per (peer, local NIC), the ports of the paths that
    reached the peer and that `healthy(peer, local, path_id)` accepts, spread over paths round-robin
    (so the first ports cover as many distinct paths as possible). If no path is healthy, every
    reached path's ports are kept with ENTRY_FAIL_STATIC (never publish an empty set for a peer that
    still has a usable path)."""
    out = []
    for (peer, local), pp in sorted(table.entries.items()):
        if local not in plane_of:
            raise EntryError(f"plane_of: no plane index for local NIC {local!r}")
        reached = pp.reached()
        good = [p for p in reached if healthy(peer, local, p.id)]
        flags, use = (0, good) if good else (ENTRY_FAIL_STATIC, reached)
        ports, ids, seen = [], [], set()
        for i in range(max(len(p.ports) for p in use) if use else 0):
            for p in use:
                if i < len(p.ports) and p.ports[i] not in seen and len(ports) < max_ports:
                    seen.add(p.ports[i])
                    ports.append(p.ports[i])
                    ids.append(int(p.id, 16))
        pflags = [0 if flags else PORT_VERIFIED] * len(ports)
        out.append(Entry(peer, plane_of[local], tuple(ports), tuple(ids), tuple(pflags), flags))
    return out


# ---- I/O: the writer ------------------------------------------------------------------------------


def _tso() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class EntropyWriter:
    """The single writer of one table. Not thread-safe: one writer, one thread.

    Opening takes over a compatible existing file in place (readers that keep it mapped keep
    working; a section left open by a killed writer is closed by the first publish), or else
    creates a new file atomically (temp file in the same directory + rename) and marks the old
    one RETIRED. The table starts empty unless `keep=True` (then the existing entries are kept
    if the file was consistent).
    """

    def __init__(self, path: str = DEFAULT_PATH, capacity: int = DEFAULT_CAPACITY, *, keep: bool = False,
                 mono_ns: Callable[[], int] = time.monotonic_ns, realtime_ns: Callable[[], int] = time.time_ns):
        if not _tso():
            raise EntropyError(f"the Python writer relies on x86-64 store ordering; this is {platform.machine()} "
                               "(see the module docstring)")
        self.path = path
        self.capacity = capacity
        self.size = table_size(capacity)
        self._mono, self._real = mono_ns, realtime_ns
        self._entries: dict[tuple, Entry] = {}  # key -> entry as stored (with its generation)
        self._enc: dict[tuple, bytes] = {}  # key -> its 192-byte slot
        self._slots: list[bytes] = []  # what each slot 0..count-1 holds now
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._open(keep)

    # -- lifecycle
    def _open(self, keep: bool) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            self._replace()
            return
        try:
            self._lock(fd)  # also when the file is then replaced: never rename over a live writer
            head = os.pread(fd, HEADER_SIZE, 0)
            if len(head) >= len(MAGIC) and head[:len(MAGIC)] != MAGIC:
                raise EntropyError(f"{self.path}: holds something that is not an entropy table; "
                                   "not overwriting it (remove it or choose another path)")
            try:
                ok = decode_header(head, os.fstat(fd).st_size).capacity == self.capacity
            except TableBad:
                ok = False  # another version / capacity, or truncated: replace it
            if not ok:
                self._replace()
                os.close(fd)
                return
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        old = None
        if keep:
            try:
                old = _read_mapped(self._mm, retries=100, stale_ns=0, pid_check=False)
            except EntropyError:
                old = None  # a killed writer's torn table: start empty
        self._u64(OFF_WRITER_PIDNS, _pidns())
        self._u32(OFF_WRITER_PID, os.getpid())
        self._u64(OFF_HEARTBEAT, self._mono())
        # the first section rewrites every slot: whatever a dead writer left half-written goes
        self._publish_map({e.key: e for e in old.entries} if old else {}, full=True)

    def _lock(self, fd: int) -> None:
        """One writer per table: an exclusive flock held while the writer is open."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = struct.unpack("<I", os.pread(fd, 4, OFF_WRITER_PID))[0]
            raise EntropyError(f"{self.path}: another writer (pid {pid}) has the table open") from None

    def _replace(self) -> None:
        """Build a fresh file next to the path and rename it over (readers never see it half-made)."""
        d = os.path.dirname(os.path.abspath(self.path))
        tmp = os.path.join(d, f".{os.path.basename(self.path)}.{os.getpid()}.tmp")
        now_m, now_r = self._mono(), self._real()
        try:
            os.unlink(tmp)  # left by a crashed process that had our pid: ours to remove
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, self.size)
            os.pwrite(fd, encode_header(self.capacity, writer_pid=os.getpid(), writer_pidns=_pidns(),
                                        now_mono_ns=now_m, now_realtime_ns=now_r), 0)
            self._lock(fd)
            mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        try:
            old_fd = os.open(self.path, os.O_RDWR)
        except OSError:
            old_fd = -1
        try:
            os.rename(tmp, self.path)
        except BaseException:
            if old_fd >= 0:
                os.close(old_fd)
            mm.close()
            os.close(fd)
            os.unlink(tmp)
            raise
        if old_fd >= 0:
            self._retire(old_fd)  # after the rename: a reader that re-opens finds the new file
            os.close(old_fd)
        self._fd, self._mm, self._slots = fd, mm, []

    @staticmethod
    def _retire(fd: int) -> None:
        """Tell readers that keep the old file mapped to re-open the path (best effort)."""
        try:
            if os.fstat(fd).st_size >= HEADER_SIZE and os.pread(fd, 8, 0) == MAGIC:
                with mmap.mmap(fd, HEADER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                    mv = memoryview(mm)
                    cell = mv[OFF_TABLE_FLAGS:OFF_TABLE_FLAGS + 4].cast("I")
                    cell[0] = cell[0] | TABLE_RETIRED
                    cell.release()
                    mv.release()
        except OSError:
            pass

    def close(self, unlink: bool = False) -> None:
        """Detach: writer_pid 0 = no writer (the last table stays readable: fail static). `unlink`
        removes the file instead."""
        if self._mm is None:
            return
        self._u32(OFF_WRITER_PID, 0)
        self._mm.close()
        self._mm = None
        os.close(self._fd)  # releases the flock
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "EntropyWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- atomic cells (see the module docstring, fact 1)
    def _u64(self, off: int, value: int | None = None) -> int:
        mv = memoryview(self._mm)[off:off + 8].cast("Q")
        try:
            if value is not None:
                mv[0] = value
            return mv[0]
        finally:
            mv.release()

    def _u32(self, off: int, value: int) -> None:
        mv = memoryview(self._mm)[off:off + 4].cast("I")
        mv[0] = value
        mv.release()

    # -- the seqlock write section
    def _begin(self) -> int:
        seq = self._u64(OFF_SEQ)
        # write_begin first: a reader that sees seq odd must not see an old begin time (false stale)
        self._u64(OFF_WRITE_BEGIN, self._mono())
        if seq % 2 == 0:
            seq += 1
            self._u64(OFF_SEQ, seq)  # odd: readers retry from here on
        # (seq already odd: a killed writer's section; we finish it)
        return seq

    def _end(self, seq: int) -> None:
        self._u64(OFF_SEQ, seq + 1)  # even: every store above is visible before this one (TSO)

    # -- public API
    def publish(self, entries: Iterable[Entry]) -> int:
        """Replace the whole table; returns the new generation."""
        norm = normalize(entries, self.capacity)
        return self._publish_map({e.key: e for e in norm})

    def update(self, peer: str, plane: int, ports: Iterable[int], path_ids: Iterable[int] = (),
               port_flags: Iterable[int] = (), flags: int = 0) -> int:
        """Set one (peer, plane) entry (inserted if new); returns the new generation."""
        e = _check_entry(Entry(peer, plane, tuple(ports), tuple(path_ids), tuple(port_flags), flags), "entry")
        m = dict(self._entries)
        if e.key not in m and len(m) >= self.capacity:
            raise EntryError(f"entry: table full ({self.capacity} entries, capacity)")
        m[e.key] = e
        return self._publish_map(m)

    def remove(self, peer: str, plane: int) -> int:
        """Drop one entry (no-op if absent); returns the generation."""
        key = _check_entry(Entry(peer, plane, ()), "entry").key
        if key not in self._entries:
            return self.generation
        m = dict(self._entries)
        del m[key]
        return self._publish_map(m)

    def heartbeat(self) -> None:
        """Say the writer is alive (call every ~100 ms when nothing changes). Outside the seqlock."""
        self._u64(OFF_HEARTBEAT, self._mono())

    @property
    def generation(self) -> int:
        return self._u64(OFF_GENERATION)

    def entries(self) -> list[Entry]:
        return [self._entries[k] for k in sorted(self._entries)]

    def _publish_map(self, m: dict[tuple, Entry], full: bool = False) -> int:
        if self._mm is None:
            raise EntropyError("writer is closed")
        gen = self._u64(OFF_GENERATION) + 1
        # an entry keeps its generation (and its encoding) if it did not change, so readers can tell
        # what moved and an update costs one encode, not one per entry
        new_entries: dict[tuple, Entry] = {}
        new_enc: dict[tuple, bytes] = {}
        for k, e in m.items():
            old = self._entries.get(k)
            if old is not None and (old is e or (old.ports, old.path_ids, old.port_flags, old.flags) == (
                    e.ports, e.path_ids, e.port_flags, e.flags)):
                new_entries[k], new_enc[k] = old, self._enc[k]
            else:
                ne = Entry(e.peer, e.plane, e.ports, e.path_ids, e.port_flags, e.flags, gen)
                new_entries[k], new_enc[k] = ne, encode_entry(ne, gen)
        slots = [new_enc[k] for k in sorted(new_entries)]
        n_old = len(self._slots)
        if not full and slots == self._slots:
            self.heartbeat()  # nothing changed: no section, no new generation
            return gen - 1
        empty = bytes(ENTRY_SIZE)
        # everything is encoded and the changed slots chosen before the section opens, so the odd
        # window is only the memory copies
        writes = [(HEADER_SIZE + i * ENTRY_SIZE, s) for i, s in enumerate(slots)
                  if full or i >= n_old or self._slots[i] != s]
        writes += [(HEADER_SIZE + i * ENTRY_SIZE, empty) for i in range(len(slots), self.capacity if full else n_old)]
        mm = self._mm
        seq = self._begin()
        for off, s in writes:
            mm[off:off + ENTRY_SIZE] = s
        self._u64(OFF_GENERATION, gen)
        self._u32(OFF_COUNT, len(slots))
        now = self._mono()
        self._u64(OFF_UPDATE_REALTIME, self._real())
        self._u64(OFF_UPDATE_MONO, now)
        self._end(seq)
        self._u64(OFF_HEARTBEAT, now)
        self._slots = slots
        self._entries, self._enc = new_entries, new_enc
        return gen


# ---- I/O: readers -------------------------------------------------------------------------------


def _pid_dead(pid: int, pidns: int) -> bool:
    """True only when we can tell: same pid namespace and kill(pid, 0) says no such process."""
    if pid == 0:
        return True  # writer detached (close) or never recorded
    if pidns and pidns != _pidns():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read_mapped(mm, *, retries: int = DEFAULT_RETRIES, stale_ns: int = DEFAULT_STALE_NS,
                 pid_check: bool = True, mono_ns: Callable[[], int] = time.monotonic_ns) -> Snapshot:
    """The seqlock read (docs/entropy-table.md, "Reader protocol")."""
    size = len(mm)
    hdr0 = decode_header(bytes(mm[:HEADER_SIZE]), size)
    cap = hdr0.capacity
    mv = memoryview(mm)
    seq_cell = mv[OFF_SEQ:OFF_SEQ + 8].cast("Q")
    try:
        odd_seq, odd_spins = None, 0
        for attempt in range(max(1, retries)):
            s0 = seq_cell[0]  # x86-64: loads are not reordered with loads (module docstring, fact 2)
            if s0 & 1:
                odd_spins = odd_spins + 1 if s0 == odd_seq else 1
                odd_seq = s0
                if odd_spins % 64 == 0:
                    h = decode_header(bytes(mm[:HEADER_SIZE]))
                    if pid_check and _pid_dead(h.writer_pid, h.writer_pidns):
                        raise TableStale(f"seq {s0} odd and writer pid {h.writer_pid} is gone "
                                         "(it died mid-update)")
                    if stale_ns and mono_ns() - h.write_begin_mono_ns > stale_ns:
                        raise TableStale(f"seq {s0} odd for {(mono_ns() - h.write_begin_mono_ns) / 1e6:.0f} ms "
                                         "(writer stuck or dead)")
                    os.sched_yield()
                continue
            head = bytes(mm[:HEADER_SIZE])
            count = struct.unpack_from("<I", head, OFF_COUNT)[0]
            body = bytes(mm[HEADER_SIZE:HEADER_SIZE + min(count, cap) * ENTRY_SIZE])
            if seq_cell[0] != s0:
                if attempt % 16 == 15:
                    os.sched_yield()
                continue
            hdr = decode_header(head)
            if hdr.count > cap:
                raise TableBad(f"count: {hdr.count} > capacity {cap}")
            entries = []
            for i in range(hdr.count):
                e = decode_entry(body[i * ENTRY_SIZE:(i + 1) * ENTRY_SIZE], f"entries[{i}]")
                if e is None:
                    raise TableBad(f"entries[{i}].family: 0 (empty) inside count {hdr.count}")
                entries.append(e)
            return Snapshot(hdr, tuple(entries))
    finally:
        seq_cell.release()
        mv.release()
    h = decode_header(bytes(mm[:HEADER_SIZE]))
    if h.seq & 1:
        if pid_check and _pid_dead(h.writer_pid, h.writer_pidns):
            raise TableStale(f"seq {h.seq} odd and writer pid {h.writer_pid} is gone (it died mid-update)")
        if stale_ns and mono_ns() - h.write_begin_mono_ns > stale_ns:
            raise TableStale(f"seq {h.seq} odd for {(mono_ns() - h.write_begin_mono_ns) / 1e6:.0f} ms")
    raise TableBusy(f"no consistent copy in {retries} attempts (writer pid {h.writer_pid} busy)")


class EntropyReader:
    """Keeps the table mapped read-only; `read()` returns a consistent Snapshot. Re-opens the path when
    the mapped file was RETIRED (a writer replaced it)."""

    def __init__(self, path: str = DEFAULT_PATH):
        self.path = path
        self._mm: mmap.mmap | None = None
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise TableMissing(f"{self.path}: no entropy table (no writer has run)") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise TableBad(f"file: {size} bytes, shorter than the {HEADER_SIZE}-byte header (truncated)")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            decode_header(bytes(mm[:HEADER_SIZE]), size)
        except TableBad:
            mm.close()
            raise
        self._mm = mm

    def read(self, **kw) -> Snapshot:
        if self._mm is None:
            self._open()
        if struct.unpack_from("<I", self._mm, OFF_TABLE_FLAGS)[0] & TABLE_RETIRED:
            self.close()
            self._open()
        return _read_mapped(self._mm, **kw)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> "EntropyReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_table(path: str = DEFAULT_PATH, **kw) -> Snapshot:
    """Open, read one consistent snapshot, close. Raises TableMissing / TableBad / TableStale / TableBusy."""
    with EntropyReader(path) as r:
        return r.read(**kw)


def lookup(path: str, peer: str, plane: int, key: int = 0, **kw) -> int | None:
    """The port a transport with this key (e.g. its QP number) should use, or None (no entry/ports)."""
    e = read_table(path, **kw).get(peer, plane)
    if e is None or not e.ports:
        return None
    return e.ports[key % len(e.ports)]


__all__ = [
    "DEFAULT_PATH", "MAGIC", "VERSION", "HEADER_SIZE", "ENTRY_SIZE", "MAX_PORTS", "MAX_CAPACITY",
    "TABLE_RETIRED", "ENTRY_FAIL_STATIC", "PORT_VERIFIED", "PORT_DEGRADED",
    "Entry", "Header", "Snapshot", "EntropyError", "EntryError", "TableMissing", "TableBad", "TableStale",
    "TableBusy", "table_size", "encode_entry", "decode_entry", "encode_header", "decode_header", "normalize",
    "entries_from_paths", "EntropyWriter", "EntropyReader", "read_table", "lookup",
]


# ---- CLI: python -m linkpass.entropy (same output and exit codes as rdma/entropy_reader.c) --------

EXIT_OK, EXIT_NOTFOUND, EXIT_USAGE, EXIT_MISSING, EXIT_BAD, EXIT_STALE, EXIT_BUSY, EXIT_IO = range(8)


def format_snapshot(s: Snapshot) -> str:
    """The C reader's text format, byte for byte."""
    import socket

    h = s.header
    lines = [f"table version={h.version} capacity={h.capacity} count={h.count} generation={h.generation} "
             f"seq={h.seq} writer_pid={h.writer_pid} flags={h.table_flags:#x} "
             f"update_realtime_ns={h.update_realtime_ns} update_mono_ns={h.update_mono_ns} "
             f"heartbeat_mono_ns={h.heartbeat_mono_ns}"]
    for e in s.entries:
        version, packed, _ = _addr(e.peer)
        peer = socket.inet_ntop(socket.AF_INET if version == 4 else socket.AF_INET6, packed)
        lines.append(f"entry peer={peer} plane={e.plane} flags={e.flags:#x} generation={e.generation} "
                     f"ports={','.join(map(str, e.ports))} path_ids={','.join(f'{p:08x}' for p in e.path_ids)} "
                     f"port_flags={','.join(map(str, e.port_flags))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m linkpass.entropy", description="Print the entropy table.")
    ap.add_argument("-p", "--path", default=DEFAULT_PATH)
    ap.add_argument("-r", "--retries", type=int, default=DEFAULT_RETRIES)
    ap.add_argument("-s", "--stale-ms", type=int, default=DEFAULT_STALE_NS // 10**6)
    ap.add_argument("lookup", nargs="*", metavar="lookup PEER PLANE [KEY]")
    try:
        a = ap.parse_args(argv)
    except SystemExit:
        return EXIT_USAGE
    kw = {"retries": max(1, a.retries), "stale_ns": a.stale_ms * 10**6}
    try:
        if a.lookup:
            if a.lookup[0] != "lookup" or not 3 <= len(a.lookup) <= 4:
                ap.print_usage(sys.stderr)
                return EXIT_USAGE
            port = lookup(a.path, a.lookup[1], int(a.lookup[2]), int(a.lookup[3]) if len(a.lookup) == 4 else 0, **kw)
            if port is None:
                print("entropy: no entry with ports for this peer and plane", file=sys.stderr)
                return EXIT_NOTFOUND
            print(port)
        else:
            sys.stdout.write(format_snapshot(read_table(a.path, **kw)))
    except (ValueError, EntryError) as e:
        print(f"entropy: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EntropyError as e:
        print(f"entropy: {e}", file=sys.stderr)
        return {TableMissing: EXIT_MISSING, TableBad: EXIT_BAD, TableStale: EXIT_STALE,
                TableBusy: EXIT_BUSY}.get(type(e), EXIT_IO)
    except OSError as e:
        print(f"entropy: {e}", file=sys.stderr)
        return EXIT_IO
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
