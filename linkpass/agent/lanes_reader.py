"""The agent's side of lane reports (docs/lanes.md): every writer's file in the lanes directory,
opened once and read (pread) at every look. Reports come from any local user: each is checked (a
regular file, not a link, of the size its header claims) and a bad one is counted and left alone;
at most MAX_FILES are read. They are read, not mapped: a writer that truncates its file would make
a read through a mapping fault and kill the agent; a short read is only a bad report.
"""
from __future__ import annotations

import os
import stat

from ..core.lanes import FILE_PREFIX, HEADER_SIZE, OFF_HEARTBEAT, Lane, LanesBad, decode_header, decode_lanes, file_size
from ..core.lanes import MAX_CAPACITY

MAX_FILES = 256
RESCAN_NS = 1_000_000_000  # new reports are found this often
STALE_NS = 1_000_000_000  # a writer silent this long is gone (or hung): its lanes are no evidence
REMOVE_NS = 60_000_000_000  # ... and its file is removed after this long
DIR_MODE = 0o1777  # any job may add its own report and remove only its own (sticky, like /tmp)


class _Report:
    __slots__ = ("name", "fd", "size", "ino", "unborn_ns")

    def __init__(self, name: str, fd: int, size: int, ino: int):
        self.name, self.fd, self.size, self.ino = name, fd, size, ino
        self.unborn_ns = 0  # when this reader first saw it without a heartbeat

    def close(self) -> None:
        os.close(self.fd)


class LanesReader:
    """Reads the lane reports in `directory`, which it creates (mode 1777) when missing."""

    def __init__(self, directory: str):
        self.directory = directory
        self.reports: dict[str, _Report] = {}
        self.bad: dict[str, str] = {}  # file -> why it is not read (until it changes)
        self.counts = {"looks": 0, "reports_live": 0, "reports_stale": 0, "reports_bad": 0, "lanes": 0, "removed": 0,
                       "lanes_unknown": 0}
        self._next_scan = 0
        self.generation = 0  # changes whenever the set of open reports does (fds() then differs)
        self._ensure_dir()

    def _ensure_dir(self) -> None:
        try:
            os.mkdir(self.directory, 0o755)
        except FileExistsError:
            return
        os.chmod(self.directory, DIR_MODE)  # mkdir's mode is masked by the umask

    def _scan(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.startswith(FILE_PREFIX))
        except FileNotFoundError:
            self._ensure_dir()
            names = []
        for name in [n for n in self.reports if n not in names]:
            self._drop(name)
        for name in [n for n in self.bad if n not in names]:
            del self.bad[name]
        for name in names[:MAX_FILES]:
            if name not in self.reports:
                self._open(name)

    def _open(self, name: str) -> None:
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.bad[name] = f"cannot open: {exc.strerror}"
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LanesBad("not a regular file")
            if not HEADER_SIZE <= st.st_size <= file_size(MAX_CAPACITY):
                raise LanesBad(f"{st.st_size} bytes is no lane report's size")
            head = os.pread(fd, HEADER_SIZE, 0)
            decode_header(head, st.st_size)
        except (OSError, LanesBad) as exc:
            os.close(fd)
            self.bad[name] = str(exc)
            return
        self.bad.pop(name, None)
        self.reports[name] = _Report(name, fd, st.st_size, st.st_ino)
        self.generation += 1

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
            self._scan()
        lanes: list[Lane] = []
        live = stale = 0
        for name, rep in list(self.reports.items()):
            try:
                copy = os.pread(rep.fd, rep.size, 0)
            except OSError as exc:
                self._refuse(name, f"cannot read: {exc.strerror}")
                continue
            if len(copy) != rep.size:  # the writer cut its file
                self._refuse(name, f"the file is {len(copy)} bytes now, not {rep.size}")
                continue
            heartbeat = int.from_bytes(copy[OFF_HEARTBEAT:OFF_HEARTBEAT + 8], "little")
            if now_ns - heartbeat > STALE_NS:
                stale += 1
                # a heartbeat of 0 is a writer between creating its file and its first beat: its
                # file goes only after this reader has seen it so for REMOVE_NS, not at once
                if heartbeat == 0 and not rep.unborn_ns:
                    rep.unborn_ns = now_ns
                if now_ns - (heartbeat or rep.unborn_ns) > REMOVE_NS:
                    self._remove(name, rep)
                continue
            try:
                lanes += decode_lanes(copy, os.pread(rep.fd, rep.size, 0))
            except (OSError, LanesBad) as exc:  # the writer rewrote its header or cut its file: not a report any more
                self._refuse(name, str(exc))
                continue
            live += 1
        self.counts.update(looks=self.counts["looks"] + 1, reports_live=live, reports_stale=stale,
                           reports_bad=len(self.bad), lanes=len(lanes))
        return lanes

    def _remove(self, name: str, rep: _Report) -> None:
        """A long-dead writer's file goes, if it is still the one we mapped."""
        path = os.path.join(self.directory, name)
        try:
            if os.lstat(path).st_ino == rep.ino:
                os.unlink(path)
                self.counts["removed"] += 1
        except OSError:
            pass  # gone already, or not ours to remove: ignored as stale all the same
        self._drop(name)

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
