"""BFD-driven route changes: the failover LinkPass is compared against.

FRR 8.4's staticd cannot tie a static route to a BFD session, so this hook does it for one
host: it owns a /32 route to each BFD peer's service address, multipath over the planes (the
shape of LinkPass's RouteActuator: prefsrc = own service address, rto_min), under its own route
protocol number, and rewrites it when bfdd reports a session (peer, plane) down or up.

- **Watching.** bfdd's log is tailed with inotify (woken by bfdd's write, no poll interval) or,
  with `poll_s`, by polling; state changes are the same lines `Bfd.changes` parses.
- **Atomic, never the last plane.** One RTM_NEWROUTE with NLM_F_REPLACE per change; a change
  that would leave a peer no plane keeps the current route (fail static), as LinkPass does.
- **Timed.** Every route change records when the netlink replace returned (CLOCK_MONOTONIC,
  shared by all namespaces), when the hook read the log line and when bfdd logged it, so a
  benchmark can split fault -> route rewritten into detection, notification and actuation.

A hook changes only its own host's outbound routes: to move a connection off a plane both
ways (its ACKs too), run one hook on each end.

It runs as a thread of the calling process with its own netlink socket (pyroute2 sockets are
per thread). `stop()` removes its routes; the testbed's baseline ECMP route remains.
"""
from __future__ import annotations

import ctypes
import os
import select
import threading
import time
from dataclasses import dataclass, field

from ..kernel.rtnl import IPRoute

from .frr import Bfd, FrrError, StateChange, parse_state_change
from ..core.names import host_index, host_name
from .topology import host_link_addrs, nic_ifname

RTPROT_BFD_HOOK = 177  # LinkPass's actuator uses 176; `ip route show proto 177`
IN_MODIFY = 0x2
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class RouteChange:
    mono_ns: int  # CLOCK_MONOTONIC when the netlink replace returned
    peer: str  # a host name
    planes: tuple[int, ...]  # planes of the route after the change
    cause: StateChange | None = None  # the bfdd state change behind it (None: initial install)
    event_mono_ns: int | None = None  # cause's log timestamp, moved to CLOCK_MONOTONIC
    seen_mono_ns: int | None = None  # when the hook read that log line


@dataclass
class BfdRouteHook:
    bfd: Bfd
    host: int
    rto_min_ms: int = 10
    poll_s: float | None = None  # None: inotify; else poll the log every poll_s
    changes: list[RouteChange] = field(default_factory=list)

    def __post_init__(self) -> None:
        fab = self.bfd.fab
        self.ns = fab.netns(host_name(self.host))
        self.own_service = fab.service_addr(self.host)
        planes = range(fab.spec.planes)
        self.hops = {p: (str(host_link_addrs(p, self.host)[0]), nic_ifname(p)) for p in planes}
        # the peer NIC address in a log line names the session's (peer, plane)
        self.session_of: dict[str, tuple[str, int]] = {}
        for a, b, plane in self.bfd.sessions:
            if self.host in (a, b):
                other = b if a == self.host else a
                self.session_of[fab.nic_addr(other, plane)] = (host_name(other), plane)
        if not self.session_of:
            raise FrrError(f"{host_name(self.host)} has no BFD sessions (start the Bfd first)")
        self.peers = {peer: fab.service_addr(host_index(peer)) for peer, _ in self.session_of.values()}
        self.installed: dict[str, tuple[int, ...]] = {}
        self._down: set[tuple[str, int]] = set()  # sessions not up; any other plane counts as usable
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: Exception | None = None  # why the watching thread died, if it did

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 5.0) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"bfd-hook-{host_name(self.host)}",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or self.error:
            self.stop()
            raise FrrError(f"BFD route hook on {host_name(self.host)} did not start: {self.error!r}")

    def stop(self) -> None:
        """Stop watching and remove our routes (also after a failed start)."""
        self._stop.set()
        if self._thread:
            self._thread.join(5.0)
        with IPRoute(netns=self.ns) as ipr:
            for service in self.peers.values():
                try:
                    ipr.route("del", dst=service, dst_len=32, proto=RTPROT_BFD_HOOK)
                except Exception as exc:  # ESRCH: not there
                    if getattr(exc, "code", None) != 3:
                        raise
        self.installed.clear()

    def records(self) -> list[RouteChange]:
        with self._lock:
            return list(self.changes)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        ipr = IPRoute(netns=self.ns)  # made in this thread: pyroute2 sockets are per thread
        ino = -1
        try:
            index = {link.get_attr("IFLA_IFNAME"): link["index"] for link in ipr.get_links()}
            for r in ipr.get_routes(family=2, table=254):  # replace would silently take over a foreign route
                if r.get_attr("RTA_DST") in self.peers.values() and r["dst_len"] == 32 \
                        and r["proto"] != RTPROT_BFD_HOOK:
                    raise FrrError(f"{r.get_attr('RTA_DST')} in {self.ns} already has a route of proto {r['proto']}")
            path = self.bfd.log_path(self.host)
            with open(path, "rb") as log:
                if self.poll_s is None:  # watch before the first read: no write falls in between
                    ino = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
                    if ino < 0 or _libc.inotify_add_watch(ino, path.encode(), IN_MODIFY) < 0:
                        raise OSError(ctypes.get_errno(), f"inotify on {path}")
                tail = self._read(log, b"")  # the log so far tells the current state of every session
                for peer in self.peers:
                    self._apply(ipr, index, peer, None, None)
                ready.set()
                while not self._stop.is_set():
                    if ino >= 0:
                        if select.select([ino], [], [], 0.1)[0]:
                            os.read(ino, 4096)  # the events only say "written"; the file says what
                    else:
                        time.sleep(self.poll_s)
                    causes: dict[str, StateChange] = {}
                    tail = self._read(log, tail, causes)
                    for peer, cause in causes.items():  # one replace per peer per batch
                        self._apply(ipr, index, peer, cause, time.monotonic_ns())
        except Exception as exc:  # seen by start(); a hook that dies later shows as missing records
            self.error = exc
            ready.set()
        finally:
            if ino >= 0:
                os.close(ino)
            ipr.close()

    def _read(self, log, tail: bytes, causes: dict[str, StateChange] | None = None) -> bytes:
        """Note the state changes in the log's new lines; returns an unfinished last line."""
        chunk = log.read()
        if not chunk:
            return tail
        lines = (tail + chunk).split(b"\n")
        for line in lines[:-1]:
            change = parse_state_change(line.decode(errors="replace"))
            key = self._note(change)
            if key and causes is not None:
                causes[key[0]] = change
        return lines[-1]

    def _note(self, change: StateChange | None) -> tuple[str, int] | None:
        key = self.session_of.get(change.peer) if change else None
        if key:
            (self._down.discard if change.new == "up" else self._down.add)(key)
        return key

    def _apply(self, ipr: IPRoute, index: dict[str, int], peer: str, cause: StateChange | None,
               seen: int | None) -> None:
        planes = tuple(p for p in sorted(self.hops) if (peer, p) not in self._down)
        if not planes:  # never the last plane: keep what is there (fail static)
            planes = self.installed.get(peer, tuple(sorted(self.hops)))
        if planes == self.installed.get(peer):
            return
        hops = [{"gateway": self.hops[p][0], "oif": index[self.hops[p][1]]} for p in planes]
        kw = {"dst": self.peers[peer], "dst_len": 32, "proto": RTPROT_BFD_HOOK, "prefsrc": self.own_service,
              # locked, like LinkPass's routes: TCP ignores an unlocked rto_min
              "metrics": {"RTAX_LOCK": 1 << 13, "RTAX_RTO_MIN": self.rto_min_ms}}
        if len(hops) == 1:
            kw.update(hops[0])
        else:
            kw["multipath"] = hops
        ipr.route("replace", **kw)
        done = time.monotonic_ns()
        self.installed[peer] = planes
        event = cause.wall_ns - (time.time_ns() - time.monotonic_ns()) if cause else None
        with self._lock:
            self.changes.append(RouteChange(done, peer, planes, cause, event, seen))
