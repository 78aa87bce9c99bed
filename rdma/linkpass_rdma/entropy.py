"""The entropy table's Python reader (layout: linkpass.core.entropy_table; docs/entropy-table.md).

A transport that picks its own UDP source ports reads the healthy ones per (peer, plane) here:
`EntropyReader` keeps the table mapped and returns consistent snapshots (the seqlock protocol),
`read_table` reads once, `lookup` gives one port for a key such as a QP number.
`python -m linkpass_rdma.entropy` prints the table with the same output and exit codes as the
C reader, rdma/entropy_reader.c.

The reader puts a full barrier (`linkpass.kernel._barrier.fence`) after its first load of seq and
before its second, so its loads stay in order on weakly ordered CPUs (aarch64) too; the C reader
uses acquire loads and an acquire fence to the same end.
"""
from __future__ import annotations

import mmap
import os
import pwd
import struct
import time
from typing import Callable

from linkpass.core.entropy_table import (AGENT_USER, DEFAULT_PATH, DEFAULT_RETRIES, DEFAULT_STALE_NS, HEADER_SIZE, OFF_SEQ,
                                         OFF_TABLE_FLAGS, OFF_COUNT, ENTRY_SIZE, TABLE_RETIRED, EntropyError,
                                         EntryError, Snapshot, TableBad, TableBusy, TableMissing, TableStale, TableUntrusted,
                                         pack_addr, decode_header, decode_snapshot, trust_problem)
from linkpass.kernel._barrier import fence
from linkpass.kernel.proc import pid_dead

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
            s0 = seq_cell[0]
            fence()  # the copy's loads come after this load of seq
            if s0 & 1:
                odd_spins = odd_spins + 1 if s0 == odd_seq else 1
                odd_seq = s0
                if odd_spins % 64 == 0:
                    h = decode_header(bytes(mm[:HEADER_SIZE]))
                    if pid_check and pid_dead(h.writer_pid, h.writer_pidns):
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
            fence()  # ... and before the second load of seq
            if seq_cell[0] != s0:
                if attempt % 16 == 15:
                    os.sched_yield()
                continue
            return decode_snapshot(head, body)
    finally:
        seq_cell.release()
        mv.release()
    h = decode_header(bytes(mm[:HEADER_SIZE]))
    if h.seq & 1:
        if pid_check and pid_dead(h.writer_pid, h.writer_pidns):
            raise TableStale(f"seq {h.seq} odd and writer pid {h.writer_pid} is gone (it died mid-update)")
        if stale_ns and mono_ns() - h.write_begin_mono_ns > stale_ns:
            raise TableStale(f"seq {h.seq} odd for {(mono_ns() - h.write_begin_mono_ns) / 1e6:.0f} ms")
    raise TableBusy(f"no consistent copy in {retries} attempts (writer pid {h.writer_pid} busy)")


def default_trusted_uids(agent_user: str = AGENT_USER) -> tuple[int, ...]:
    """Root, this process's uid and the agent's system user (when the host has one)."""
    uids = {0, os.geteuid()}
    try:
        uids.add(pwd.getpwnam(agent_user).pw_uid)
    except KeyError:
        pass
    return tuple(sorted(uids))


class EntropyReader:
    """Keeps the table mapped read-only; `read()` returns a consistent Snapshot. Re-opens the path when
    the mapped file was RETIRED (a writer replaced it)."""

    def __init__(self, path: str = DEFAULT_PATH, trusted_uids: tuple[int, ...] | None = None):
        """`trusted_uids`: who may own the table and its directory (default `default_trusted_uids()`);
        a table others could have written is refused (TableUntrusted)."""
        self.path = path
        self.trusted_uids = trusted_uids if trusted_uids is not None else default_trusted_uids()
        self._mm: mmap.mmap | None = None
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TableMissing(f"{self.path}: no entropy table (no writer has run)") from None
        try:
            st = os.fstat(fd)
            where = f"{self.path}"
            problem = trust_problem(st.st_mode, st.st_uid, self.trusted_uids)
            if problem is None:
                where = os.path.dirname(os.path.abspath(self.path))
                dst = os.stat(where)
                problem = trust_problem(dst.st_mode, dst.st_uid, self.trusted_uids)
            if problem:
                raise TableUntrusted(f"{where} {problem}: its ports would steer this host's traffic, so it is not "
                                     "read; the agent (root) writes the table in a directory only root can write")
            size = st.st_size
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


# the readers' own exit codes (this CLI and rdma/entropy_reader.c), not the linkpass CLI's
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
        version, packed, _ = pack_addr(e.peer)
        peer = socket.inet_ntop(socket.AF_INET if version == 4 else socket.AF_INET6, packed)
        lines.append(f"entry peer={peer} plane={e.plane} flags={e.flags:#x} generation={e.generation} "
                     f"ports={','.join(map(str, e.ports))} path_ids={','.join(f'{p:08x}' for p in e.path_ids)} "
                     f"port_flags={','.join(map(str, e.port_flags))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m linkpass_rdma.entropy", description="Print the entropy table.")
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
