"""The agent's side of lane reports (docs/lanes.md): every writer's file in the lanes directory,
opened once and read (pread) at every look. Reports come from any local user, so nothing in the
directory is trusted and no user can cost the agent more than a bounded share:

- each file is checked (a regular file, not a link, of the size its header claims); a bad one is
  counted and left alone;
- at most PER_OWNER reports of one owner (file uid) are open, and MAX_FILES in all: files one
  user makes cannot crowd out another user's reports, whatever they are named;
- only live writers count: a report whose heartbeat is over STALE_NS old is not opened, and an
  open one that went silent is read no further than its 64-byte header (its lanes are no
  evidence); when an owner has more files than its share, silent ones make room for the others;
- a look reads at most LOOK_BYTES of lanes; a report it has no room for keeps the lanes of its
  last read, and goes first at the next look;
- the directory listing is read at most MAX_ENTRIES names deep, once a second, and at most
  MAX_OPENS files are tried per scan (a silent one after the others of its owner).

They are read, not mapped: a writer that truncates its file would make a read through a mapping
fault and kill the agent; a short read is only a bad report.
"""
from __future__ import annotations

import os
import stat

from ..core.lanes import FILE_PREFIX, HEADER_SIZE, LANE_SIZE, MAX_CAPACITY, OFF_HEARTBEAT, Lane, LanesBad
from ..core.lanes import decode_header, decode_lanes, file_size

MAX_FILES = 256  # reports open at once (the probe core watches as many)
PER_OWNER = 32  # ... of one owner: a GPU host's jobs of one user run a process per GPU
MAX_ENTRIES = 16384  # directory entries looked at per scan
MAX_OPENS = 512  # files tried per scan (a silent one is tried again after the others)
LOOK_BYTES = 256 << 10  # lane bytes read per look (each report read twice: its copy, then its seq words)
RESCAN_NS = 1_000_000_000  # new reports are found this often
STALE_NS = 1_000_000_000  # a writer silent this long is gone (or hung): its lanes are no evidence
REMOVE_NS = 60_000_000_000  # ... and its file is removed after this long
DIR_MODE = 0o1777  # any job may add its own report and remove only its own (sticky, like /tmp)


class _Report:
    __slots__ = ("name", "fd", "size", "ino", "uid", "unborn_ns", "live", "lanes")

    def __init__(self, name: str, fd: int, size: int, ino: int, uid: int):
        self.name, self.fd, self.size, self.ino, self.uid = name, fd, size, ino, uid
        self.unborn_ns = 0  # when this reader first saw it without a heartbeat
        self.live = True  # its heartbeat was fresh at the last look
        self.lanes: list[Lane] = []  # as last read

    def close(self) -> None:
        os.close(self.fd)


def _stale(heartbeat: int, now_ns: int) -> bool:
    return now_ns - heartbeat > STALE_NS


class LanesReader:
    """Reads the lane reports in `directory`, which it creates (mode 1777) when missing."""

    def __init__(self, directory: str):
        self.directory = directory
        self.reports: dict[str, _Report] = {}
        self.bad: dict[str, str] = {}  # file -> why it is not read (until it changes)
        self.counts = {"looks": 0, "reports_live": 0, "reports_stale": 0, "reports_bad": 0, "lanes": 0, "removed": 0,
                       "lanes_unknown": 0, "reports_over_share": 0, "reports_deferred": 0, "entries_unread": 0}
        self._next_scan = 0
        self._first = 0  # the report a look reads first (the one the last look had no room for)
        self._passed: set[str] = set()  # files made room for: others of their owner go first
        self.generation = 0  # changes whenever the set of open reports does (fds() then differs)
        self._ensure_dir()

    def _ensure_dir(self) -> None:
        try:
            os.mkdir(self.directory, 0o755)
        except FileExistsError:
            return
        os.chmod(self.directory, DIR_MODE)  # mkdir's mode is masked by the umask

    def _listing(self) -> dict[int, list[str]]:
        """The report names in the directory by owner uid (regular files only; the rest are bad)."""
        owners: dict[int, list[str]] = {}
        seen = 0
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    seen += 1
                    if seen > MAX_ENTRIES:
                        self.counts["entries_unread"] += 1
                        break
                    if not entry.name.startswith(FILE_PREFIX):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone meanwhile
                    if not stat.S_ISREG(st.st_mode):
                        self.bad[entry.name] = "not a regular file"
                        continue
                    owners.setdefault(st.st_uid, []).append(entry.name)
        except FileNotFoundError:
            self._ensure_dir()
        return owners

    def _scan(self, now_ns: int) -> None:
        owners = self._listing()
        names = {n for ns in owners.values() for n in ns}
        for name in [n for n in self.reports if n not in names]:
            self._drop(name)
        for name in [n for n in self.bad if n not in names]:
            if not os.path.lexists(os.path.join(self.directory, name)):
                del self.bad[name]
        self._passed &= names
        over, tries = 0, 0
        for uid, mine in sorted(owners.items(), key=lambda kv: len(kv[1])):  # small owners first
            held = [self.reports[n] for n in mine if n in self.reports]
            waiting = sorted((n for n in mine if n not in self.reports),
                             key=lambda n: (n in self.bad, n in self._passed, n))
            # an owner at its share: its silent reports make room for files not tried yet
            for rep in sorted((r for r in held if not r.live), key=lambda r: r.name):
                if len(held) < PER_OWNER or not waiting or waiting[0] in self._passed:
                    break
                self._passed.add(rep.name)
                self._drop(rep.name)
                held.remove(rep)
            for name in waiting:
                if len(held) >= PER_OWNER or len(self.reports) >= MAX_FILES or tries >= MAX_OPENS:
                    over += 1
                    continue
                tries += 1
                rep = self._open(name, uid, now_ns)
                if rep is not None:
                    held.append(rep)
        self.counts["reports_over_share"] = over

    def _open(self, name: str, uid: int, now_ns: int) -> _Report | None:
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.bad[name] = f"cannot open: {exc.strerror}"
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LanesBad("not a regular file")
            if not HEADER_SIZE <= st.st_size <= file_size(MAX_CAPACITY):
                raise LanesBad(f"{st.st_size} bytes is no lane report's size")
            head = decode_header(os.pread(fd, HEADER_SIZE, 0), st.st_size)
        except (OSError, LanesBad) as exc:
            os.close(fd)
            self.bad[name] = str(exc)
            return None
        if head.heartbeat_ns and _stale(head.heartbeat_ns, now_ns):
            # a writer gone already: not worth a place among the live (a hung one that beats
            # again is opened at a later scan); after REMOVE_NS its file goes
            os.close(fd)
            self.bad.pop(name, None)
            self._passed.add(name)  # the others of its owner are tried first at the next scan
            if now_ns - head.heartbeat_ns > REMOVE_NS:
                self._unlink(name, st.st_ino)
            return None
        self.bad.pop(name, None)
        self._passed.discard(name)
        rep = self.reports[name] = _Report(name, fd, st.st_size, st.st_ino, st.st_uid)
        self.generation += 1
        return rep

    def _drop(self, name: str) -> None:
        self.reports.pop(name).close()
        self.generation += 1

    def _refuse(self, name: str, why: str) -> None:
        """An open report that is not one any more: counted as bad, no longer read."""
        self.bad[name] = why
        self._drop(name)

    def look(self, now_ns: int) -> list[Lane]:
        """Every lane of every live report now (reports are rescanned once a second)."""
        if now_ns >= self._next_scan:
            self._next_scan = now_ns + RESCAN_NS
            self._scan(now_ns)
        lanes: list[Lane] = []
        live = stale = deferred = 0
        budget = LOOK_BYTES
        order = list(self.reports.items())
        first = self._first % len(order) if order else 0
        self._first = None
        for k in range(len(order)):
            name, rep = order[(first + k) % len(order)]
            try:
                head = os.pread(rep.fd, HEADER_SIZE, 0)
                used = min(decode_header(head, rep.size).used, (rep.size - HEADER_SIZE) // LANE_SIZE)
            except OSError as exc:
                self._refuse(name, f"cannot read: {exc.strerror}")
                continue
            except LanesBad as exc:  # the writer rewrote its header, or cut its file
                self._refuse(name, str(exc) if os.fstat(rep.fd).st_size == rep.size
                             else f"the file is {os.fstat(rep.fd).st_size} bytes now, not {rep.size}")
                continue
            heartbeat = int.from_bytes(head[OFF_HEARTBEAT:OFF_HEARTBEAT + 8], "little")
            if _stale(heartbeat, now_ns):
                rep.live, rep.lanes = False, []
                stale += 1
                # a heartbeat of 0 is a writer between creating its file and its first beat: its
                # file goes only after this reader has seen it so for REMOVE_NS, not at once
                if heartbeat == 0 and not rep.unborn_ns:
                    rep.unborn_ns = now_ns
                if now_ns - (heartbeat or rep.unborn_ns) > REMOVE_NS:
                    self._remove(name, rep)
                continue
            rep.live = True
            live += 1
            want = HEADER_SIZE + used * LANE_SIZE
            if 2 * (want - HEADER_SIZE) > budget and budget < LOOK_BYTES:
                deferred += 1  # no room in this look: its last lanes stand, and it goes first next time
                if self._first is None:
                    self._first = (first + k) % len(order)
                lanes += rep.lanes
                continue
            budget -= 2 * (want - HEADER_SIZE)
            try:
                copy = os.pread(rep.fd, want, 0)
                if len(copy) != want:  # the writer cut its file
                    raise LanesBad(f"the file is {os.fstat(rep.fd).st_size} bytes now, not {rep.size}")
                rep.lanes = decode_lanes(copy, os.pread(rep.fd, want, 0), rep.size)
            except (OSError, LanesBad) as exc:  # the writer rewrote its header or cut its file: not a report any more
                self._refuse(name, str(exc) if isinstance(exc, LanesBad) else f"cannot read: {exc.strerror}")
                live -= 1
                continue
            lanes += rep.lanes
        if self._first is None:
            self._first = 0
        self.counts.update(looks=self.counts["looks"] + 1, reports_live=live, reports_stale=stale,
                           reports_bad=len(self.bad), lanes=len(lanes), reports_deferred=deferred)
        return lanes

    def _remove(self, name: str, rep: _Report) -> None:
        """A long-dead writer's file goes, if it is still the one we opened."""
        self._unlink(name, rep.ino)
        self._drop(name)

    def _unlink(self, name: str, ino: int) -> None:
        path = os.path.join(self.directory, name)
        try:
            if os.lstat(path).st_ino == ino:
                os.unlink(path)
                self.counts["removed"] += 1
        except OSError:
            pass  # gone already, or not ours to remove: ignored as stale all the same

    def fds(self) -> list[int]:
        """The open reports' descriptors (the probe core's lane watch reads them too)."""
        return [rep.fd for rep in self.reports.values()]

    @property
    def live(self) -> bool:
        """Is any report being read (the agent looks often only then)?"""
        return bool(self.reports)

    def close(self) -> None:
        for rep in self.reports.values():
            rep.close()
        self.reports.clear()
