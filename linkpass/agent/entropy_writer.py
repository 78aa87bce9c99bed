"""The entropy table's single writer (layout: linkpass.core.entropy_table; docs/entropy-table.md).

On memory ordering. Python has no fences and no atomics; the writer relies on two facts and one
barrier:
  1. Counters (seq, generation, heartbeat, ...) are stored through a memoryview cast to 'Q'. CPython
     packs such an item with a fixed-size 8-byte memcpy, which the compiler emits as one 8-byte
     store; the fields are 8-byte aligned in a page-aligned mapping, so the store is single-copy
     atomic on x86-64 and aarch64. (A plain `mm[a:b] = bytes` of 8 bytes would go through a
     general memcpy, which promises nothing about store width.)
  2. The interpreter executes our statements in order and each one finishes its stores before the
     next begins.
  3. Between the seqlock's steps ("write_begin ; seq odd ; slots and header ; seq even") the
     writer calls `linkpass.kernel._barrier.fence()`, a full CPU barrier (a locked instruction on x86-64, dmb ish
     on aarch64), so the steps reach other cores in that order on weakly ordered CPUs too. x86-64
     would keep them in order without it (TSO); a call costs 15.5 ns there (timeit), three per publish.
Readers pair it with acquire loads and fences (the C reader, rdma/entropy_table.h) or with the
same barrier (the Python reader, linkpass_rdma.entropy).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import time
from typing import Callable, Iterable

from ..core.entropy_table import (DEFAULT_CAPACITY, DEFAULT_PATH, ENTRY_SIZE, HEADER_SIZE, MAGIC, OFF_COUNT,
                                  OFF_GENERATION, OFF_HEARTBEAT, OFF_SEQ, OFF_TABLE_FLAGS, OFF_UPDATE_MONO,
                                  OFF_UPDATE_REALTIME, OFF_WRITE_BEGIN, OFF_WRITER_PID, OFF_WRITER_PIDNS,
                                  TABLE_RETIRED, check_entry, decode_header, decode_snapshot, encode_entry,
                                  encode_header, EntropyError, Entry, EntryError, normalize, Snapshot, table_size,
                                  TableBad, TableBusy)
from ..kernel._barrier import fence
from ..kernel.proc import pid_namespace


class EntropyWriter:
    """The single writer of one table. Not thread-safe: one writer, one thread.

    The table's directory must be writable only by this uid or root (made 0755 if absent; refused
    otherwise: EntropyError naming the fix). Opening takes over a compatible existing table in
    place if this uid owns it and no one else can write it (readers that keep it mapped keep
    working; a section left open by a killed writer is closed by the first publish); anything
    else at the path (another layout or capacity, junk, another owner, group- or world-writable,
    a symlink) is replaced atomically by a new file (temp file in the same directory + rename),
    and an old table of ours is marked RETIRED. `replaced` says why a file was replaced. The
    table starts empty unless `keep=True` (then the existing entries are kept if the file was
    consistent).
    """

    def __init__(self, path: str = DEFAULT_PATH, capacity: int = DEFAULT_CAPACITY, *, keep: bool = False,
                 mono_ns: Callable[[], int] = time.monotonic_ns, realtime_ns: Callable[[], int] = time.time_ns):
        self.path = path
        self.capacity = capacity
        self.size = table_size(capacity)
        self._mono, self._real = mono_ns, realtime_ns
        self._entries: dict[tuple, Entry] = {}  # key -> entry as stored (with its generation)
        self._enc: dict[tuple, bytes] = {}  # key -> its 192-byte slot
        self._slots: list[bytes] = []  # what each slot 0..count-1 holds now
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self.replaced: str | None = None  # why a file found at the path was replaced, not adopted
        self._open(keep)

    # -- lifecycle
    def _open(self, keep: bool) -> None:
        self._trusted_dir()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._replace(retire=False)
            return
        except OSError as exc:  # ELOOP: a symlink; or something we cannot open
            self.replaced = f"{self.path} could not be opened as a file ({exc.strerror}): replaced"
            self._replace(retire=False)
            return
        try:
            untrusted = _untrusted_file(os.fstat(fd))
            if untrusted:  # not locked, not mapped, not written: only renamed over
                os.close(fd)
                fd = -1
                self.replaced = f"{self.path} {untrusted}: not adopted, replaced"
                self._replace(retire=False)
                return
            self._lock(fd)  # also when the file is then replaced: never rename over a live writer
            head = os.pread(fd, HEADER_SIZE, 0)
            junk = len(head) >= len(MAGIC) and head[:len(MAGIC)] != MAGIC
            try:
                ok = not junk and decode_header(head, os.fstat(fd).st_size).capacity == self.capacity
            except TableBad:
                ok = False  # another version / capacity, or truncated: replace it
            if not ok:
                if junk:
                    self.replaced = f"{self.path} held something that is not an entropy table: replaced"
                self._replace(retire=not junk)
                os.close(fd)
                return
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self._fd = fd
        old = None
        if keep:
            try:
                old = _consistent(self._mm)
            except EntropyError:
                old = None  # a killed writer's torn table: start empty
        self._u64(OFF_WRITER_PIDNS, pid_namespace())
        self._u32(OFF_WRITER_PID, os.getpid())
        self._u64(OFF_HEARTBEAT, self._mono())
        # the first section rewrites every slot: whatever a dead writer left half-written goes
        self._publish_map({e.key: e for e in old.entries} if old else {}, full=True)

    def _trusted_dir(self) -> str:
        """The table's directory, made (0755) if absent; refused unless only this uid (or root)
        can write it: in a directory others can write, they could put their own table there."""
        d = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o755, exist_ok=True)
            os.chmod(d, 0o755)  # readers (any uid) must reach the table whatever the umask
        st = os.stat(d)
        if st.st_uid not in (os.geteuid(), 0):
            raise EntropyError(f"entropy.path: directory {d} belongs to uid {st.st_uid}, not to this agent "
                               f"(uid {os.geteuid()}) or root; choose a directory only root can write, "
                               "e.g. /run/linkpass")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise EntropyError(f"entropy.path: directory {d} is writable by {_who(st.st_mode)} (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}): anyone there could plant a table; "
                               f"`chmod go-w {d}` or choose a directory only root can write, e.g. /run/linkpass")
        return d

    def _lock(self, fd: int) -> None:
        """One writer per table: an exclusive flock held while the writer is open."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = struct.unpack("<I", os.pread(fd, 4, OFF_WRITER_PID))[0]
            raise EntropyError(f"{self.path}: another writer (pid {pid}) has the table open") from None

    def _replace(self, retire: bool) -> None:
        """Build a fresh file next to the path and rename it over (readers never see it half-made).
        `retire`: the file replaced is a table of ours; mark it so readers that map it re-open."""
        d = os.path.dirname(os.path.abspath(self.path))
        tmp = os.path.join(d, f".{os.path.basename(self.path)}.{os.getpid()}.tmp")
        now_m, now_r = self._mono(), self._real()
        try:
            os.unlink(tmp)  # left by a crashed process that had our pid: ours to remove
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)  # readable by every reader, writable by this writer only, whatever the umask
            os.ftruncate(fd, self.size)
            os.pwrite(fd, encode_header(self.capacity, writer_pid=os.getpid(), writer_pidns=pid_namespace(),
                                        now_mono_ns=now_m, now_realtime_ns=now_r), 0)
            self._lock(fd)
            mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        old_fd = -1
        if retire:
            try:
                old_fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
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
        fence()
        if seq % 2 == 0:
            seq += 1
            self._u64(OFF_SEQ, seq)  # odd: readers retry from here on
        # (seq already odd: a killed writer's section; we finish it)
        fence()  # seq odd is visible before any slot changes
        return seq

    def _end(self, seq: int) -> None:
        fence()  # every store of the section is visible before seq turns even
        self._u64(OFF_SEQ, seq + 1)

    # -- public API
    def publish(self, entries: Iterable[Entry]) -> int:
        """Replace the whole table; returns the new generation."""
        norm = normalize(entries, self.capacity)
        return self._publish_map({e.key: e for e in norm})

    def update(self, peer: str, plane: int, ports: Iterable[int], path_ids: Iterable[int] = (),
               port_flags: Iterable[int] = (), flags: int = 0) -> int:
        """Set one (peer, plane) entry (inserted if new); returns the new generation."""
        e = check_entry(Entry(peer, plane, tuple(ports), tuple(path_ids), tuple(port_flags), flags), "entry")
        m = dict(self._entries)
        if e.key not in m and len(m) >= self.capacity:
            raise EntryError(f"entry: table full ({self.capacity} entries, capacity)")
        m[e.key] = e
        return self._publish_map(m)

    def remove(self, peer: str, plane: int) -> int:
        """Drop one entry (no-op if absent); returns the generation."""
        key = check_entry(Entry(peer, plane, ()), "entry").key
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


def _who(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit)


def _untrusted_file(st: os.stat_result) -> str | None:
    """Why a file found at the table's path is not ours to adopt in place, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not this writer's {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by {_who(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _consistent(mm) -> Snapshot:
    """The table as a writer holding the lock finds it; TableBusy if a killed writer left a section open."""
    head = bytes(mm[:HEADER_SIZE])
    hdr = decode_header(head, len(mm))
    if hdr.seq & 1:
        raise TableBusy(f"seq {hdr.seq} odd: writer pid {hdr.writer_pid} died mid-update")
    return decode_snapshot(head, bytes(mm[HEADER_SIZE:HEADER_SIZE + min(hdr.count, hdr.capacity) * ENTRY_SIZE]))
